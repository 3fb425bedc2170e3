// Live KV migration, the decode worker's half (worker.proto, MigrateKvRequest): a draining worker
// parks its decoding requests with their KV, and ships a parked request's blocks into another
// decode worker's reservation when the router asks. A parked request is a reservation in state
// kReceived like any other: it ends at its lease, by Abort, by a kv_attached Decode call that
// resumes it here, or once MigrateKv has shipped it.
#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "decode_worker/decode_service.h"
#include "rpc/kv_target_auth.h"
#include "rpc/rpc_util.h"

namespace duet {

uint64_t DecodeService::NewParkedTransferId() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  for (;;) {
    const uint64_t id = rng();
    if (id != 0 && !by_transfer_.contains(id)) return id;
  }
}

absl::StatusOr<uint64_t> DecodeService::Park(LlmEngine& engine, const std::string& request_id) {
  DUET_ASSIGN_OR_RETURN(LlmEngine::DetachedRequest detached, engine.Detach(request_id));
  auto r = std::make_shared<Reservation>();
  r->request_id = request_id;
  r->seq = detached.seq;
  r->num_tokens = int32_t(detached.num_computed_tokens());
  r->lease = options_.default_lease;
  r->parked = true;
  // A kv_attached Decode call must continue exactly these tokens.
  r->cached_prefix = std::move(detached.prompt);
  r->cached_prefix.insert(r->cached_prefix.end(), detached.output.begin(), detached.output.end() - 1);
  const std::vector<int32_t>& table = engine.BlockTable(r->seq);
  const size_t num_blocks = (size_t(r->num_tokens) + size_t(block_size_) - 1) / size_t(block_size_);
  DUET_CHECK(table.size() >= num_blocks);
  r->cache_blocks.assign(table.begin(), table.begin() + int64_t(num_blocks));
  absl::MutexLock lock(&mu_);
  r->transfer_id = NewParkedTransferId();
  by_transfer_[r->transfer_id] = r;
  transfer_by_request_[request_id] = r->transfer_id;
  MarkReceivedLocked(r);  // claimed by a resume here, or ended by MigrateKv, Abort or the lease
  return r->transfer_id;
}

grpc::ServerUnaryReactor* DecodeService::MigrateKv(grpc::CallbackServerContext* context,
                                                   const v1::MigrateKvRequest* request, v1::MigrateKvResponse*) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto fail = [reactor](grpc::StatusCode code, std::string message) {
    reactor->Finish(grpc::Status(code, std::move(message)));
    return reactor;
  };
  std::shared_ptr<Reservation> r = FindByTransfer(request->parked_transfer_id());
  if (r == nullptr || !r->parked || r->request_id != request->request_id()) {
    return fail(grpc::StatusCode::FAILED_PRECONDITION,
                absl::StrCat("request '", request->request_id(), "' has no parked KV with transfer id ",
                             request->parked_transfer_id()));
  }
  const v1::KvTarget& target = request->target();
  if (absl::Status granted = rpc::VerifyKvTarget(options_.kv_target_key, target); !granted.ok()) {
    return fail(rpc::ToGrpc(granted).error_code(), std::string(granted.message()));
  }
  if (target.receiver_descriptor().empty() || target.block_ids().empty()) {
    return fail(grpc::StatusCode::INVALID_ARGUMENT,
                "the KV target needs a receiver descriptor and host block ids (from the destination's ReserveKv)");
  }
  if (target.first_token() >= uint32_t(r->num_tokens) || target.first_token() % uint32_t(block_size_) != 0) {
    return fail(grpc::StatusCode::FAILED_PRECONDITION,
                absl::StrCat("the KV target starts at token ", target.first_token(), " of ", r->num_tokens,
                             ": not before the end on a boundary of this worker's ", block_size_, "-token blocks"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (r->state != ReservationState::kReceived) {
      return fail(grpc::StatusCode::FAILED_PRECONDITION,
                  absl::StrCat("request '", r->request_id, "' is no longer parked here (resumed, shipped or ended)"));
    }
    r->state = ReservationState::kShipping;
    if (r->claim_timer != 0) timer_.Cancel(r->claim_timer);
    r->claim_timer = 0;
  }
  absl::StatusOr<kvtransfer::PeerId> peer = PeerFor(target.receiver_descriptor());
  if (!peer.ok()) {
    Unship(r);
    return fail(grpc::StatusCode::UNAVAILABLE,
                absl::StrCat("cannot connect to the destination's KV receiver: ", peer.status().message()));
  }
  loop_->Post([this, r, target, peer = *peer, reactor](LlmEngine& engine) {
    Ship(engine, r, target, peer, [this, r, reactor](const absl::Status& shipped) {
      if (!shipped.ok()) {
        Unship(r);
        reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                     absl::StrCat("shipping the KV of request '", r->request_id,
                                                  "' failed: ", shipped.ToString())));
        return;
      }
      {
        absl::MutexLock lock(&mu_);
        EndLocked(*r, absl::OkStatus());  // the blocks go back to the engine
      }
      reactor->Finish(grpc::Status::OK);
    });
  });
  return reactor;
}

void DecodeService::Ship(LlmEngine& engine, const std::shared_ptr<Reservation>& r, const v1::KvTarget& target,
                         kvtransfer::PeerId peer, std::function<void(absl::Status)> done) {
  const size_t first_block = target.first_token() / uint32_t(block_size_);
  std::vector<int32_t> source(r->cache_blocks.begin() + int64_t(first_block), r->cache_blocks.end());
  std::vector<int32_t> staged;
  if (staging_ != nullptr) {  // a device cache: the host pools the sender reads are the staging's
    absl::StatusOr<std::vector<int32_t>> allocated = staging_->Allocate(int64_t(source.size()));
    if (!allocated.ok()) return done(allocated.status());
    staged = *std::move(allocated);
    for (int64_t layer = 0; layer < engine.model_config().num_layers; ++layer) {
      if (absl::Status s = staging_->StageLayer(layer, source, staged); !s.ok()) {
        staging_->Free(staged);
        return done(s);
      }
    }
  }
  const std::vector<int32_t>& sent = staging_ != nullptr ? staged : source;
  kvtransfer::LayerSend send;
  send.request_id = target.transfer_id();
  send.num_layers = uint32_t(engine.model_config().num_layers);
  send.num_tokens = uint32_t(r->num_tokens) - target.first_token();
  send.src_block_ids.assign(sent.begin(), sent.end());
  send.dst_block_ids.assign(target.block_ids().begin(), target.block_ids().end());
  send.with_checksums = options_.verify_kv_checksums;
  (void)sender_->SendLayer(peer, std::move(send));  // Finish reports every layer's outcome
  sender_->Finish(peer, target.transfer_id(),
                  [this, peer, staged, transfer_id = target.transfer_id(), done = std::move(done)](const absl::Status& s) {
                    if (!s.ok()) (void)sender_->Abort(peer, transfer_id);
                    if (!staged.empty()) staging_->Free(staged);
                    done(s);
                  });
}

void DecodeService::Unship(const std::shared_ptr<Reservation>& r) {
  absl::MutexLock lock(&mu_);
  if (r->state != ReservationState::kShipping) return;
  if (r->cancelled.has_value()) return EndLocked(*r, *r->cancelled);  // aborted while it shipped
  MarkReceivedLocked(r);
}

absl::StatusOr<kvtransfer::PeerId> DecodeService::PeerFor(const std::string& descriptor) {
  absl::MutexLock lock(&peers_mu_);  // rare (a drain's moves): connecting under the lock is fine
  auto it = peers_.find(descriptor);
  if (it != peers_.end()) return it->second;
  DUET_ASSIGN_OR_RETURN(kvtransfer::PeerId peer, sender_->Connect(descriptor));
  peers_.emplace(descriptor, peer);
  return peer;
}

}  // namespace duet

#include "decode_worker/decode_service.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/blocking_queue.h"
#include "common/check.h"
#include "kvtransfer/ucx_transport.h"
#include "rpc/rpc_util.h"

namespace duet {
namespace {

grpc::Status Error(grpc::StatusCode code, std::string message) {
  return grpc::Status(code, std::move(message));
}

void ToResponse(const RequestOutput& out, const SamplingParams& params, v1::GenerateResponse* r) {
  r->set_request_id(out.id);
  for (int32_t id : out.new_token_ids) r->add_token_ids(id);
  r->set_text(out.new_text);
  if (params.logprobs >= 0) {
    for (size_t i = 0; i < out.new_token_ids.size() && i < out.new_logprobs.size(); ++i) {
      SampledToken token{out.new_token_ids[i], out.new_logprobs[i],
                         i < out.new_top_logprobs.size() ? out.new_top_logprobs[i]
                                                         : std::vector<TokenLogprob>{}};
      rpc::ToProto(token, r->add_logprobs());
    }
  }
  if (out.finished) {
    r->set_finished(true);
    r->set_finish_reason(FinishReasonName(out.finish_reason));
  }
}

std::string ModelName(const DecodeServiceOptions& options, const EngineConfig& config) {
  if (!options.model_name.empty()) return options.model_name;
  std::filesystem::path path(config.model_dir);
  if (!path.has_filename()) path = path.parent_path();
  return path.filename().string();
}

std::optional<metrics::FinishedReason> FinishedReasonOf(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return metrics::FinishedReason::kStop;
    case FinishReason::kLength:
      return metrics::FinishedReason::kLength;
    case FinishReason::kAbort:
      return metrics::FinishedReason::kAbort;
    default:
      return std::nullopt;
  }
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

absl::StatusOr<std::unique_ptr<DecodeService>> DecodeService::Create(std::unique_ptr<LlmEngine> engine,
                                                                     DecodeServiceOptions options) {
  absl::StatusOr<WorkerKvPools> pools =
      MakeWorkerKvPools(engine->kv_cache(), engine->config().scheduler, options.kv_pools);
  if (!pools.ok()) {
    return absl::Status(pools.status().code(),
                        absl::StrCat("cannot set up the KV staging: ", pools.status().message()));
  }
  std::unique_ptr<DecodeService> service(new DecodeService(std::move(engine), options));
  DecodeService* self = service.get();
  service->kv_token_bytes_ = KvTokenBytes(pools->memory.layout);
  service->staging_ = std::move(pools->staging);
  kvtransfer::ReceiverCallbacks callbacks;
  callbacks.on_layer_received = [self](uint64_t transfer_id, uint32_t) { self->OnLayerReceived(transfer_id); };
  callbacks.on_request_done = [self](uint64_t transfer_id, const absl::Status& status) {
    self->OnRequestDone(transfer_id, status);
  };
  callbacks.on_blocks_released = [self](const kvtransfer::ReleasedLease& lease) {
    self->OnBlocksReleased(lease.request_id,
                           absl::StrCat("its KV lease ended (", std::string(kvtransfer::LeaseEndName(lease.reason)), ")"));
  };
  absl::StatusOr<std::unique_ptr<kvtransfer::KvReceiver>> receiver =
      kvtransfer::CreateUcxKvReceiver(pools->memory, std::move(callbacks));
  if (!receiver.ok()) {
    return absl::Status(receiver.status().code(),
                        absl::StrCat("cannot start the KV receiver: ", receiver.status().message()));
  }
  service->receiver_ = std::move(*receiver);
  service->reaper_ = std::thread([self] { self->ReapLoop(); });
  return service;
}

DecodeService::DecodeService(std::unique_ptr<LlmEngine> engine, DecodeServiceOptions options)
    : options_(options),
      block_size_(engine->config().block_size),
      metrics_(std::make_unique<metrics::DuetMetrics>(metrics_registry_, ModelName(options, engine->config()),
                                                      metrics::Role::kDecode,
                                                      engine->config().scheduler.max_model_len)),
      loop_(std::make_unique<EngineLoop>(std::move(engine))) {}

DecodeService::~DecodeService() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.SignalAll();
  if (reaper_.joinable()) reaper_.join();
  // Releases the leases it still holds (through OnBlocksReleased) while the engine is alive.
  receiver_.reset();
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, r] : by_transfer_) r->owns_blocks = false;  // the engine goes with the loop
    by_transfer_.clear();
    transfer_by_request_.clear();
  }
  loop_.reset();
}

void DecodeService::EndLocked(Reservation& r, absl::Status why) {
  if (r.state == ReservationState::kClaimed || r.state == ReservationState::kEnded) return;
  r.state = ReservationState::kEnded;
  r.failure = std::move(why);
  if (!r.staging_blocks.empty()) {
    staging_->Free(r.staging_blocks);
    r.staging_blocks.clear();
  }
  if (r.owns_blocks) {
    r.owns_blocks = false;
    const SequenceId seq = r.seq;
    loop_->Post([seq](LlmEngine& engine) { engine.ReleaseKv(seq); });
  }
  by_transfer_.erase(r.transfer_id);
  auto it = transfer_by_request_.find(r.request_id);
  if (it != transfer_by_request_.end() && it->second == r.transfer_id) transfer_by_request_.erase(it);
  cv_.SignalAll();
}

void DecodeService::OnLayerReceived(uint64_t transfer_id) {
  absl::MutexLock lock(&mu_);
  auto it = by_transfer_.find(transfer_id);
  if (it == by_transfer_.end()) return;
  if (it->second->first_layer_time == absl::InfinitePast()) it->second->first_layer_time = absl::Now();
}

void DecodeService::OnRequestDone(uint64_t transfer_id, const absl::Status& status) {
  // Our own cancellations (Abort, a Decode call that gave up) are not transfer failures.
  if (!status.ok() && status.code() != absl::StatusCode::kCancelled) metrics_->kv_transfer_failures.Inc();
  absl::Status unstaged = absl::OkStatus();
  if (status.ok() && staging_ != nullptr) {
    // The blocks arrived in staging: copy them into the reserved cache blocks. Nothing else ends a
    // reservation whose lease the receiver has committed while it is still kTransferring.
    std::vector<int32_t> staged, cache_blocks;
    {
      absl::MutexLock lock(&mu_);
      auto it = by_transfer_.find(transfer_id);
      if (it == by_transfer_.end() || it->second->state != ReservationState::kTransferring) return;
      staged = std::move(it->second->staging_blocks);
      it->second->staging_blocks.clear();
      cache_blocks = it->second->cache_blocks;
    }
    unstaged = staging_->Unstage(staged, cache_blocks);
    staging_->Free(staged);
  }
  absl::MutexLock lock(&mu_);
  auto it = by_transfer_.find(transfer_id);
  if (it == by_transfer_.end()) return;
  Reservation& r = *it->second;
  if (r.state != ReservationState::kTransferring) return;
  if (!unstaged.ok()) {
    metrics_->kv_transfer_failures.Inc();
    EndLocked(r, absl::InternalError(absl::StrCat("copying the KV of request '", r.request_id,
                                                  "' from staging into the cache failed: ", unstaged.message())));
    return;
  }
  if (status.ok()) {
    metrics_->kv_transfer_bytes.Observe(double(r.num_tokens) * double(kv_token_bytes_));
    if (r.first_layer_time != absl::InfinitePast()) {
      metrics_->kv_transfer_seconds.Observe(absl::ToDoubleSeconds(absl::Now() - r.first_layer_time));
    }
    // The receiver committed the lease: the blocks are ours until Decode claims them.
    r.state = ReservationState::kReceived;
    r.claim_deadline = absl::Now() + r.lease;
    cv_.SignalAll();
  } else {
    EndLocked(r, absl::UnavailableError(absl::StrCat("the KV transfer for request '", r.request_id,
                                                     "' failed: ", status.ToString())));
  }
}

void DecodeService::OnBlocksReleased(uint64_t transfer_id, const std::string& why) {
  absl::MutexLock lock(&mu_);
  auto it = by_transfer_.find(transfer_id);
  if (it == by_transfer_.end()) return;
  Reservation& r = *it->second;
  EndLocked(r, absl::UnavailableError(
                   absl::StrCat("the KV transfer for request '", r.request_id, "' did not complete: ", why)));
}

bool DecodeService::CancelReservation(const std::shared_ptr<Reservation>& r, absl::Status why) {
  {
    absl::MutexLock lock(&mu_);
    if (r->state == ReservationState::kClaimed || r->state == ReservationState::kEnded) return false;
    if (r->state == ReservationState::kReceived) {
      EndLocked(*r, std::move(why));
      return true;
    }
  }
  // Transferring: the receiver holds the lease. Cancel ends it (OnBlocksReleased runs on this
  // thread, so mu_ must not be held). If it ended meanwhile, make sure it is gone anyway.
  receiver_->Cancel(r->transfer_id);
  absl::MutexLock lock(&mu_);
  if (r->state == ReservationState::kReceived) EndLocked(*r, why);
  if (r->state == ReservationState::kEnded) r->failure = std::move(why);
  return true;
}

std::shared_ptr<DecodeService::Reservation> DecodeService::FindByRequest(const std::string& request_id) {
  absl::MutexLock lock(&mu_);
  auto it = transfer_by_request_.find(request_id);
  if (it == transfer_by_request_.end()) return nullptr;
  auto r = by_transfer_.find(it->second);
  return r == by_transfer_.end() ? nullptr : r->second;
}

void DecodeService::ReapLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    cv_.WaitWithTimeout(&mu_, options_.poll_period);
    const absl::Time now = absl::Now();
    std::vector<std::shared_ptr<Reservation>> expired;
    for (auto& [id, r] : by_transfer_) {
      if (r->state == ReservationState::kReceived && now > r->claim_deadline) expired.push_back(r);
    }
    for (auto& r : expired) {
      EndLocked(*r, absl::FailedPreconditionError(absl::StrCat(
                        "the KV blocks of request '", r->request_id,
                        "' were not claimed by a Decode call within the lease and were released")));
    }
  }
}

grpc::Status DecodeService::ReserveKv(grpc::ServerContext*, const v1::ReserveKvRequest* request,
                                      v1::ReserveKvResponse* response) {
  const int32_t num_tokens = request->num_prompt_tokens();
  const uint64_t transfer_id = request->transfer_id();
  if (num_tokens <= 0) {
    return Error(grpc::StatusCode::INVALID_ARGUMENT, "num_prompt_tokens must be positive");
  }
  absl::Duration lease = request->lease_ms() > 0 ? absl::Milliseconds(request->lease_ms())
                                                 : options_.default_lease;
  lease = std::min(lease, options_.max_lease);

  absl::StatusOr<std::pair<SequenceId, std::vector<int32_t>>> reserved =
      loop_->Call([num_tokens](LlmEngine& engine) -> absl::StatusOr<std::pair<SequenceId, std::vector<int32_t>>> {
        absl::StatusOr<SequenceId> seq = engine.ReserveKv(num_tokens);
        if (!seq.ok()) return seq.status();
        return std::make_pair(*seq, engine.BlockTable(*seq));
      });
  if (!reserved.ok()) {
    if (reserved.status().code() == absl::StatusCode::kResourceExhausted) {
      return Error(grpc::StatusCode::RESOURCE_EXHAUSTED,
                   absl::StrCat("decode worker has no free KV blocks for ", num_tokens,
                                " prompt tokens: ", reserved.status().message()));
    }
    return rpc::ToGrpc(reserved.status());
  }
  const SequenceId seq = reserved->first;
  const size_t num_blocks = (size_t(num_tokens) + size_t(block_size_) - 1) / size_t(block_size_);
  DUET_CHECK(reserved->second.size() >= num_blocks);
  std::vector<int32_t> landing(reserved->second.begin(), reserved->second.begin() + num_blocks);
  std::vector<int32_t> staging_blocks;
  if (staging_ != nullptr) {
    absl::StatusOr<std::vector<int32_t>> staged = staging_->Allocate(int64_t(num_blocks));
    if (!staged.ok()) {
      loop_->Post([seq](LlmEngine& engine) { engine.ReleaseKv(seq); });
      return Error(grpc::StatusCode::RESOURCE_EXHAUSTED,
                   absl::StrCat("decode worker has no free KV staging blocks for ", num_tokens,
                                " prompt tokens: ", staged.status().message()));
    }
    staging_blocks = *std::move(staged);
    landing = staging_blocks;
  }

  auto r = std::make_shared<Reservation>();
  r->request_id = request->request_id();
  r->transfer_id = transfer_id;
  r->seq = seq;
  r->num_tokens = num_tokens;
  r->lease = lease;
  r->cache_blocks.assign(reserved->second.begin(), reserved->second.begin() + num_blocks);
  r->staging_blocks = staging_blocks;
  {
    absl::MutexLock lock(&mu_);
    if (by_transfer_.count(transfer_id)) {
      loop_->Post([seq](LlmEngine& engine) { engine.ReleaseKv(seq); });
      if (!staging_blocks.empty()) staging_->Free(staging_blocks);
      return Error(grpc::StatusCode::ALREADY_EXISTS,
                   absl::StrCat("transfer id ", transfer_id, " already has a KV reservation"));
    }
    by_transfer_[transfer_id] = r;
    transfer_by_request_[r->request_id] = transfer_id;
  }

  kvtransfer::ExpectedRequest expected;
  expected.request_id = transfer_id;
  expected.num_tokens = uint32_t(num_tokens);
  expected.dst_block_ids.assign(landing.begin(), landing.end());
  expected.lease_ttl = lease;
  if (absl::Status s = receiver_->Expect(std::move(expected)); !s.ok()) {
    absl::MutexLock lock(&mu_);
    EndLocked(*r, s);
    return Error(grpc::StatusCode::INTERNAL,
                 absl::StrCat("cannot expect the KV transfer: ", s.message()));
  }

  v1::KvTarget* target = response->mutable_target();
  target->set_receiver_descriptor(receiver_->descriptor());
  target->set_transfer_id(transfer_id);
  for (int32_t b : landing) target->add_block_ids(uint32_t(b));
  return grpc::Status::OK;
}

grpc::Status DecodeService::Decode(grpc::ServerContext* context, const v1::DecodeRequest* request,
                                   grpc::ServerWriter<v1::GenerateResponse>* writer) {
  const auto arrival = std::chrono::steady_clock::now();
  const std::string& id = request->request_id();
  const uint64_t transfer_id = request->transfer_id();
  absl::StatusOr<SamplingParams> params = rpc::ToSamplingParams(request->sampling());

  std::shared_ptr<Reservation> r;
  {
    absl::MutexLock lock(&mu_);
    auto it = by_transfer_.find(transfer_id);
    if (it != by_transfer_.end()) r = it->second;
  }
  if (r == nullptr) {
    return Error(grpc::StatusCode::FAILED_PRECONDITION,
                 absl::StrCat("no KV reservation for transfer id ", transfer_id, " (request '", id,
                              "'): unknown, or it ended (lease expired, transfer failed or aborted)"));
  }
  std::vector<int32_t> prompt(request->prompt_token_ids().begin(), request->prompt_token_ids().end());
  if (!params.ok() || int32_t(prompt.size()) != r->num_tokens) {
    const absl::Status why =
        !params.ok() ? params.status()
                     : absl::InvalidArgumentError(absl::StrCat(
                           "the prompt has ", prompt.size(), " tokens but the KV reservation was for ",
                           r->num_tokens));
    CancelReservation(r, why);
    return rpc::ToGrpc(why);
  }

  // Wait for the prefill worker's transfer. The receiver ends the lease if the sender stalls,
  // so this is bounded; the extra bound covers a lost notice.
  const absl::Time wait_deadline = absl::Now() + r->lease + absl::Seconds(5);
  bool cancelled = false;
  bool timed_out = false;
  {
    absl::MutexLock lock(&mu_);
    while (r->state == ReservationState::kTransferring) {
      if (context->IsCancelled()) {
        cancelled = true;
        break;
      }
      if (absl::Now() > wait_deadline) {
        timed_out = true;
        break;
      }
      cv_.WaitWithTimeout(&mu_, options_.poll_period);
    }
    if (r->state == ReservationState::kReceived) {
      r->state = ReservationState::kClaimed;
      by_transfer_.erase(transfer_id);
      auto it = transfer_by_request_.find(r->request_id);
      if (it != transfer_by_request_.end() && it->second == transfer_id) transfer_by_request_.erase(it);
    }
  }
  if (cancelled || timed_out) {
    CancelReservation(r, absl::CancelledError("the Decode call ended before the KV transfer completed"));
    if (cancelled) return Error(grpc::StatusCode::CANCELLED, "the Decode call was cancelled");
    return Error(grpc::StatusCode::UNAVAILABLE,
                 absl::StrCat("the KV transfer for request '", id, "' did not complete in time"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (r->state != ReservationState::kClaimed) {
      // Ended: blocks already released. Transfer failures are UNAVAILABLE, the rest say why.
      const absl::Status failure = r->failure.ok() ? absl::UnavailableError("the KV reservation ended")
                                                   : r->failure;
      return rpc::ToGrpc(failure);
    }
  }

  // The blocks are this call's now: join the batch, or give them back.
  auto queue = std::make_shared<BlockingQueue<RequestOutput>>();
  const SampledToken first = rpc::FromProto(request->first_token_id(), request->first_token_logprobs());
  const SequenceId seq = r->seq;
  EngineLoop* loop = loop_.get();
  metrics::Histogram* itl = &metrics_->inter_token_latency_seconds;
  std::chrono::steady_clock::time_point joined_at;
  absl::Status joined = loop_->Call([&, queue](LlmEngine& engine) -> absl::Status {
    absl::StatusOr<RequestOutput> out = engine.AddPrefilledRequest(id, prompt, *params, seq, first);
    if (!out.ok()) {
      engine.ReleaseKv(seq);  // not taken by a request
      return out.status();
    }
    const bool finished = out->finished;
    joined_at = std::chrono::steady_clock::now();
    queue->Push(*std::move(out));
    if (finished) {
      engine.Release(id);
    } else {
      // Inter-token latency as the engine produces tokens (loop thread), one per step.
      loop->Subscribe(id, [queue, itl, last = joined_at](const RequestOutput& o) mutable {
        if (!o.new_token_ids.empty()) {
          const auto now = std::chrono::steady_clock::now();
          itl->Observe(std::chrono::duration<double>(now - last).count());
          last = now;
        }
        queue->Push(o);
      });
    }
    return absl::OkStatus();
  });
  if (!joined.ok()) return rpc::ToGrpc(joined);

  bool first_message = true;
  int32_t num_output_tokens = 0;
  for (;;) {
    std::optional<RequestOutput> out = queue->Pop(std::chrono::milliseconds(
        std::max<int64_t>(1, absl::ToInt64Milliseconds(options_.poll_period))));
    if (!out) {
      if (context->IsCancelled()) {
        loop_->Abort(id);
        return Error(grpc::StatusCode::CANCELLED, "the Decode call was cancelled");
      }
      continue;
    }
    if (out->finish_reason == FinishReason::kError) {
      return Error(grpc::StatusCode::INTERNAL, absl::StrCat("request '", id, "' failed: ", out->error));
    }
    v1::GenerateResponse response;
    ToResponse(*out, *params, &response);
    num_output_tokens += int32_t(out->new_token_ids.size());
    if (first_message) {
      for (int32_t t : prompt) response.add_prompt_token_ids(t);
      first_message = false;
    }
    if (out->finished) {
      response.mutable_usage()->set_prompt_tokens(int32_t(prompt.size()));
      response.mutable_usage()->set_completion_tokens(num_output_tokens);
    }
    if (!writer->Write(response)) {
      if (!out->finished) loop_->Abort(id);
      return Error(grpc::StatusCode::CANCELLED, "the Decode stream's client is gone");
    }
    // Every token this stream delivers, the prefill worker's first token included.
    metrics_->generation_tokens.Inc(double(out->new_token_ids.size()));
    if (out->finished) {
      if (std::optional<metrics::FinishedReason> reason = FinishedReasonOf(out->finish_reason)) {
        metrics_->request_success(*reason).Inc();
      }
      metrics_->request_generation_tokens.Observe(num_output_tokens);
      metrics_->request_decode_time_seconds.Observe(SecondsSince(joined_at));
      metrics_->e2e_request_latency_seconds.Observe(SecondsSince(arrival));
      return grpc::Status::OK;
    }
  }
}

grpc::Status DecodeService::Abort(grpc::ServerContext*, const v1::WorkerAbortRequest* request,
                                  v1::WorkerAbortResponse* response) {
  const std::string& id = request->request_id();
  bool found = false;
  if (std::shared_ptr<Reservation> r = FindByRequest(id)) {
    found = CancelReservation(r, absl::CancelledError(absl::StrCat("request '", id, "' was aborted")));
  }
  const bool running = loop_->Call([&id](LlmEngine& engine) {
    const Request* req = engine.Find(id);
    return req != nullptr && !req->finished();
  });
  if (running) {
    loop_->Abort(id);
    found = true;
  }
  response->set_found(found);
  return grpc::Status::OK;
}

void DecodeService::RefreshMetrics() {
  const EngineStats stats = loop_->Stats();
  absl::MutexLock lock(&metrics_mu_);
  rpc::RecordEngineStats(stats, *metrics_, &preemptions_seen_);
  // Speculative decoding: the engine's cumulative counters, exported as increments.
  const SpecDecodeStats& spec = stats.spec_decode;
  metrics_->spec_decode_num_drafts.Inc(double(spec.num_drafts - spec_seen_.num_drafts));
  metrics_->spec_decode_num_draft_tokens.Inc(double(spec.num_draft_tokens - spec_seen_.num_draft_tokens));
  metrics_->spec_decode_num_accepted_tokens.Inc(double(spec.num_accepted_tokens - spec_seen_.num_accepted_tokens));
  for (size_t pos = 0; pos < spec.accepted_per_pos.size(); ++pos) {
    const int64_t seen = pos < spec_seen_.accepted_per_pos.size() ? spec_seen_.accepted_per_pos[pos] : 0;
    metrics_->spec_decode_num_accepted_tokens_per_pos(int(pos)).Inc(double(spec.accepted_per_pos[pos] - seen));
  }
  spec_seen_ = spec;
}

std::string DecodeService::RenderMetrics() {
  RefreshMetrics();
  return metrics_registry_.Render();
}

grpc::Status DecodeService::GetStats(grpc::ServerContext*, const v1::GetStatsRequest*,
                                     v1::WorkerStats* response) {
  rpc::FillWorkerStats(loop_->Stats(), "decode", block_size_, response);
  absl::MutexLock lock(&mu_);
  response->set_num_kv_leases(int32_t(by_transfer_.size()));
  return grpc::Status::OK;
}

}  // namespace duet

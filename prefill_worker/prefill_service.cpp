#include "prefill_worker/prefill_service.h"

#include <chrono>
#include <filesystem>
#include <future>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/blocking_queue.h"
#include "rpc/rpc_util.h"

namespace duet {
namespace {

grpc::Status Error(grpc::StatusCode code, std::string message) {
  return grpc::Status(code, std::move(message));
}

// A peer failure (as opposed to a bad request): the connection should be made again.
bool IsPeerFailure(const absl::Status& s) {
  return s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kDeadlineExceeded ||
         s.code() == absl::StatusCode::kCancelled;
}

// What the subscription hands the Prefill handler.
struct PrefillResult {
  RequestOutput output;
  absl::Status transfer;  // OK once the prompt's KV is complete at the decode worker
};

std::string ModelName(const PrefillServiceOptions& options, const EngineConfig& config) {
  if (!options.model_name.empty()) return options.model_name;
  std::filesystem::path path(config.model_dir);
  if (!path.has_filename()) path = path.parent_path();
  return path.filename().string();
}

double Seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

absl::StatusOr<std::unique_ptr<PrefillService>> PrefillService::Create(std::unique_ptr<LlmEngine> engine,
                                                                       PrefillServiceOptions options) {
  absl::StatusOr<WorkerKvPools> pools =
      MakeWorkerKvPools(engine->kv_cache(), engine->config().scheduler, options.kv_pools);
  if (!pools.ok()) {
    return absl::Status(pools.status().code(),
                        absl::StrCat("cannot set up the KV staging: ", pools.status().message()));
  }
  const int64_t kv_token_bytes = KvTokenBytes(pools->memory.layout);
  absl::StatusOr<std::unique_ptr<kvtransfer::KvSender>> sender =
      kvtransfer::CreateUcxKvSender(pools->memory, options.sender);
  if (!sender.ok()) {
    return absl::Status(sender.status().code(),
                        absl::StrCat("cannot start the KV sender: ", sender.status().message()));
  }
  std::unique_ptr<PrefillService> service(
      new PrefillService(std::move(engine), std::move(*sender), std::move(pools->staging), options));
  service->kv_token_bytes_ = kv_token_bytes;  // read on the loop thread, after a Prefill call posts
  return service;
}

PrefillService::PrefillService(std::unique_ptr<LlmEngine> engine,
                               std::unique_ptr<kvtransfer::KvSender> sender, std::unique_ptr<KvHostStaging> staging,
                               PrefillServiceOptions options)
    : options_(std::move(options)),
      block_size_(engine->config().block_size),
      num_layers_(engine->model_config().num_layers),
      metrics_(std::make_unique<metrics::DuetMetrics>(metrics_registry_, ModelName(options_, engine->config()),
                                                      metrics::Role::kPrefill,
                                                      engine->config().scheduler.max_model_len)),
      staging_(std::move(staging)),
      sender_(std::move(sender)) {
  loop_ = std::make_unique<EngineLoop>(
      std::move(engine),
      [this](int64_t layer, absl::Span<const SequenceChunk> chunks) { OnLayerDone(layer, chunks); });
}

PrefillService::~PrefillService() {
  // Stop shipping (no step runs while this closure does), then drop the sender while the
  // engine's pools still exist, then the engine.
  loop_->Call([this](LlmEngine&) {
    stopping_ = true;
    transfers_.clear();
  });
  sender_.reset();
  loop_.reset();
  staging_.reset();
}

void PrefillService::FreeStaging(Transfer& t) {
  if (staging_ != nullptr && !t.staging_block_ids.empty()) staging_->Free(t.staging_block_ids);
  t.staging_block_ids.clear();
}

void PrefillService::FailTransfer(Transfer& t, absl::Status why) {
  t.done = true;
  t.status = std::move(why);
  metrics_->kv_transfer_failures.Inc();
  if (!t.sending || t.staging_block_ids.empty()) {
    (void)sender_->Abort(t.peer, t.transfer_id);
    return;
  }
  // Layers already sent may still be reading the staging blocks: Finish resolves after them.
  sender_->Finish(t.peer, t.transfer_id).wait();
  (void)sender_->Abort(t.peer, t.transfer_id);
  FreeStaging(t);
}

void PrefillService::OnLayerDone(int64_t layer, absl::Span<const SequenceChunk> chunks) {
  if (stopping_ || transfers_.empty()) return;
  const bool last_layer = layer == num_layers_ - 1;
  std::vector<std::pair<Transfer*, std::future<absl::Status>>> finishing;
  for (const SequenceChunk& chunk : chunks) {
    // Only the chunk that completes the prompt ships (chunked prefill: all blocks at once).
    if (chunk.num_logits <= 0) continue;
    auto it = transfers_.find(chunk.sequence_id);
    if (it == transfers_.end()) continue;
    Transfer& t = *it->second;
    if (t.done) continue;
    if (!t.sending) {
      if (layer != 0) continue;
      t.sending = true;
      t.num_tokens = uint32_t(chunk.start_position + int64_t(chunk.tokens.size()));
      const size_t num_blocks = (t.num_tokens + uint32_t(block_size_) - 1) / uint32_t(block_size_);
      if (chunk.block_table.size() < num_blocks) {
        FailTransfer(t, absl::InternalError("the prefill sequence's block table does not cover its prompt"));
        continue;
      }
      t.send_start = std::chrono::steady_clock::now();
      if (staging_ == nullptr) {
        t.src_block_ids.assign(chunk.block_table.begin(), chunk.block_table.begin() + num_blocks);
      } else {
        absl::StatusOr<std::vector<int32_t>> staged = staging_->Allocate(int64_t(num_blocks));
        if (!staged.ok()) {
          FailTransfer(t, absl::UnavailableError(absl::StrCat("no room to stage the prompt's KV: ",
                                                              staged.status().message())));
          continue;
        }
        t.staging_block_ids = *std::move(staged);
        t.cache_block_ids.assign(chunk.block_table.begin(), chunk.block_table.begin() + num_blocks);
        t.src_block_ids.assign(t.staging_block_ids.begin(), t.staging_block_ids.end());
      }
    }
    if (staging_ != nullptr) {
      // The layer's K/V are complete in the cache (the executor's stream reached this layer).
      if (absl::Status s = staging_->StageLayer(layer, t.cache_block_ids, t.staging_block_ids); !s.ok()) {
        FailTransfer(t, s);
        continue;
      }
    }
    kvtransfer::LayerSend send;
    send.request_id = t.transfer_id;
    send.layer = uint32_t(layer);
    send.num_tokens = t.num_tokens;
    send.src_block_ids = t.src_block_ids;
    send.dst_block_ids = t.dst_block_ids;
    // Its outcome is reported by Finish, which resolves after every SendLayer of the request.
    (void)sender_->SendLayer(t.peer, std::move(send));
    if (last_layer) finishing.emplace_back(&t, sender_->Finish(t.peer, t.transfer_id));
  }
  // The engine frees these sequences' blocks right after the step: wait for the puts to land.
  for (auto& [t, done] : finishing) {
    t->status = done.get();
    t->done = true;
    FreeStaging(*t);
    if (t->status.ok()) {
      metrics_->kv_transfer_bytes.Observe(double(t->num_tokens) * double(kv_token_bytes_));
      metrics_->kv_transfer_seconds.Observe(Seconds(std::chrono::steady_clock::now() - t->send_start));
    } else {
      metrics_->kv_transfer_failures.Inc();
    }
  }
}

absl::StatusOr<kvtransfer::PeerId> PrefillService::PeerFor(const std::string& descriptor) {
  {
    absl::MutexLock lock(&peers_mu_);
    auto it = peers_.find(descriptor);
    if (it != peers_.end()) return it->second;
  }
  absl::StatusOr<kvtransfer::PeerId> peer = sender_->Connect(descriptor);
  if (!peer.ok()) return peer.status();
  absl::MutexLock lock(&peers_mu_);
  auto [it, inserted] = peers_.emplace(descriptor, *peer);
  if (!inserted) sender_->Disconnect(*peer);  // another call connected first
  return it->second;
}

void PrefillService::ForgetPeer(const std::string& descriptor, kvtransfer::PeerId peer) {
  {
    absl::MutexLock lock(&peers_mu_);
    auto it = peers_.find(descriptor);
    if (it == peers_.end() || it->second != peer) return;  // already replaced
    peers_.erase(it);
  }
  sender_->Disconnect(peer);
}

grpc::Status PrefillService::Prefill(grpc::ServerContext* context, const v1::PrefillRequest* request,
                                     v1::PrefillResponse* response) {
  const auto start = std::chrono::steady_clock::now();
  const std::string& id = request->request_id();
  absl::StatusOr<SamplingParams> params = rpc::ToSamplingParams(request->sampling());
  if (!params.ok()) return rpc::ToGrpc(params.status());
  const v1::KvTarget& target = request->target();
  if (target.receiver_descriptor().empty() || target.block_ids().empty()) {
    return Error(grpc::StatusCode::INVALID_ARGUMENT,
                 "the KV target (receiver_descriptor and block_ids from the decode worker's ReserveKv) is required");
  }

  absl::StatusOr<kvtransfer::PeerId> peer = PeerFor(target.receiver_descriptor());
  if (!peer.ok()) {
    metrics_->kv_transfer_failures.Inc();
    const grpc::StatusCode code = peer.status().code() == absl::StatusCode::kInvalidArgument
                                      ? grpc::StatusCode::INVALID_ARGUMENT
                                      : grpc::StatusCode::UNAVAILABLE;
    return Error(code, absl::StrCat("cannot connect to the decode worker's KV receiver: ",
                                    peer.status().message()));
  }

  auto transfer = std::make_shared<Transfer>();
  transfer->transfer_id = target.transfer_id();
  transfer->peer = *peer;
  transfer->dst_block_ids.assign(target.block_ids().begin(), target.block_ids().end());

  // The first token is sampled here; the decode worker continues the same seeded stream.
  SamplingParams first = *params;
  first.max_tokens = 1;
  std::vector<int32_t> prompt(request->prompt_token_ids().begin(), request->prompt_token_ids().end());
  auto results = std::make_shared<BlockingQueue<PrefillResult>>();
  EngineLoop* loop = loop_.get();
  absl::Status added = loop_->Call([&](LlmEngine& engine) -> absl::Status {
    if (absl::Status s = engine.AddRequest(id, std::move(prompt), first); !s.ok()) return s;
    const SequenceId seq = engine.Find(id)->seq_id;
    transfers_[seq] = transfer;
    LlmEngine* engine_ptr = &engine;
    loop->Subscribe(id, [this, seq, transfer, results, engine_ptr](const RequestOutput& out) {
      if (!out.finished) return;  // max_tokens 1: the sampled token comes with the finish
      // The request is still readable here (the loop releases it after this callback).
      const Request* req = engine_ptr->Find(out.id);
      if (req != nullptr && !out.new_token_ids.empty() &&
          (out.finish_reason == FinishReason::kStop || out.finish_reason == FinishReason::kLength)) {
        metrics_->prompt_tokens.Inc(double(req->prompt.size()));
        metrics_->request_prompt_tokens.Observe(double(req->prompt.size()));
        metrics_->request_queue_time_seconds.Observe(Seconds(req->first_scheduled_time - req->arrival_time));
        metrics_->request_prefill_time_seconds.Observe(Seconds(req->first_token_time - req->first_scheduled_time));
      }
      transfers_.erase(seq);
      absl::Status shipped = transfer->done ? transfer->status
                                            : absl::AbortedError("the prompt's KV was not shipped");
      // Never shipped (aborted or failed before its step): let the decode worker release the lease.
      if (!transfer->done && !stopping_) (void)sender_->Abort(transfer->peer, transfer->transfer_id);
      results->Push(PrefillResult{out, std::move(shipped)});
    });
    return absl::OkStatus();
  });
  if (!added.ok()) {
    // Nothing will be shipped: let the decode worker release the reserved blocks now.
    (void)sender_->Abort(transfer->peer, transfer->transfer_id);
    return rpc::ToGrpc(added);
  }

  for (;;) {
    std::optional<PrefillResult> result = results->Pop(std::chrono::milliseconds(
        std::max<int64_t>(1, absl::ToInt64Milliseconds(options_.poll_period))));
    if (!result) {
      if (context->IsCancelled()) {
        loop_->Abort(id);  // the subscription then aborts the transfer if it had not finished
        return Error(grpc::StatusCode::CANCELLED, "the Prefill call was cancelled");
      }
      continue;
    }
    const RequestOutput& out = result->output;
    if (out.finish_reason == FinishReason::kAbort) {
      return Error(grpc::StatusCode::ABORTED, absl::StrCat("request '", id, "' was aborted"));
    }
    if (out.finish_reason == FinishReason::kError) {
      return Error(grpc::StatusCode::INTERNAL, absl::StrCat("prefill of request '", id, "' failed: ", out.error));
    }
    if (!result->transfer.ok()) {
      if (IsPeerFailure(result->transfer)) ForgetPeer(target.receiver_descriptor(), transfer->peer);
      const grpc::StatusCode code = result->transfer.code() == absl::StatusCode::kInvalidArgument
                                        ? grpc::StatusCode::INVALID_ARGUMENT
                                        : grpc::StatusCode::UNAVAILABLE;
      return Error(code, absl::StrCat("the KV transfer of request '", id, "' to the decode worker failed: ",
                                      result->transfer.ToString()));
    }
    if (out.new_token_ids.empty()) {
      return Error(grpc::StatusCode::INTERNAL, absl::StrCat("prefill of request '", id, "' produced no token"));
    }
    response->set_first_token_id(out.new_token_ids[0]);
    if (!out.new_logprobs.empty()) {
      SampledToken token{out.new_token_ids[0], out.new_logprobs[0],
                         out.new_top_logprobs.empty() ? std::vector<TokenLogprob>{} : out.new_top_logprobs[0]};
      rpc::ToProto(token, response->mutable_first_token_logprobs());
    }
    response->set_prefill_seconds(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    return grpc::Status::OK;
  }
}

grpc::Status PrefillService::Abort(grpc::ServerContext*, const v1::WorkerAbortRequest* request,
                                   v1::WorkerAbortResponse* response) {
  const std::string& id = request->request_id();
  const bool running = loop_->Call([&id](LlmEngine& engine) {
    const Request* req = engine.Find(id);
    return req != nullptr && !req->finished();
  });
  if (running) loop_->Abort(id);
  response->set_found(running);
  return grpc::Status::OK;
}

void PrefillService::RefreshMetrics() {
  const EngineStats stats = loop_->Stats();
  absl::MutexLock lock(&metrics_mu_);
  rpc::RecordEngineStats(stats, *metrics_, &preemptions_seen_);
}

std::string PrefillService::RenderMetrics() {
  RefreshMetrics();
  return metrics_registry_.Render();
}

grpc::Status PrefillService::GetStats(grpc::ServerContext*, const v1::GetStatsRequest*,
                                      v1::WorkerStats* response) {
  rpc::FillWorkerStats(loop_->Stats(), "prefill", block_size_, response);
  response->set_num_kv_leases(0);
  return grpc::Status::OK;
}

}  // namespace duet

#include "router/fake_workers.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "router/worker_registry.h"
#include "rpc/rpc_util.h"

namespace duet::router::testing {

namespace {

// Sleeps up to `ms`, returning false early if the call was cancelled.
bool SleepUnlessCancelled(grpc::ServerContext* context, int ms) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < end) {
    if (context->IsCancelled()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return !context->IsCancelled();
}

}  // namespace

grpc::Status FakePrefillWorker::Prefill(grpc::ServerContext* context, const v1::PrefillRequest* request,
                                        v1::PrefillResponse* response) {
  ++num_prefills;
  {
    absl::MutexLock lock(&mu_);
    last_prompt_.assign(request->prompt_token_ids().begin(), request->prompt_token_ids().end());
    last_output_tokens_.assign(request->output_token_ids().begin(), request->output_token_ids().end());
  }
  if (gone || fail_unavailable || (fail_resumed && request->output_token_ids_size() > 0)) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake prefill is unavailable");
  }
  if (request->target_follows()) {
    ++num_late_prefills;
    if (!late_kv_target) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "fake prefill takes no late target");
    const std::string& id = request->request_id();
    for (;;) {
      absl::MutexLock lock(&mu_);
      auto arrived = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return late_targets_.count(id) != 0 || std::count(aborted_.begin(), aborted_.end(), id) != 0;
      };
      if (mu_.AwaitWithTimeout(absl::Condition(&arrived), absl::Milliseconds(5))) {
        if (late_targets_.erase(id) == 0) {
          return gone ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake prefill is gone")
                      : grpc::Status(grpc::StatusCode::ABORTED, "aborted");
        }
        break;
      }
      if (context->IsCancelled()) {
        ++num_cancelled;
        return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
      }
    }
  }
  if (!SleepUnlessCancelled(context, prefill_delay_ms)) {
    ++num_cancelled;
    return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
  }
  response->set_first_token_id(first_token + request->output_token_ids_size());
  response->set_first_token_finish_reason(first_token_continues ? v1::FINISH_REASON_LENGTH : v1::FINISH_REASON_STOP);
  if (request->sampling().has_prompt_logprobs() && request->output_token_ids_size() == 0) {
    for (int i = 0; i + 1 + missing_prompt_logprobs < request->prompt_token_ids_size(); ++i) {
      v1::TokenLogprobs* lp = response->add_prompt_logprobs();
      lp->set_logprob(-float(i + 1));
      lp->set_rank(i + 2);
      for (int k = 0; k < request->sampling().prompt_logprobs(); ++k) {
        v1::TopLogprob* top = lp->add_top();
        top->set_token_id(k);
        top->set_logprob(-0.1f * float(k + 1));
      }
    }
  }
  return grpc::Status::OK;
}

grpc::Status FakePrefillWorker::SetKvTarget(grpc::ServerContext*, const v1::SetKvTargetRequest* request,
                                            v1::SetKvTargetResponse*) {
  if (gone || fail_set_kv_target) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake SetKvTarget failure");
  absl::MutexLock lock(&mu_);
  late_targets_[request->request_id()] = request->target();
  targets_set_.push_back(request->target().transfer_id());
  return grpc::Status::OK;
}

grpc::Status FakePrefillWorker::Abort(grpc::ServerContext*, const v1::WorkerAbortRequest* request,
                                      v1::WorkerAbortResponse* response) {
  if (request->has_kv_target()) ++num_aborts_with_kv_target;
  absl::MutexLock lock(&mu_);
  aborted_.push_back(request->request_id());
  return gone ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake prefill is gone") : grpc::Status::OK;
}

grpc::Status FakePrefillWorker::GetStats(grpc::ServerContext*, const v1::GetStatsRequest*,
                                         v1::WorkerStats* response) {
  if (gone) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake prefill is gone");
  std::this_thread::sleep_for(std::chrono::milliseconds(stats_delay_ms.load()));
  response->set_role("prefill");
  response->set_instance_id(absl::StrCat("fake prefill ", instance.load()));
  response->set_late_kv_target(late_kv_target);
  response->set_num_kv_blocks(100);
  response->set_num_free_kv_blocks(100);
  response->set_block_size(16);
  return grpc::Status::OK;
}

std::vector<int32_t> FakePrefillWorker::last_prompt() const {
  absl::MutexLock lock(&mu_);
  return last_prompt_;
}

std::vector<int32_t> FakePrefillWorker::last_output_tokens() const {
  absl::MutexLock lock(&mu_);
  return last_output_tokens_;
}

std::vector<uint64_t> FakePrefillWorker::targets_set() const {
  absl::MutexLock lock(&mu_);
  return targets_set_;
}

std::vector<std::string> FakePrefillWorker::aborted() const {
  absl::MutexLock lock(&mu_);
  return aborted_;
}

grpc::Status FakeDecodeWorker::ReserveKv(grpc::ServerContext*, const v1::ReserveKvRequest* request,
                                         v1::ReserveKvResponse* response) {
  if (kv_full) return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "fake decode has no free KV blocks");
  if (reserve_delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(reserve_delay_ms.load()));
  ++num_reserved;
  last_reserved_tokens = request->num_prompt_tokens();
  {
    absl::MutexLock lock(&mu_);
    last_transfer_id_ = request->transfer_id();
  }
  response->mutable_target()->set_transfer_id(request->transfer_id());
  response->mutable_target()->add_block_ids(7);
  return grpc::Status::OK;
}

void FakeDecodeWorker::HoldFirstMessage() {
  absl::MutexLock lock(&mu_);
  hold_first_message_ = true;
}

void FakeDecodeWorker::ReleaseFirstMessage() {
  absl::MutexLock lock(&mu_);
  hold_first_message_ = false;
}

grpc::Status FakeDecodeWorker::Decode(grpc::ServerContext* context, const v1::DecodeRequest* request,
                                      grpc::ServerWriter<v1::GenerateResponse>* writer) {
  ++num_decodes;
  in_decode = true;
  std::vector<std::string> script;
  std::string finish_reason = "length";
  {
    absl::MutexLock lock(&mu_);
    script = script_;
    if (!script.empty()) finish_reason = script_finish_reason_;
    decoded_sampling_.push_back(request->sampling());
    last_decode_ = *request;
  }
  int first_token = request->first_token_id();
  if (request->prefill_here()) {
    if (!prefill_here) {
      in_decode = false;
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "no KV reservation for transfer id 0");
    }
    ++num_prefilled_here;
    first_token = local_first_token;
  }
  const int resumed = request->output_token_ids_size();
  int max_tokens = request->sampling().max_tokens() - resumed;
  if (!script.empty() && static_cast<int>(script.size()) <= max_tokens) {
    max_tokens = static_cast<int>(script.size());
  } else if (!script.empty()) {
    finish_reason = "length";
  }
  for (int i = 0; i < max_tokens; ++i) {
    if (!SleepUnlessCancelled(context, token_delay_ms)) {
      ++num_cancelled;
      in_decode = false;
      return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    }
    if (i == 0) {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](bool* held) { return !*held; }, &hold_first_message_));
    }
    if (fail_after_tokens >= 0 && i >= fail_after_tokens) {
      in_decode = false;
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake decode crashed");
    }
    v1::GenerateResponse message;
    message.set_request_id("worker-side-id");
    message.add_token_ids(first_token + i);
    message.set_text(script.empty() ? "t" + std::to_string(resumed + i) + " " : script[static_cast<size_t>(i)]);
    if (request->sampling().has_logprobs()) {  // -0.5 each, top ids 0..N-1
      v1::TokenLogprobs* lp = message.add_logprobs();
      lp->set_logprob(-0.5f);
      for (int k = 0; k < request->sampling().logprobs(); ++k) {
        v1::TopLogprob* top = lp->add_top();
        top->set_token_id(k);
        top->set_logprob(-0.5f);
      }
    }
    if (i + 1 == max_tokens) {
      message.set_finished(true);
      message.set_finish_reason(finish_reason);
      message.mutable_usage()->set_prompt_tokens(request->prompt_token_ids_size());
      message.mutable_usage()->set_completion_tokens(resumed + max_tokens);
    }
    if (!writer->Write(message)) {  // the cancellation landed during the write
      ++num_cancelled;
      break;
    }
    ++num_tokens_sent;
  }
  in_decode = false;
  return grpc::Status::OK;
}

v1::DecodeRequest FakeDecodeWorker::last_decode() const {
  absl::MutexLock lock(&mu_);
  return last_decode_;
}

std::vector<v1::SamplingOptions> FakeDecodeWorker::decoded_sampling() const {
  absl::MutexLock lock(&mu_);
  return decoded_sampling_;
}

void FakeDecodeWorker::SetScript(std::vector<std::string> texts, std::string finish_reason) {
  absl::MutexLock lock(&mu_);
  script_ = std::move(texts);
  script_finish_reason_ = std::move(finish_reason);
}

grpc::Status FakeDecodeWorker::Abort(grpc::ServerContext* context, const v1::WorkerAbortRequest* request,
                                     v1::WorkerAbortResponse* response) {
  while (stalled) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (context->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "the Abort call was cancelled");
  absl::MutexLock lock(&mu_);
  aborted_.push_back(request->request_id());
  aborted_release_now_.push_back(request->release_now());
  aborted_transfer_ids_.push_back(request->transfer_id());
  return grpc::Status::OK;
}

grpc::Status FakeDecodeWorker::GetStats(grpc::ServerContext*, const v1::GetStatsRequest*,
                                        v1::WorkerStats* response) {
  response->set_role("decode");
  response->set_instance_id(absl::StrCat("fake decode ", instance.load()));
  response->set_num_kv_blocks(100);
  response->set_num_free_kv_blocks(free_blocks);
  response->set_block_size(16);
  response->set_prefill_here(prefill_here);
  return grpc::Status::OK;
}

std::vector<std::string> FakeDecodeWorker::aborted() const {
  absl::MutexLock lock(&mu_);
  return aborted_;
}

std::vector<bool> FakeDecodeWorker::aborted_release_now() const {
  absl::MutexLock lock(&mu_);
  return aborted_release_now_;
}

std::vector<uint64_t> FakeDecodeWorker::aborted_transfer_ids() const {
  absl::MutexLock lock(&mu_);
  return aborted_transfer_ids_;
}

uint64_t FakeDecodeWorker::last_transfer_id() const {
  absl::MutexLock lock(&mu_);
  return last_transfer_id_;
}

// Writes the scripted messages one at a time, then waits for the cancellation.
class MalformedDecodeWorker::Stream final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  Stream(MalformedDecodeWorker* worker, const v1::DecodeRequest& request) : worker_(worker) {
    for (int i = 0; i < worker->good_messages; ++i) {
      v1::GenerateResponse message;
      message.add_token_ids(request.first_token_id() + i);
      message.set_text("t" + std::to_string(i) + " ");
      messages_.push_back(Serialize(message));
    }
    v1::GenerateResponse bad;
    switch (worker->fault.load()) {
      case Fault::kUnparsable: {
        // Field 3 (text) announces 100 bytes and carries 3.
        const char truncated[] = {0x1a, 100, 'a', 'b', 'c'};
        grpc::Slice slice(truncated, sizeof(truncated));
        messages_.emplace_back(&slice, 1);
        break;
      }
      case Fault::kTokenOutOfVocabulary:
        bad.add_token_ids(1 << 30);
        messages_.push_back(Serialize(bad));
        break;
      case Fault::kUnknownFinishReason:
        bad.add_token_ids(request.first_token_id());
        bad.set_finished(true);
        bad.set_finish_reason("exploded");
        messages_.push_back(Serialize(bad));
        break;
    }
    NextWrite();
  }

  void OnWriteDone(bool ok) override {
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      ++next_;
      finish = !ok || cancelled_;
    }
    finish ? Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled")) : NextWrite();
  }
  void OnCancel() override {
    ++worker_->num_cancelled;
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      finish = !writing_;  // else OnWriteDone finishes
    }
    if (finish) Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
  }
  void OnDone() override { delete this; }

 private:
  static grpc::ByteBuffer Serialize(const v1::GenerateResponse& message) {
    grpc::ByteBuffer bytes;
    bool own = false;
    DUET_CHECK(grpc::SerializationTraits<v1::GenerateResponse>::Serialize(message, &bytes, &own).ok());
    return bytes;
  }
  // Writes the next message; after the last one, stays silent. (gRPC calls outside the lock: a
  // reaction may run inline.)
  void NextWrite() {
    const grpc::ByteBuffer* next = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (next_ >= messages_.size() || cancelled_) return;
      writing_ = true;
      next = &messages_[next_];
    }
    StartWrite(next);
  }

  MalformedDecodeWorker* const worker_;
  absl::Mutex mu_;
  std::vector<grpc::ByteBuffer> messages_;
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

grpc::Status MalformedDecodeWorker::ReserveKv(grpc::ServerContext*, const v1::ReserveKvRequest* request,
                                              v1::ReserveKvResponse* response) {
  response->mutable_target()->set_transfer_id(request->transfer_id());
  response->mutable_target()->add_block_ids(7);
  return grpc::Status::OK;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* MalformedDecodeWorker::Decode(grpc::CallbackServerContext* context,
                                                                          const grpc::ByteBuffer* request) {
  ++num_decodes;
  grpc::ByteBuffer copy = *request;
  v1::DecodeRequest decode;
  DUET_CHECK(grpc::SerializationTraits<v1::DecodeRequest>::Deserialize(&copy, &decode).ok());
  return new Stream(this, decode);
}

grpc::Status MalformedDecodeWorker::Abort(grpc::ServerContext*, const v1::WorkerAbortRequest* request,
                                          v1::WorkerAbortResponse*) {
  absl::MutexLock lock(&mu_);
  aborted_.push_back(request->request_id());
  return grpc::Status::OK;
}

grpc::Status MalformedDecodeWorker::GetStats(grpc::ServerContext*, const v1::GetStatsRequest*,
                                             v1::WorkerStats* response) {
  response->set_role("decode");
  response->set_num_kv_blocks(100);
  response->set_num_free_kv_blocks(100);
  response->set_block_size(16);
  return grpc::Status::OK;
}

std::vector<std::string> MalformedDecodeWorker::aborted() const {
  absl::MutexLock lock(&mu_);
  return aborted_;
}

FakeServer::FakeServer(grpc::Service* service, int port) : service_(service) {

  grpc::ServerBuilder builder;
  for (const auto& [name, value] : rpc::KeepaliveServerArgs()) builder.AddChannelArgument(name, value);
  int bound = 0;
  builder.AddListeningPort("127.0.0.1:" + std::to_string(port), grpc::InsecureServerCredentials(), &bound);
  builder.RegisterService(service_);
  server_ = builder.BuildAndStart();
  DUET_CHECK(server_ != nullptr && bound != 0);
  port_ = bound;
}

FakeServer::~FakeServer() { Stop(); }

void FakeServer::Stop(int grace_ms) {
  if (server_ == nullptr) return;
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(grace_ms));
  server_->Wait();
  server_.reset();
}

}  // namespace duet::router::testing

#include "router/fake_workers.h"

#include <chrono>
#include <thread>

#include "common/check.h"
#include "proto/rpc_util.h"
#include "router/worker_registry.h"

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
  }
  if (fail_unavailable) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake prefill is unavailable");
  if (!SleepUnlessCancelled(context, prefill_delay_ms)) {
    ++num_cancelled;
    return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
  }
  response->set_first_token_id(first_token);
  return grpc::Status::OK;
}

grpc::Status FakePrefillWorker::Abort(grpc::ServerContext*, const v1::WorkerAbortRequest* request,
                                      v1::WorkerAbortResponse* response) {
  absl::MutexLock lock(&mu_);
  aborted_.push_back(request->request_id());
  return grpc::Status::OK;
}

grpc::Status FakePrefillWorker::GetStats(grpc::ServerContext*, const v1::GetStatsRequest*,
                                         v1::WorkerStats* response) {
  response->set_role("prefill");
  return grpc::Status::OK;
}

std::vector<int32_t> FakePrefillWorker::last_prompt() const {
  absl::MutexLock lock(&mu_);
  return last_prompt_;
}

std::vector<std::string> FakePrefillWorker::aborted() const {
  absl::MutexLock lock(&mu_);
  return aborted_;
}

grpc::Status FakeDecodeWorker::ReserveKv(grpc::ServerContext*, const v1::ReserveKvRequest* request,
                                         v1::ReserveKvResponse* response) {
  if (kv_full) return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "fake decode has no free KV blocks");
  ++num_reserved;
  {
    absl::MutexLock lock(&mu_);
    last_transfer_id_ = request->transfer_id();
  }
  response->mutable_target()->set_transfer_id(request->transfer_id());
  response->mutable_target()->add_block_ids(7);
  return grpc::Status::OK;
}

grpc::Status FakeDecodeWorker::Decode(grpc::ServerContext* context, const v1::DecodeRequest* request,
                                      grpc::ServerWriter<v1::GenerateResponse>* writer) {
  ++num_decodes;
  in_decode = true;
  const int max_tokens = request->sampling().max_tokens();
  for (int i = 0; i < max_tokens; ++i) {
    if (!SleepUnlessCancelled(context, token_delay_ms)) {
      ++num_cancelled;
      in_decode = false;
      return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    }
    if (fail_after_tokens >= 0 && i >= fail_after_tokens) {
      in_decode = false;
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake decode crashed");
    }
    v1::GenerateResponse message;
    message.set_request_id("worker-side-id");
    message.add_token_ids(request->first_token_id() + i);
    message.set_text("t" + std::to_string(i) + " ");
    if (i + 1 == max_tokens) {
      message.set_finished(true);
      message.set_finish_reason("length");
      message.mutable_usage()->set_prompt_tokens(request->prompt_token_ids_size());
      message.mutable_usage()->set_completion_tokens(max_tokens);
    }
    if (!writer->Write(message)) break;
    ++num_tokens_sent;
  }
  in_decode = false;
  return grpc::Status::OK;
}

grpc::Status FakeDecodeWorker::Abort(grpc::ServerContext*, const v1::WorkerAbortRequest* request,
                                     v1::WorkerAbortResponse* response) {
  absl::MutexLock lock(&mu_);
  aborted_.push_back(request->request_id());
  return grpc::Status::OK;
}

grpc::Status FakeDecodeWorker::GetStats(grpc::ServerContext*, const v1::GetStatsRequest*,
                                        v1::WorkerStats* response) {
  response->set_role("decode");
  response->set_num_kv_blocks(100);
  response->set_num_free_kv_blocks(free_blocks);
  response->set_block_size(16);
  return grpc::Status::OK;
}

std::vector<std::string> FakeDecodeWorker::aborted() const {
  absl::MutexLock lock(&mu_);
  return aborted_;
}

uint64_t FakeDecodeWorker::last_transfer_id() const {
  absl::MutexLock lock(&mu_);
  return last_transfer_id_;
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

// n > 1 on the gRPC API. A Generate for n completions becomes n Generates of one (completion i
// with seed + i when a seed is set), sent to the router's own duet.v1.Duet service over its
// in-process channel, as the HTTP API sends an OpenAI request's choices; their streams are merged
// into the client's, each message with its completion's `index` and the client's request id. A
// request for one completion goes to the inner service untouched.
//
// The first completion that fails ends the request with its error (the others are cancelled).
// Abort(request_id) of an n request aborts its completions: each ends with finish reason "abort".
// The client's deadline and cancellation reach every completion.
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "duet/v1/duet.grpc.pb.h"
#include "grpcpp/channel.h"

namespace duet::router {

class ChoicesDuetService final : public v1::Duet::CallbackService {
 public:
  // `inner` serves requests for one completion (and the n requests this one sends).
  explicit ChoicesDuetService(v1::Duet::CallbackService* inner) : inner_(inner) {}
  // Waits until every call has ended and let go of the channel (stop the server first). The
  // calls' client contexts hold the channel too: the last of them must not be the one to release
  // it on a gRPC thread (gRPC 1.51 then aborts), so the service keeps it till here.
  ~ChoicesDuetService() override;

  // The channel to the server this service is on (its in-process channel), through everything
  // in front of this service (the drain, the API key check). Until it is set, n > 1 is UNAVAILABLE.
  // The service holds it until destroyed: destroy the service (after the server has stopped)
  // before the server.
  void SetChannel(std::shared_ptr<grpc::Channel> channel);

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(grpc::CallbackServerContext* context,
                                                           const v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context, const v1::AbortRequest* request,
                                  v1::AbortResponse* response) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request, v1::ModelInfo* response) override {
    return inner_->GetModelInfo(context, request, response);
  }

 private:
  class ChoicesCall;

  v1::Duet::CallbackService* const inner_;
  absl::Mutex mu_;
  std::unique_ptr<v1::Duet::Stub> stub_ ABSL_GUARDED_BY(mu_);
  // The n requests in flight by (client, client's request id), as RouterService's own.
  absl::flat_hash_map<std::pair<std::string, std::string>, std::shared_ptr<ChoicesCall>> active_ ABSL_GUARDED_BY(mu_);
  int live_calls_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace duet::router

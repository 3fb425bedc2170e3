// The --api-key check on the gRPC API: wraps the duet.v1.Duet service and answers
// UNAUTHENTICATED unless the call carries "authorization: Bearer <key>" metadata. Health
// checking and reflection stay open.
#pragma once

#include <string>
#include <utility>

#include "duet/v1/duet.grpc.pb.h"
#include "router/rejected_stream.h"

namespace duet::router {

class ApiKeyDuetService final : public v1::Duet::CallbackService {
 public:
  ApiKeyDuetService(v1::Duet::CallbackService* inner, std::string api_key)
      : inner_(inner), expected_("Bearer " + std::move(api_key)) {}

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(grpc::CallbackServerContext* context,
                                                           const v1::GenerateRequest* request) override {
    if (!Authorized(*context)) return new RejectedStream(Unauthenticated());
    return inner_->Generate(context, request);
  }
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context, const v1::AbortRequest* request,
                                  v1::AbortResponse* response) override {
    if (!Authorized(*context)) return Reject(context);
    return inner_->Abort(context, request, response);
  }
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request, v1::ModelInfo* response) override {
    if (!Authorized(*context)) return Reject(context);
    return inner_->GetModelInfo(context, request, response);
  }

  bool Authorized(const grpc::CallbackServerContext& context) const {
    auto range = context.client_metadata().equal_range("authorization");
    for (auto it = range.first; it != range.second; ++it) {
      if (std::string_view(it->second.data(), it->second.size()) == expected_) return true;
    }
    return false;
  }

 private:
  static grpc::Status Unauthenticated() {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing or wrong API key: send metadata \"authorization: Bearer <key>\"");
  }
  static grpc::ServerUnaryReactor* Reject(grpc::CallbackServerContext* context) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(Unauthenticated());
    return reactor;
  }

  v1::Duet::CallbackService* const inner_;
  const std::string expected_;
};

}  // namespace duet::router

// The --api-key check on the router's public gRPC port, as a call gate (rpc/call_gate.h): a call
// without metadata "authorization: Bearer <key>" is UNAUTHENTICATED before any handler runs. It
// covers every service on the port: duet.v1.Duet, server reflection (v1 and v1alpha), and
// grpc.health.v1 when keyed_health (--api-key-on-health-and-metrics; else health stays open, like
// HTTP /health, for load balancers and Kubernetes probes). The HTTP API checks the key itself and
// calls the service in process, past the port.
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include "rpc/call_gate.h"
#include "rpc/internal_auth.h"

namespace duet::router {

class ApiKeyGate final : public rpc::CallGate {
 public:
  ApiKeyGate(std::string api_key, bool keyed_health)
      : expected_("Bearer " + std::move(api_key)), keyed_health_(keyed_health) {}

  std::string_view credential_key() const override { return "authorization"; }
  // The service scopes request ids by it (router/request_id.h).
  bool passes_credential_on() const override { return true; }
  grpc::Status Admit(std::string_view method, const std::string_view* credential) const override {
    constexpr std::string_view kHealth = "/grpc.health.v1.Health/";
    if (!keyed_health_ && method.substr(0, kHealth.size()) == kHealth) return grpc::Status::OK;
    if (credential != nullptr && rpc::ConstantTimeEquals(*credential, expected_)) return grpc::Status::OK;
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing or wrong API key: send metadata \"authorization: Bearer <key>\"");
  }

 private:
  const std::string expected_;
  const bool keyed_health_;
};

}  // namespace duet::router

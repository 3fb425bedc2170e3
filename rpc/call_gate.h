// A check on every call a gRPC port receives, before any handler runs: the worker's internal-token
// gate (rpc/internal_auth.h) and the router's API key (router/api_key_gate.h) are two. The port's
// server credentials run it (as the core's auth metadata processor), so it covers every service
// on the port, health and reflection included, and the transport may be TLS. Calls over a
// server's in-process channel do not pass it.
#pragma once

#include <memory>
#include <string_view>

#include "grpcpp/grpcpp.h"
#include "grpcpp/security/server_credentials.h"
#include "rpc/tls.h"

namespace duet::rpc {

class CallGate {
 public:
  virtual ~CallGate() = default;
  // The (lower-case) metadata key of the credential the gate reads.
  virtual std::string_view credential_key() const = 0;
  // Whether the handlers see the credential too (false: it is taken off the call).
  virtual bool passes_credential_on() const = 0;
  // The verdict on a call to `method` ("/package.Service/Method") whose first credential_key()
  // value is `credential` (null: none): OK, or the status the call fails with.
  virtual grpc::Status Admit(std::string_view method, const std::string_view* credential) const = 0;
};

// Server credentials for a port: TLS with `tls` (null: plaintext), and `gate` (null: none) on
// every call. Both must outlive every server the credentials are used for.
std::shared_ptr<grpc::ServerCredentials> GatedServerCredentials(const CallGate* gate, const TlsMaterial* tls);

}  // namespace duet::rpc

// Who may call a worker: the shared secret between the router and its workers, and the gate a
// worker's gRPC server puts in front of its services.
//
// The internal RPCs (duet.v1.PrefillWorker / DecodeWorker: ReserveKv, Prefill, Decode, Abort,
// GetStats) act on other clients' requests and pin KV memory, so only the router may call them.
// Router and workers share a token (`--internal-token-file PATH`, or the environment variable
// DUET_INTERNAL_TOKEN; `duet serve` makes a random one for its cluster and hands it to its
// children in the environment, never on a command line). The router sends it as the metadata
// `x-duet-internal-token` on every call to a worker; a worker with a token answers every call
// without it, or with another one, UNAUTHENTICATED (constant-time comparison). gRPC health
// checking stays open (Kubernetes probes). A worker without a token accepts every call, as
// before, and says so in a WARNING at start-up. Everything but health checking needs the token,
// server reflection included.
//
// Without TLS the token travels in clear text like every call: it keeps other processes that can
// reach a worker's port out, not an attacker on the wire. With --internal-tls-* (rpc/tls.h) the
// worker's port is TLS, and a worker given a CA accepts only clients with a certificate it signed
// (the router's), health checks included; the token is checked as well.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/support/client_interceptor.h"
#include "rpc/call_gate.h"
#include "rpc/tls.h"

namespace duet::rpc {

inline constexpr char kInternalTokenMetadata[] = "x-duet-internal-token";
inline constexpr char kInternalTokenEnv[] = "DUET_INTERNAL_TOKEN";

// The token from `file` when given (surrounding whitespace dropped; an empty or unreadable file
// is an error), else from DUET_INTERNAL_TOKEN, else "" (no token).
absl::StatusOr<std::string> LoadInternalToken(const std::string& file);
// 32 bytes from the kernel's CSPRNG (/dev/urandom), hex-encoded.
absl::StatusOr<std::string> GenerateInternalToken();
// a == b in time that depends on the lengths only.
bool ConstantTimeEquals(std::string_view a, std::string_view b);

// What a worker's server admits. One per server; thread-safe.
class WorkerCallGate final : public CallGate {
 public:
  // `token` empty: every call is admitted (no authentication).
  explicit WorkerCallGate(std::string token) : token_(std::move(token)) {}

  // From now on, calls that start new work (ReserveKv, Prefill) are refused with UNAVAILABLE so
  // the router places them elsewhere, and so is GetStats (the router's poller then marks the
  // worker down); calls for work already here (Decode, Abort) still pass.
  void StartDraining() { draining_.store(true, std::memory_order_release); }
  bool draining() const { return draining_.load(std::memory_order_acquire); }
  bool authenticates() const { return !token_.empty(); }

  // The verdict on a call to `method` ("/package.Service/Method") that carries `token` (null:
  // none): OK, UNAUTHENTICATED or UNAVAILABLE.
  grpc::Status Admit(std::string_view method, const std::string_view* token) const override;
  std::string_view credential_key() const override { return kInternalTokenMetadata; }
  bool passes_credential_on() const override { return false; }  // the handlers never see the token

  // Server credentials that run Admit on every call before any handler: TLS with `tls` (null:
  // plaintext). The gate (and `tls`) must outlive every server they are used for.
  std::shared_ptr<grpc::ServerCredentials> Credentials(const TlsMaterial* tls = nullptr) const {
    return GatedServerCredentials(this, tls);
  }

 private:
  const std::string token_;
  std::atomic<bool> draining_{false};
};

// Client interceptors that put `token` on every call of a channel (for
// grpc::experimental::CreateCustomChannelWithInterceptors); none when `token` is empty.
std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> InternalTokenInterceptors(
    const std::string& token);

}  // namespace duet::rpc

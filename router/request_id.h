// Request ids: the longest one a client may choose, the router's own, unguessable ones, and whose
// an id is.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "grpcpp/server_context.h"

namespace duet::router {

// The longest request id a client may give, in bytes (the id is echoed in every stream message,
// so an unbounded one multiplies the response). Longer ones are INVALID_ARGUMENT / HTTP 400.
inline constexpr size_t kMaxRequestIdBytes = 256;

// InvalidArgument (naming the field `field`, not repeating the id) when `id` is too long.
absl::Status CheckRequestIdLength(std::string_view id, std::string_view field = "request_id");

// Whether `id` can go out as an HTTP header or gRPC metadata value as it is (printable ASCII).
bool IsPrintableAscii(std::string_view id);

// `num_bytes` bytes from the kernel's CSPRNG (getrandom(2)), in lower-case hex.
std::string RandomHex(size_t num_bytes);

// Who sent a call, as far as request ids are concerned (a client's ids are its own, for Abort
// and duplicates): its connection (the peer's address and port) and the credential it presented.
std::string ClientOf(const grpc::CallbackServerContext& context);

}  // namespace duet::router

// Size limits of the router's public requests.
#pragma once

#include <cstddef>

namespace duet::router {

// The largest GenerateRequest the router takes (4 MiB, gRPC's default message limit; a prompt
// that large is longer than any context anyway): larger ones are INVALID_ARGUMENT on gRPC and
// 413 on HTTP, not gRPC's RESOURCE_EXHAUSTED "message larger than max" (which would read as
// "overloaded, retry").
inline constexpr size_t kMaxGenerateRequestBytes = size_t{4} << 20;
// The router's gRPC server takes messages up to this size, so that requests between the two
// limits get the clear error above; beyond it gRPC itself answers RESOURCE_EXHAUSTED.
inline constexpr int kMaxGrpcReceiveBytes = 16 << 20;
// The most completions one request may ask for (gRPC's and HTTP's n).
inline constexpr int kMaxCompletionsPerRequest = 128;

}  // namespace duet::router

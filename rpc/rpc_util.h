// Shared pieces of Duet's gRPC services: status and sampling conversions, server start-up with
// health checking and reflection.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "duet/v1/duet.pb.h"
#include "duet/v1/worker.pb.h"
#include "engine/llm_engine.h"
#include "engine/sampler.h"
#include "engine/sampling_params.h"
#include "grpcpp/grpcpp.h"
#include "metrics/vllm_metrics.h"
#include "rpc/reflection_v1.h"

namespace duet::rpc {

// The trailing metadata key of a Decode stream a draining decode worker ended after parking its
// request with its KV (worker.proto, MigrateKvRequest); the value is the parked reservation's
// transfer id.
inline constexpr char kKvParkedTrailer[] = "duet-kv-parked";

grpc::Status ToGrpc(const absl::Status& status);
absl::Status FromGrpc(const grpc::Status& status);

// Proto options → engine params (defaults as vLLM's), validated: InvalidArgument names the field.
absl::StatusOr<SamplingParams> ToSamplingParams(const v1::SamplingOptions& options);
v1::SamplingOptions ToSamplingOptions(const SamplingParams& params);

void ToProto(const SampledToken& token, v1::TokenLogprobs* out);
void ToProto(const ScoredToken& token, v1::TokenLogprobs* out);  // with its rank
SampledToken FromProto(int32_t token_id, const v1::TokenLogprobs& logprobs);

// A worker's GetStats answer from its engine counters (leases are the caller's to add).
void FillWorkerStats(const EngineStats& stats, const std::string& role, int32_t block_size,
                     v1::WorkerStats* out);
// This process's WorkerStats.instance_id: 128 random bits in hex, drawn on first use.
const std::string& ProcessInstanceId();
// Brings a worker's scheduler gauges and engine counters (preemptions, prefix cache) up to
// `stats`; `recorded` holds the totals already counted and is advanced (the caller serializes
// calls).
void RecordEngineStats(const EngineStats& stats, metrics::EngineMetrics& metrics, EngineStats* recorded);
// The engine's KV-cache configuration, for cache_config_info.
metrics::CacheConfig CacheConfigOf(LlmEngine& engine);
// The share of the engine's KV blocks in use, 0..1 (the decode worker's kv_cache_usage_perc).
double KvCacheUsage(const EngineStats& stats);

// Server-side channel arguments so the router's keepalive pings (every second, also on idle
// connections, to notice dead workers at once) are accepted rather than answered with GOAWAY
// "too_many_pings": permit pings without calls, a 500 ms minimum interval, no strikes.
std::vector<std::pair<std::string, int>> KeepaliveServerArgs();

// Starts a server on `address` ("host:port"; port 0 picks a free one) with the given services,
// grpc.health.v1 health checking and server reflection (v1alpha; v1 too through `reflection_v1`,
// which must outlive the server). `bound_port` receives the real port. `credentials`: how the
// port admits calls (null: insecure, every call; a worker passes its WorkerCallGate's,
// rpc/internal_auth.h). `max_receive_message_bytes` > 0: the largest message it takes (else
// gRPC's default, 4 MiB).
absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(
    const std::string& address, const std::vector<grpc::Service*>& services, int* bound_port,
    std::shared_ptr<grpc::ServerCredentials> credentials = nullptr, int max_receive_message_bytes = 0,
    ReflectionV1Relay* reflection_v1 = nullptr);

}  // namespace duet::rpc

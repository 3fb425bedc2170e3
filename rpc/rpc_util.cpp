#include "rpc/rpc_util.h"

#include <algorithm>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"

namespace duet::rpc {

grpc::Status ToGrpc(const absl::Status& status) {
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status FromGrpc(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::StatusOr<SamplingParams> ToSamplingParams(const v1::SamplingOptions& o) {
  SamplingParams p;
  if (o.has_temperature()) p.temperature = o.temperature();
  if (o.has_top_p()) p.top_p = o.top_p();
  if (o.has_top_k()) p.top_k = o.top_k();
  if (o.has_min_p()) p.min_p = o.min_p();
  if (o.has_repetition_penalty()) p.repetition_penalty = o.repetition_penalty();
  if (o.has_presence_penalty()) p.presence_penalty = o.presence_penalty();
  if (o.has_frequency_penalty()) p.frequency_penalty = o.frequency_penalty();
  if (o.has_seed()) p.seed = o.seed();
  if (o.has_max_tokens()) p.max_tokens = o.max_tokens();
  p.stop.assign(o.stop().begin(), o.stop().end());
  p.stop_token_ids.assign(o.stop_token_ids().begin(), o.stop_token_ids().end());
  p.ignore_eos = o.ignore_eos();
  p.logit_bias.assign(o.logit_bias().begin(), o.logit_bias().end());
  std::sort(p.logit_bias.begin(), p.logit_bias.end());  // a map has unique keys
  if (o.has_logprobs()) p.logprobs = o.logprobs();
  if (o.has_prompt_logprobs()) p.prompt_logprobs = o.prompt_logprobs();
  if (o.has_speculation()) {
    absl::StatusOr<SpeculationMode> mode = ParseSpeculationMode(o.speculation());
    if (!mode.ok()) return mode.status();
    p.speculation = *mode;
  }
  if (o.has_cache_salt()) p.cache_salt = o.cache_salt();
  if (o.has_structured_output()) {
    const v1::StructuredOutput& so = o.structured_output();
    grammar::StructuredOutput& c = p.structured_output;
    using Kind = grammar::StructuredOutput::Kind;
    switch (so.constraint_case()) {
      case v1::StructuredOutput::kJsonSchema: c = {Kind::kJsonSchema, so.json_schema(), {}}; break;
      case v1::StructuredOutput::kJsonObject:
        if (so.json_object()) c.kind = Kind::kJsonObject;
        break;
      case v1::StructuredOutput::kRegex: c = {Kind::kRegex, so.regex(), {}}; break;
      case v1::StructuredOutput::kChoice:
        c = {Kind::kChoice, "", {so.choice().choices().begin(), so.choice().choices().end()}};
        break;
      case v1::StructuredOutput::kGrammar: c = {Kind::kGrammar, so.grammar(), {}}; break;
      case v1::StructuredOutput::CONSTRAINT_NOT_SET: break;
    }
  }
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  return p;
}

v1::SamplingOptions ToSamplingOptions(const SamplingParams& p) {
  v1::SamplingOptions o;
  o.set_temperature(p.temperature);
  o.set_top_p(p.top_p);
  o.set_top_k(p.top_k);
  o.set_min_p(p.min_p);
  o.set_repetition_penalty(p.repetition_penalty);
  o.set_presence_penalty(p.presence_penalty);
  o.set_frequency_penalty(p.frequency_penalty);
  if (p.seed) o.set_seed(*p.seed);
  o.set_max_tokens(p.max_tokens);
  for (const std::string& s : p.stop) o.add_stop(s);
  for (int32_t id : p.stop_token_ids) o.add_stop_token_ids(id);
  for (const auto& [id, bias] : p.logit_bias) (*o.mutable_logit_bias())[id] = bias;
  o.set_ignore_eos(p.ignore_eos);
  if (p.logprobs >= 0) o.set_logprobs(p.logprobs);
  if (p.prompt_logprobs >= 0) o.set_prompt_logprobs(p.prompt_logprobs);
  if (p.speculation) o.set_speculation(SpeculationModeName(*p.speculation));
  if (!p.cache_salt.empty()) o.set_cache_salt(p.cache_salt);
  const grammar::StructuredOutput& c = p.structured_output;
  using Kind = grammar::StructuredOutput::Kind;
  switch (c.kind) {
    case Kind::kNone: break;
    case Kind::kJsonSchema: o.mutable_structured_output()->set_json_schema(c.spec); break;
    case Kind::kJsonObject: o.mutable_structured_output()->set_json_object(true); break;
    case Kind::kRegex: o.mutable_structured_output()->set_regex(c.spec); break;
    case Kind::kGrammar: o.mutable_structured_output()->set_grammar(c.spec); break;
    case Kind::kChoice:
      for (const std::string& s : c.choices) o.mutable_structured_output()->mutable_choice()->add_choices(s);
      break;
  }
  return o;
}

void ToProto(const SampledToken& token, v1::TokenLogprobs* out) {
  out->set_logprob(token.logprob);
  for (const TokenLogprob& t : token.top_logprobs) {
    v1::TopLogprob* top = out->add_top();
    top->set_token_id(t.token);
    top->set_logprob(t.logprob);
  }
}

void ToProto(const ScoredToken& token, v1::TokenLogprobs* out) {
  out->set_logprob(token.logprob);
  out->set_rank(token.rank);
  for (const TokenLogprob& t : token.top) {
    v1::TopLogprob* top = out->add_top();
    top->set_token_id(t.token);
    top->set_logprob(t.logprob);
  }
}

SampledToken FromProto(int32_t token_id, const v1::TokenLogprobs& logprobs) {
  SampledToken token;
  token.token = token_id;
  token.logprob = logprobs.logprob();
  for (const v1::TopLogprob& t : logprobs.top()) token.top_logprobs.push_back({t.token_id(), t.logprob()});
  return token;
}

void FillWorkerStats(const EngineStats& stats, const std::string& role, int32_t block_size,
                     v1::WorkerStats* out) {
  out->set_role(role);
  out->set_num_requests_running(stats.num_running);
  out->set_num_requests_waiting(stats.num_waiting);
  out->set_num_kv_blocks(stats.num_kv_blocks);
  out->set_num_free_kv_blocks(stats.num_free_kv_blocks);
  out->set_num_preemptions(stats.num_preemptions);
  out->set_block_size(block_size);
  out->set_prefix_cache_queries(stats.prefix_cache_queries);
  out->set_prefix_cache_hits(stats.prefix_cache_hits);
  out->set_instance_id(ProcessInstanceId());
}

const std::string& ProcessInstanceId() {
  static const std::string id = [] {
    absl::BitGen gen;
    return absl::StrCat(absl::Hex(absl::Uniform<uint64_t>(gen), absl::kZeroPad16),
                        absl::Hex(absl::Uniform<uint64_t>(gen), absl::kZeroPad16));
  }();
  return id;
}

metrics::CacheConfig CacheConfigOf(LlmEngine& engine) {
  const KvCacheShape& shape = engine.kv_cache().shape();
  metrics::CacheConfig config;
  config.block_size = shape.block_size;
  config.num_gpu_blocks = shape.num_blocks;
  config.cache_dtype = shape.dtype == KvDtype::kFloat32 ? "float32" : "bfloat16";
  config.gpu_memory_utilization = engine.config().gpu_memory_utilization;
  config.enable_prefix_caching = engine.config().enable_prefix_caching;
  return config;
}

double KvCacheUsage(const EngineStats& stats) {
  return stats.num_kv_blocks > 0 ? double(stats.num_kv_blocks - stats.num_free_kv_blocks) / stats.num_kv_blocks : 0.0;
}

void RecordEngineStats(const EngineStats& stats, metrics::EngineMetrics& metrics, EngineStats* recorded) {
  metrics.num_requests_running.Set(stats.num_running);
  metrics.num_requests_waiting.Set(stats.num_waiting);
  auto advance = [](metrics::Counter& counter, int64_t total, int64_t& seen) {
    if (total > seen) counter.Inc(double(total - seen));
    seen = std::max(seen, total);
  };
  advance(metrics.num_preemptions, stats.num_preemptions, recorded->num_preemptions);
  advance(metrics.prefix_cache_queries, stats.prefix_cache_queries, recorded->prefix_cache_queries);
  advance(metrics.prefix_cache_hits, stats.prefix_cache_hits, recorded->prefix_cache_hits);
  advance(metrics.kv_cache_evictions, stats.num_kv_evictions, recorded->num_kv_evictions);
  advance(metrics.host_kv_cache_offloaded_blocks, stats.host_tier.offloaded_blocks,
          recorded->host_tier.offloaded_blocks);
  advance(metrics.host_kv_cache_hit_blocks, stats.host_tier.loaded_blocks, recorded->host_tier.loaded_blocks);
  advance(metrics.host_kv_cache_evictions, stats.host_tier.evicted_blocks, recorded->host_tier.evicted_blocks);
  metrics.host_kv_cache_usage_perc.Set(
      stats.host_tier_slots > 0 ? double(stats.host_tier_used_slots) / double(stats.host_tier_slots) : 0.0);
}

std::vector<std::pair<std::string, int>> KeepaliveServerArgs() {
  return {
      {GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1},
      {GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 500},
      {GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0},
  };
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(const std::string& address,
                                                          const std::vector<grpc::Service*>& services,
                                                          int* bound_port,
                                                          std::shared_ptr<grpc::ServerCredentials> credentials,
                                                          int max_receive_message_bytes,
                                                          ReflectionV1Relay* reflection_v1) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  for (const auto& [name, value] : KeepaliveServerArgs()) builder.AddChannelArgument(name, value);
  // gRPC sets SO_REUSEPORT by default, so a second server on a taken port would listen beside the
  // first and share its connections silently: a taken port is an error instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  if (max_receive_message_bytes > 0) builder.SetMaxReceiveMessageSize(max_receive_message_bytes);
  builder.AddListeningPort(address, credentials != nullptr ? credentials : grpc::InsecureServerCredentials(),
                           bound_port);
  for (grpc::Service* service : services) builder.RegisterService(service);
  if (reflection_v1 != nullptr) builder.RegisterCallbackGenericService(reflection_v1);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *bound_port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address));
  }
  if (reflection_v1 != nullptr) reflection_v1->SetServer(server.get());
  return server;
}

}  // namespace duet::rpc

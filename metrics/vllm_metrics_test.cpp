#include "metrics/vllm_metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <set>
#include <sstream>
#include <string>

#include "metrics/test_promtool.h"

namespace duet::metrics {
namespace {

using ::testing::HasSubstr;

// A registry holding every Duet metric of every role, with some of each kind of value.
void Populate(Registry& registry) {
  const std::string model = "tiny \"llama\"\\v1";
  RouterMetrics router(registry, model, 2048);
  router.num_requests_waiting.Set(1);
  router.RecordParams(2, 300);
  router.RecordFinished({FinishReason::kStop, 17, 300, 512, 3.2, 0.01, 3.0});
  router.request_success(FinishReason::kLength).Inc(2);
  router.time_to_first_token_seconds.Observe(0.042);
  router.inter_token_latency_seconds.Observe(0.012);
  router.time_per_output_token_seconds.Observe(0.012);
  router.request_queue_time_seconds.Observe(0.01);
  router.RecordHttpRequest("/v1/completions", "POST", 200, 3.3);
  router.RecordHttpRequest("/v1/completions", "POST", 429, 0.001);
  PrefillMetrics prefill(registry, model);
  prefill.num_requests_running.Set(3);
  prefill.num_preemptions.Inc();
  prefill.iteration_tokens_total.Observe(17);
  prefill.SetCacheConfig({16, 512, "bfloat16", 0.45, false});
  prefill.prompt_tokens.Inc(1234);
  prefill.request_prefill_time_seconds.Observe(0.03);
  prefill.kv_transfer_failures.Inc(0);
  prefill.kv_transfer_bytes.Observe(3 << 20);
  prefill.kv_transfer_seconds("cuda_ipc").Observe(0.0042);
  prefill.kv_transfer_bytes_total("cuda_ipc").Inc(3 << 20);
  prefill.kv_transfer_wait_seconds.Observe(0.0001);
  DecodeMetrics decode(registry, model);
  decode.num_requests_running.Set(3);
  decode.num_requests_waiting.Set(1);
  decode.iteration_tokens_total.Observe(3);
  decode.SetCacheConfig({16, 4096, "float32", 0.9, false});
  decode.kv_cache_usage_perc.Set(0.375);
  decode.generation_tokens.Inc(567);
  decode.request_decode_time_seconds.Observe(3.07);
  decode.spec_decode_num_drafts.Inc(4);
  decode.spec_decode_num_draft_tokens.Inc(12);
  decode.spec_decode_num_accepted_tokens.Inc(5);
  decode.spec_decode_num_accepted_tokens_per_pos(0).Inc(3);
}

// The families (# TYPE lines) of an exposition.
std::set<std::string> Families(const std::string& text) {
  std::set<std::string> names;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("# TYPE ", 0) == 0) names.insert(line.substr(7, line.find(' ', 7) - 7));
  }
  return names;
}

TEST(VllmMetricsTest, BucketsMatchVllm) {
  EXPECT_EQ(TtftBuckets().size(), 22u);
  EXPECT_EQ(TtftBuckets().front(), 0.001);
  EXPECT_EQ(TtftBuckets().back(), 2560.0);
  EXPECT_EQ(InterTokenLatencyBuckets().size(), 19u);
  EXPECT_EQ(InterTokenLatencyBuckets().back(), 80.0);
  EXPECT_EQ(RequestLatencyBuckets().size(), 21u);
  EXPECT_EQ(RequestLatencyBuckets().front(), 0.3);
  EXPECT_EQ(RequestLatencyBuckets().back(), 7680.0);
  EXPECT_EQ(Build125Buckets(100), (std::vector<double>{1, 2, 5, 10, 20, 50, 100}));
  EXPECT_EQ(Build125Buckets(4096).back(), 2000);
  EXPECT_EQ(IterationTokensBuckets(), (std::vector<double>{1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384}));
  EXPECT_EQ(RequestParamsNBuckets(), (std::vector<double>{1, 2, 5, 10, 20}));
  EXPECT_EQ(KvTransferBytesBuckets().front(), 1024);
  EXPECT_EQ(KvTransferBytesBuckets().back(), 4.0 * 1024 * 1024 * 1024);
  EXPECT_EQ(KvTransferSecondsBuckets().size(), 18u);
}

// Each role exports exactly the families it owns (metrics/README.md), so that a sum over every
// process of a cluster counts each thing once.
TEST(VllmMetricsTest, EachRoleExportsWhatItOwns) {
  Registry router_registry, prefill_registry, decode_registry;
  RouterMetrics router(router_registry, "m");
  PrefillMetrics prefill(prefill_registry, "m");
  DecodeMetrics decode(decode_registry, "m");
  prefill.SetCacheConfig({16, 64, "float32", 0.9, false});
  decode.SetCacheConfig({16, 64, "float32", 0.9, false});
  router.RecordHttpRequest("/health", "GET", 200, 0.001);
  prefill.kv_transfer_bytes_total("ucx_shm").Inc(1);
  prefill.kv_transfer_seconds("ucx_shm").Observe(0.001);
  decode.spec_decode_num_accepted_tokens_per_pos(0).Inc();
  EXPECT_EQ(Families(router_registry.Render()),
            (std::set<std::string>{"duet:e2e_request_latency_seconds", "duet:inter_token_latency_seconds",
                                   "duet:num_requests_waiting", "duet:request_generation_tokens",
                                   "duet:request_inference_time_seconds", "duet:request_max_num_generation_tokens",
                                   "duet:request_params_max_tokens", "duet:request_params_n",
                                   "duet:kv_migrations_total", "duet:request_migrations_total", "duet:request_prompt_tokens",
                                   "duet:request_queue_time_seconds", "duet:request_success_total", "duet:request_time_per_output_token_seconds",
                                   "duet:routed_prompt_blocks_cached_total", "duet:routed_prompt_blocks_total",
                                   "duet:router_prefills_total", "duet:router_worker_call_seconds",
                                   "duet:time_per_output_token_seconds", "duet:time_to_first_token_seconds",
                                   "http_request_duration_seconds", "http_requests_total"}));
  const std::set<std::string> engine = {"duet:cache_config_info", "duet:iteration_tokens_total",
                                        "duet:num_preemptions_total", "duet:num_requests_running",
                                        "duet:num_requests_waiting", "duet:prefix_cache_queries_total",
                                        "duet:prefix_cache_hits_total", "duet:kv_cache_evictions_total",
                                        "duet:host_kv_cache_offloaded_blocks_total", "duet:host_kv_cache_hit_blocks_total",
                                        "duet:host_kv_cache_evictions_total", "duet:host_kv_cache_usage_perc"};
  std::set<std::string> want_prefill = engine;
  want_prefill.insert({"duet:prompt_tokens_total", "duet:request_prefill_time_seconds", "duet:kv_transfer_bytes",
                       "duet:kv_transfer_bytes_total", "duet:kv_transfer_failures_total", "duet:kv_transfer_seconds",
                       "duet:kv_transfer_wait_seconds", "duet:kv_late_targets_total"});
  EXPECT_EQ(Families(prefill_registry.Render()), want_prefill);
  std::set<std::string> want_decode = engine;
  want_decode.insert({"duet:kv_cache_usage_perc", "duet:generation_tokens_total", "duet:request_decode_time_seconds",
                      "duet:prompt_tokens_total",
                      "duet:spec_decode_num_drafts_total", "duet:spec_decode_num_draft_tokens_total",
                      "duet:spec_decode_num_accepted_tokens_total",
                      "duet:spec_decode_num_accepted_tokens_per_pos_total"});
  EXPECT_EQ(Families(decode_registry.Render()), want_decode);
}

TEST(VllmMetricsTest, NamesLabelsAndValues) {
  Registry registry;
  PrefillMetrics m(registry, "tiny");
  m.prompt_tokens.Inc(5);
  m.num_requests_running.Set(2);
  m.request_prefill_time_seconds.Observe(0.042);
  std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("duet:prompt_tokens_total{model_name=\"tiny\",role=\"prefill\"} 5\n"));
  EXPECT_THAT(text, HasSubstr("duet:num_requests_running{model_name=\"tiny\",role=\"prefill\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("duet:request_prefill_time_seconds_bucket{model_name=\"tiny\","
                              "role=\"prefill\",le=\"0.3\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("duet:request_prefill_time_seconds_bucket{model_name=\"tiny\","
                              "role=\"prefill\",le=\"7680.0\"} 1\n"));
  // Every sample line carries model_name and role.
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] == '#') continue;
    EXPECT_THAT(line, HasSubstr("{model_name=\"tiny\",role=\"prefill\"")) << line;
  }
}

TEST(VllmMetricsTest, RequestSuccessCountsVllmsFinishReasonsOnly) {
  EXPECT_TRUE(CountsAsSuccess(FinishReason::kStop));
  EXPECT_TRUE(CountsAsSuccess(FinishReason::kLength));
  EXPECT_TRUE(CountsAsSuccess(FinishReason::kAbort));
  EXPECT_FALSE(CountsAsSuccess(FinishReason::kNone));
  EXPECT_FALSE(CountsAsSuccess(FinishReason::kError));
  Registry registry;
  RouterMetrics m(registry, "tiny");
  m.request_success(FinishReason::kAbort).Inc();
  EXPECT_NE(registry.Render().find("finished_reason=\"abort\"} 1"), std::string::npos) << registry.Render();
  EXPECT_NE(registry.Render().find("finished_reason=\"stop\"} 0"), std::string::npos);
}

// One finished request moves every per-request family once, with vLLM's meanings.
TEST(VllmMetricsTest, RouterRecordsAFinishedRequest) {
  Registry registry;
  RouterMetrics m(registry, "tiny", 4096);
  FinishedRequest r;
  r.reason = FinishReason::kLength;
  r.prompt_tokens = 21;
  r.generation_tokens = 11;
  r.max_tokens = 11;
  r.e2e_seconds = 2.5;
  r.queue_seconds = 0.5;
  r.decode_seconds = 1.0;  // 10 gaps after the first token
  m.RecordFinished(r);
  EXPECT_EQ(m.request_success(FinishReason::kLength).Value(), 1);
  EXPECT_EQ(m.request_prompt_tokens.Collect().sum, 21);
  EXPECT_EQ(m.request_generation_tokens.Collect().sum, 11);
  EXPECT_EQ(m.request_max_num_generation_tokens.Collect().sum, 11);
  EXPECT_EQ(m.e2e_request_latency_seconds.Collect().sum, 2.5);
  EXPECT_EQ(m.request_inference_time_seconds.Collect().sum, 2.0);  // e2e less the queue
  EXPECT_DOUBLE_EQ(m.request_time_per_output_token_seconds.Collect().sum, 0.1);
  // One token: no time per output token (no gap to measure).
  r.generation_tokens = 1;
  r.decode_seconds = 0;
  m.RecordFinished(r);
  EXPECT_EQ(m.request_time_per_output_token_seconds.Collect().count, 1u);
  EXPECT_EQ(m.e2e_request_latency_seconds.Collect().count, 2u);
}

TEST(VllmMetricsTest, RouterRecordsParams) {
  Registry registry;
  RouterMetrics m(registry, "tiny", 4096);
  m.RecordParams(3, 100);
  m.RecordParams(1, 7);
  const Histogram::Snapshot n = m.request_params_n.Collect();
  EXPECT_EQ(n.count, 2u);
  EXPECT_EQ(n.sum, 4);
  EXPECT_EQ(n.cumulative[0], 1u);  // le=1
  EXPECT_EQ(n.cumulative[2], 2u);  // le=5
  EXPECT_EQ(m.request_params_max_tokens.Collect().sum, 107);
  EXPECT_THAT(registry.Render(), HasSubstr("duet:request_params_n_bucket{model_name=\"tiny\",role=\"router\",le=\"2.0\"} 1\n"));
}

TEST(VllmMetricsTest, RoutedPromptBlocksByWorkerRole) {
  Registry registry;
  RouterMetrics m(registry, "tiny");
  m.routed_prompt_blocks(/*decode=*/false).Inc(10);
  m.routed_prompt_blocks_cached(/*decode=*/false).Inc(7);
  m.routed_prompt_blocks(/*decode=*/true).Inc(4);
  const std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("duet:routed_prompt_blocks_total{model_name=\"tiny\",role=\"router\","
                              "worker_role=\"prefill\"} 10\n"));
  EXPECT_THAT(text, HasSubstr("duet:routed_prompt_blocks_cached_total{model_name=\"tiny\",role=\"router\","
                              "worker_role=\"prefill\"} 7\n"));
  EXPECT_THAT(text, HasSubstr("duet:routed_prompt_blocks_total{model_name=\"tiny\",role=\"router\","
                              "worker_role=\"decode\"} 4\n"));
  EXPECT_THAT(text, HasSubstr("duet:routed_prompt_blocks_cached_total{model_name=\"tiny\",role=\"router\","
                              "worker_role=\"decode\"} 0\n"));
}

TEST(VllmMetricsTest, WorkerCallSecondsByCall) {
  Registry registry;
  RouterMetrics m(registry, "tiny");
  m.worker_call_seconds(RouterMetrics::WorkerCall::kPrefill).Observe(0.0125);
  m.worker_call_seconds(RouterMetrics::WorkerCall::kDecodeFirstMessage).Observe(0.0004);
  const std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("duet:router_worker_call_seconds_sum{model_name=\"tiny\",role=\"router\","
                              "call=\"prefill\"} 0.0125\n"));
  EXPECT_THAT(text, HasSubstr("duet:router_worker_call_seconds_count{model_name=\"tiny\",role=\"router\","
                              "call=\"decode_first_message\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("duet:router_worker_call_seconds_count{model_name=\"tiny\",role=\"router\","
                              "call=\"reserve_kv\"} 0\n"));
}

TEST(VllmMetricsTest, RequestMigrationsByOutcome) {
  Registry registry;
  RouterMetrics m(registry, "tiny");
  m.request_migrations(RouterMetrics::Migration::kSuccess).Inc();
  m.request_migrations(RouterMetrics::Migration::kSuccess).Inc();
  m.request_migrations(RouterMetrics::Migration::kLimit).Inc();
  const std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("duet:request_migrations_total{model_name=\"tiny\",role=\"router\",outcome=\"success\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("duet:request_migrations_total{model_name=\"tiny\",role=\"router\",outcome=\"failure\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("duet:request_migrations_total{model_name=\"tiny\",role=\"router\",outcome=\"limit\"} 1\n"));
}

TEST(VllmMetricsTest, KvMigrationsByOutcome) {
  Registry registry;
  RouterMetrics m(registry, "tiny");
  m.kv_migrations(RouterMetrics::KvMigration::kMoved).Inc();
  m.kv_migrations(RouterMetrics::KvMigration::kFailed).Inc();
  const std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("duet:kv_migrations_total{model_name=\"tiny\",role=\"router\",outcome=\"moved\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("duet:kv_migrations_total{model_name=\"tiny\",role=\"router\",outcome=\"resumed\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("duet:kv_migrations_total{model_name=\"tiny\",role=\"router\",outcome=\"failed\"} 1\n"));
}

TEST(VllmMetricsTest, HttpRequestsByHandlerMethodAndStatus) {
  Registry registry;
  RouterMetrics m(registry, "tiny");
  m.RecordHttpRequest("/v1/completions", "POST", 200, 0.2);
  m.RecordHttpRequest("/v1/completions", "POST", 429, 0.001);
  m.RecordHttpRequest("/v1/completions", "POST", 429, 0.002);
  m.RecordHttpRequest("/v1/chat/completions", "POST", 400, 0.001);
  m.RecordHttpRequest("/health", "GET", 503, 0.001);
  // Paths and methods the API does not serve share one series each, whatever the client sent.
  m.RecordHttpRequest("/wp-admin/x", "GET", 404, 0.001);
  m.RecordHttpRequest("/another/scan", "GET", 404, 0.001);
  m.RecordHttpRequest("/v1/models", "BREW", 405, 0.001);
  const std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("http_requests_total{handler=\"/v1/completions\",method=\"POST\",status=\"200\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("http_requests_total{handler=\"/v1/completions\",method=\"POST\",status=\"429\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("http_requests_total{handler=\"/v1/chat/completions\",method=\"POST\",status=\"400\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("http_requests_total{handler=\"/health\",method=\"GET\",status=\"503\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("http_requests_total{handler=\"none\",method=\"GET\",status=\"404\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("http_requests_total{handler=\"/v1/models\",method=\"other\",status=\"405\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("http_request_duration_seconds_count{handler=\"/v1/completions\",method=\"POST\","
                              "status=\"429\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("http_request_duration_seconds_bucket{handler=\"/v1/completions\",method=\"POST\","
                              "status=\"200\",le=\"0.25\"} 1\n"));
  EXPECT_EQ(text.find("wp-admin"), std::string::npos);
}

TEST(VllmMetricsTest, CacheConfigInfoAndIterationTokens) {
  Registry registry;
  DecodeMetrics m(registry, "tiny");
  m.SetCacheConfig({16, 512, "bfloat16", 0.45, false});
  m.iteration_tokens_total.Observe(1);
  m.iteration_tokens_total.Observe(40);
  const std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("duet:cache_config_info{model_name=\"tiny\",role=\"decode\",block_size=\"16\","
                              "cache_dtype=\"bfloat16\",enable_prefix_caching=\"False\","
                              "gpu_memory_utilization=\"0.45\",num_gpu_blocks=\"512\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("duet:iteration_tokens_total_bucket{model_name=\"tiny\",role=\"decode\",le=\"1.0\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("duet:iteration_tokens_total_bucket{model_name=\"tiny\",role=\"decode\",le=\"32.0\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("duet:iteration_tokens_total_bucket{model_name=\"tiny\",role=\"decode\",le=\"64.0\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("duet:iteration_tokens_total_sum{model_name=\"tiny\",role=\"decode\"} 41\n"));
}

// Two roles in one registry (tests do this) share the families they both export.
TEST(VllmMetricsTest, RolesShareFamilies) {
  Registry registry;
  RouterMetrics router(registry, "m");
  PrefillMetrics prefill(registry, "m");
  router.num_requests_waiting.Set(1);
  prefill.num_requests_waiting.Set(2);
  std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("duet:num_requests_waiting{model_name=\"m\",role=\"prefill\"} 2\n"
                              "duet:num_requests_waiting{model_name=\"m\",role=\"router\"} 1\n"));
}

// The whole set as one exposition through promtool (the rules it checks: metrics/test_promtool.h).
TEST(VllmMetricsTest, PromtoolAcceptsEveryDuetMetric) {
  if (!testing::PromtoolInstalled()) GTEST_SKIP() << "promtool not installed";
  Registry registry;
  Populate(registry);
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / ("duet_promtool_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  testing::ExpectPromtoolAccepts("every_role", registry.Render(), dir);

  // Negative control: promtool does reject a broken exposition.
  const testing::PromtoolResult broken =
      testing::PromtoolCheckMetrics("# TYPE x counter\nx{a=\"unterminated} 1\n", dir / "broken.prom");
  EXPECT_EQ(broken.exit_code, 1) << broken.output;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace duet::metrics

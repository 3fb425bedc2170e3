// The disaggregated cluster as users meet it: real router, prefill and decode processes on
// loopback, KV over UCX, requests through the public gRPC API.
#include <signal.h>

#include <atomic>
#include <fstream>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <future>
#include <thread>

#include "grpcpp/health_check_service_interface.h"
#include "gtest/gtest.h"
#include "metrics/test_http_client.h"
#include "nlohmann/json.hpp"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "tests/integration/local_cluster.h"
#include "tests/integration/process.h"

namespace duet {
namespace {

using nlohmann::json;
using testing::LocalCluster;
using testing::RunGenerate;
using testing::StreamResult;

json Reference() {
  std::ifstream in(std::string(DUET_MODELS_DIR) + "/tiny-code-llama/reference_greedy.json");
  return json::parse(in);
}

v1::GenerateRequest TokenRequest(const std::vector<int32_t>& ids, int max_tokens) {
  v1::GenerateRequest r;
  for (int32_t id : ids) r.mutable_token_ids()->add_ids(id);
  r.mutable_sampling()->set_temperature(0.0f);
  r.mutable_sampling()->set_max_tokens(max_tokens);
  return r;
}

// Waits (up to `timeout_ms`) until every decode and prefill worker reports all KV blocks free and
// no leases.
bool WaitForIdleKv(LocalCluster& cluster, size_t expected_decode, std::string* detail, int timeout_ms = 10000) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (int attempt = 0;; ++attempt) {
    if (attempt > 0 && std::chrono::steady_clock::now() > deadline) return false;
    bool idle = true;
    std::vector<v1::WorkerStats> all = cluster.DecodeStats();
    if (all.size() != expected_decode) idle = false;
    for (const v1::WorkerStats& s : cluster.PrefillStats()) all.push_back(s);
    *detail = "";
    for (const v1::WorkerStats& s : all) {
      *detail += s.ShortDebugString() + "\n";
      if (s.num_free_kv_blocks() != s.num_kv_blocks() || s.num_kv_leases() != 0 ||
          s.num_requests_running() != 0 || s.num_requests_waiting() != 0) {
        idle = false;
      }
    }
    if (idle) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

bool RouterServing(LocalCluster& cluster) {
  auto stub = grpc::health::v1::Health::NewStub(cluster.router_channel());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  return stub->Check(&ctx, req, &resp).ok() && resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

// Services a process lists through server reflection.
std::set<std::string> ReflectedServices(const std::string& address) {
  auto stub = grpc::reflection::v1alpha::ServerReflection::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  auto stream = stub->ServerReflectionInfo(&ctx);
  grpc::reflection::v1alpha::ServerReflectionRequest request;
  request.set_list_services("");
  std::set<std::string> names;
  grpc::reflection::v1alpha::ServerReflectionResponse response;
  if (stream->Write(request) && stream->WritesDone() && stream->Read(&response)) {
    for (const auto& s : response.list_services_response().service()) names.insert(s.name());
  }
  stream->Finish();
  return names;
}

bool Serving(const std::string& address) {
  auto stub = grpc::health::v1::Health::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  grpc::health::v1::HealthCheckResponse resp;
  return stub->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp).ok() &&
         resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

TEST(ClusterTest, EveryProcessAnswersHealthAndReflection) {
  LocalCluster cluster({1, 1});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string router = "127.0.0.1:" + std::to_string(cluster.router_port());
  EXPECT_TRUE(Serving(router));
  std::set<std::string> services = ReflectedServices(router);
  EXPECT_TRUE(services.count("duet.v1.Duet")) << services.size();
  EXPECT_TRUE(services.count("grpc.health.v1.Health"));
  const std::vector<std::string>& workers = cluster.worker_addresses();
  ASSERT_EQ(workers.size(), 2u);
  EXPECT_TRUE(Serving(workers[0]));
  EXPECT_TRUE(ReflectedServices(workers[0]).count("duet.v1.DecodeWorker"));
  EXPECT_TRUE(Serving(workers[1]));
  EXPECT_TRUE(ReflectedServices(workers[1]).count("duet.v1.PrefillWorker"));
}

TEST(ClusterTest, ReferenceGreedyCasesConcurrentlyMatchExactly) {
  LocalCluster cluster({/*num_prefill=*/2, /*num_decode=*/2});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const json ref = Reference();
  std::vector<std::future<StreamResult>> results;
  for (const json& c : ref["cases"]) {
    v1::GenerateRequest r = TokenRequest(c["prompt_ids"].get<std::vector<int32_t>>(), 128);
    results.push_back(std::async(std::launch::async, [&cluster, r] { return RunGenerate(cluster.router(), r); }));
  }
  for (size_t i = 0; i < results.size(); ++i) {
    StreamResult got = results[i].get();
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    EXPECT_EQ(got.token_ids, ref["cases"][i]["greedy_ids"].get<std::vector<int32_t>>()) << "case " << i;
    EXPECT_EQ(got.text, ref["cases"][i]["greedy_text"].get<std::string>()) << "case " << i;
    EXPECT_EQ(got.finish_reason, "length");
  }
  std::string detail;
  EXPECT_TRUE(WaitForIdleKv(cluster, 2, &detail)) << detail;
}

// Sequence-parallel prefill in the prefill worker (3 ranks, ring attention), the prompt's KV
// shipped from the ranks' shared cache: the reference continuations all the same.
TEST(ClusterTest, SequenceParallelPrefillWorkerMatchesTheReference) {
  LocalCluster cluster({1, 1, {"--sp-ranks", "3", "--sp-min-tokens", "8", "--max-num-seqs", "1"}});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const json ref = Reference();
  for (size_t i = 0; i < ref["cases"].size(); ++i) {
    const json& c = ref["cases"][i];
    StreamResult got = RunGenerate(cluster.router(), TokenRequest(c["prompt_ids"].get<std::vector<int32_t>>(), 128));
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    EXPECT_EQ(got.token_ids, c["greedy_ids"].get<std::vector<int32_t>>()) << "case " << i;
  }
  std::string detail;
  EXPECT_TRUE(WaitForIdleKv(cluster, 1, &detail)) << detail;
}

// The same mixed batch (seeded sampling, penalties, stop strings) through the cluster and
// through `duet generate` gives the same tokens and text.
TEST(ClusterTest, SampledRequestsEqualDuetGenerate) {
  const std::vector<std::string> prompts = {"def merge_sort(items):\n", "class Stack:\n    def __init__(self):\n",
                                            "import json\n\n\ndef load(path):\n", "for i in range(10):\n"};
  std::vector<json> rows;
  for (int i = 0; i < 12; ++i) {
    json row = {{"id", "s" + std::to_string(i)}, {"prompt", prompts[size_t(i) % prompts.size()]},
                {"max_tokens", 40}, {"temperature", 0.7 + 0.05 * (i % 4)}, {"top_p", 0.95},
                {"top_k", i % 3 == 0 ? 0 : 40}, {"seed", 100 + i}};
    if (i % 4 == 1) row["stop"] = json::array({"\n\n"});
    if (i % 4 == 2) row["min_p"] = 0.05;
    if (i == 3) row["temperature"] = 0;
    rows.push_back(row);
  }
  const std::string dir = testing::MakeTempDir("cluster-vs-generate");
  testing::WriteJsonlFile(dir + "/in.jsonl", rows);
  ASSERT_EQ(testing::RunCommand(testing::DuetBinary() + " generate --backend cpu --model " DUET_MODELS_DIR
                                "/tiny-code-llama --input " + dir + "/in.jsonl --output " + dir + "/out.jsonl",
                                dir + "/log.txt"), 0) << testing::ReadText(dir + "/log.txt");
  const std::vector<json> expected = testing::ReadJsonlFile(dir + "/out.jsonl");

  LocalCluster cluster({1, 2});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  std::vector<std::future<StreamResult>> results;
  for (const json& row : rows) {
    v1::GenerateRequest r;
    r.set_text(row["prompt"].get<std::string>());
    v1::SamplingOptions* s = r.mutable_sampling();
    s->set_max_tokens(row["max_tokens"].get<int>());
    s->set_temperature(row["temperature"].get<float>());
    s->set_top_p(row["top_p"].get<float>());
    s->set_top_k(row["top_k"].get<int>());
    s->set_seed(row["seed"].get<uint64_t>());
    if (row.contains("stop")) s->add_stop(row["stop"][0].get<std::string>());
    if (row.contains("min_p")) s->set_min_p(row["min_p"].get<float>());
    results.push_back(std::async(std::launch::async, [&cluster, r] { return RunGenerate(cluster.router(), r); }));
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    StreamResult got = results[i].get();
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    EXPECT_EQ(got.token_ids, expected[i]["token_ids"].get<std::vector<int32_t>>()) << rows[i].dump();
    EXPECT_EQ(got.text, expected[i]["text"].get<std::string>()) << rows[i].dump();
    EXPECT_EQ(got.finish_reason, expected[i]["finish_reason"].get<std::string>()) << rows[i].dump();
  }
}

// Chats of several turns (each turn's prompt: the last prompt, its output, a new message)
// through a cluster with prefix caching (the default) and one without: the same tokens, while
// the decode worker reuses each previous turn's KV (only the rest moves) and the prefill worker
// computes only the uncached suffix.
TEST(ClusterTest, MultiTurnChatsWithPrefixCachingEqualCacheOff) {
  LocalCluster on({1, 1});
  ASSERT_TRUE(on.ok()) << on.error();
  LocalCluster off({1, 1, {"--no-enable-prefix-caching"}});
  ASSERT_TRUE(off.ok()) << off.error();
  const json ref = Reference();
  std::vector<std::vector<int32_t>> history;
  for (int s = 0; s < 3; ++s) history.push_back(ref["cases"][size_t(s)]["prompt_ids"].get<std::vector<int32_t>>());
  const std::vector<int32_t> message = {13, 1753, 1243, 2989, 1125, 13};  // a short user turn
  for (int turn = 0; turn < 3; ++turn) {
    std::vector<std::future<StreamResult>> a, b;
    std::vector<v1::GenerateRequest> requests;
    for (std::vector<int32_t>& h : history) {
      h.insert(h.end(), message.begin(), message.end());
      v1::GenerateRequest r = TokenRequest(h, 24);
      if (turn == 1) {  // seeded sampling too
        r.mutable_sampling()->set_temperature(0.8f);
        r.mutable_sampling()->set_seed(uint64_t(42 + h.size()));
      }
      requests.push_back(r);
      a.push_back(std::async(std::launch::async, [&on, r] { return RunGenerate(on.router(), r); }));
      b.push_back(std::async(std::launch::async, [&off, r] { return RunGenerate(off.router(), r); }));
    }
    for (size_t i = 0; i < history.size(); ++i) {
      StreamResult x = a[i].get(), y = b[i].get();
      ASSERT_TRUE(x.status.ok()) << x.status.error_message();
      ASSERT_TRUE(y.status.ok()) << y.status.error_message();
      ASSERT_EQ(x.token_ids, y.token_ids) << "turn " << turn << " chat " << i;
      history[i].insert(history[i].end(), x.token_ids.begin(), x.token_ids.end());
    }
  }
  const std::vector<v1::WorkerStats> decode = on.DecodeStats(), prefill = on.PrefillStats();
  ASSERT_EQ(decode.size(), 1u);
  ASSERT_EQ(prefill.size(), 1u);
  // Turns 2 and 3 find the earlier turns in both workers' caches.
  EXPECT_GT(decode[0].prefix_cache_hits(), decode[0].prefix_cache_queries() / 2) << decode[0].ShortDebugString();
  EXPECT_GT(prefill[0].prefix_cache_hits(), prefill[0].prefix_cache_queries() / 2) << prefill[0].ShortDebugString();
  EXPECT_EQ(off.DecodeStats()[0].prefix_cache_hits(), 0);
  std::string detail;
  EXPECT_TRUE(WaitForIdleKv(on, 1, &detail)) << detail;
}

// `streams` concurrent greedy streams of the reference cases (in turn), `max_tokens` each: every
// one equals the start of its reference continuation.
void ExpectConcurrentStreamsMatchTheReference(LocalCluster& cluster, int streams, int max_tokens) {
  const json ref = Reference();
  std::vector<std::future<StreamResult>> results;
  for (int i = 0; i < streams; ++i) {
    const json& c = ref["cases"][size_t(i) % ref["cases"].size()];
    v1::GenerateRequest r = TokenRequest(c["prompt_ids"].get<std::vector<int32_t>>(), max_tokens);
    results.push_back(std::async(std::launch::async, [&cluster, r] { return RunGenerate(cluster.router(), r); }));
  }
  for (int i = 0; i < streams; ++i) {
    StreamResult got = results[size_t(i)].get();
    ASSERT_TRUE(got.status.ok()) << i << ": " << got.status.error_message();
    const std::vector<int32_t> want = ref["cases"][size_t(i) % ref["cases"].size()]["greedy_ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(got.token_ids, std::vector<int32_t>(want.begin(), want.begin() + max_tokens)) << i;
  }
}

TEST(ClusterTest, SixtyFourConcurrentStreamsOnTwoPlusTwoWorkers) {
  LocalCluster cluster({2, 2});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  ASSERT_NO_FATAL_FAILURE(ExpectConcurrentStreamsMatchTheReference(cluster, 64, 24));
  std::string detail;
  EXPECT_TRUE(WaitForIdleKv(cluster, 2, &detail)) << detail;
}

// The value of a counter on a process's /metrics (0 when absent).
double CounterValue(int metrics_port, const std::string& series) {
  const metrics::testing::HttpResponse r =
      metrics::testing::HttpGet(uint16_t(metrics_port), "/metrics", std::chrono::seconds(5));
  std::istringstream lines(r.body);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return 0;
}

// Conditional disaggregation: while the prefill worker has a prompt in hand, the decode worker
// prefills the next ones itself, in its own batch. The outputs are the reference's either way,
// both paths serve, and nothing stays held.
TEST(ClusterTest, ConditionalDisaggregationMatchesTheReference) {
  testing::ClusterOptions options;
  options.router_flags = {"--local-prefill-max-tokens", "4096", "--local-prefill-queue-tokens", "1"};
  options.metrics = true;
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  ASSERT_NO_FATAL_FAILURE(ExpectConcurrentStreamsMatchTheReference(cluster, 24, 32));
  const std::string labels = "{model_name=\"tiny-code-llama\",role=\"router\",worker_role=\"";
  const double on_decode = CounterValue(cluster.router_metrics_port(), "duet:router_prefills_total" + labels + "decode\"}");
  const double on_prefill = CounterValue(cluster.router_metrics_port(), "duet:router_prefills_total" + labels + "prefill\"}");
  EXPECT_EQ(on_decode + on_prefill, 24);
  EXPECT_GT(on_decode, 0);
  EXPECT_GT(on_prefill, 0);
  EXPECT_GT(CounterValue(cluster.decode_metrics_ports()[0],
                         "duet:prompt_tokens_total{model_name=\"tiny-code-llama\",role=\"decode\"}"),
            0);
  std::string detail;
  EXPECT_TRUE(WaitForIdleKv(cluster, 1, &detail)) << detail;
}

TEST(ClusterTest, CancellationAndDeadlinesReturnKvBlocksAndRouterStaysHealthy) {
  LocalCluster cluster({1, 2});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const json ref = Reference();
  std::vector<std::future<StreamResult>> cancelled, expired;
  for (int i = 0; i < 6; ++i) {
    v1::GenerateRequest r = TokenRequest(ref["cases"][size_t(i)]["prompt_ids"].get<std::vector<int32_t>>(), 2000);
    r.mutable_sampling()->set_ignore_eos(true);
    cancelled.push_back(std::async(std::launch::async, [&cluster, r] { return RunGenerate(cluster.router(), r, 5); }));
    expired.push_back(std::async(std::launch::async, [&cluster, r] { return RunGenerate(cluster.router(), r, 0, 700); }));
  }
  for (auto& f : cancelled) {
    StreamResult got = f.get();
    EXPECT_EQ(got.status.error_code(), grpc::StatusCode::CANCELLED) << got.status.error_message();
  }
  for (auto& f : expired) {
    StreamResult got = f.get();
    EXPECT_EQ(got.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << got.status.error_message();
  }
  std::string detail;
  EXPECT_TRUE(WaitForIdleKv(cluster, 2, &detail)) << detail;
  EXPECT_TRUE(RouterServing(cluster));
  StreamResult after = RunGenerate(cluster.router(), TokenRequest(ref["cases"][4]["prompt_ids"].get<std::vector<int32_t>>(), 16));
  ASSERT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(after.token_ids.size(), 16u);
}

// Clients that give up at random times (a cancel, or a short deadline) while their requests reserve
// KV, prefill or have just begun decoding: soon after the last one, every worker has all its KV
// blocks free and no lease left (none waits for its lease to run out).
TEST(ClusterTest, RequestsCancelledAtRandomTimesLeaveNoReservationBehind) {
  LocalCluster cluster({1, 2});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const json ref = Reference();
  constexpr int kThreads = 16, kPerThread = 16;
  std::atomic<int> ok{0}, cancelled{0}, expired{0}, other{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(1000 + t);
      for (int i = 0; i < kPerThread; ++i) {
        const json& c = ref["cases"][size_t(rng() % ref["cases"].size())];
        v1::GenerateRequest r = TokenRequest(c["prompt_ids"].get<std::vector<int32_t>>(), 32);
        r.mutable_sampling()->set_ignore_eos(true);
        const int delay_ms = int(rng() % 40);
        grpc::ClientContext context;
        const bool by_deadline = rng() % 2 == 0;
        if (by_deadline) context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(1 + delay_ms));
        auto reader = cluster.router().Generate(&context, r);
        std::thread canceller;
        if (!by_deadline) {
          canceller = std::thread([&context, delay_ms] {
            std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
            context.TryCancel();
          });
        }
        v1::GenerateResponse message;
        while (reader->Read(&message)) {
        }
        const grpc::Status status = reader->Finish();
        if (canceller.joinable()) canceller.join();
        switch (status.error_code()) {
          case grpc::StatusCode::OK: ++ok; break;
          case grpc::StatusCode::CANCELLED: ++cancelled; break;
          case grpc::StatusCode::DEADLINE_EXCEEDED: ++expired; break;
          default: ++other; ADD_FAILURE() << status.error_message();
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  std::string detail;
  // Well inside the 30 s lease: a reservation left behind would hold its blocks until then. (All
  // is idle within 0.5 s on a 2-core VM; before the router cancelled a Prefill that overlapped its
  // request's later calls, the prefill worker ran its cancelled prompts to the end, 2.5-3.7 s.)
  EXPECT_TRUE(WaitForIdleKv(cluster, 2, &detail, /*timeout_ms=*/10000)) << detail;
  EXPECT_GT(cancelled + expired, kThreads * kPerThread / 2) << ok << " completed";
  EXPECT_EQ(other.load(), 0);
  EXPECT_TRUE(RouterServing(cluster));
}

// The decode worker itself: ReserveKv calls that time out while they wait for the engine (busy
// decoding), each followed by the Abort a router sends when ReserveKv fails. No reservation may
// outlive its call: one made for a call already cancelled is released, and an Abort that
// overtakes its ReserveKv still finds it.
TEST(ClusterTest, DecodeWorkerReleasesReservationsOfCancelledReserveKvCalls) {
  LocalCluster cluster({1, 1});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const json ref = Reference();
  // Keep the engine stepping: 8 long streams, cancelled at the end.
  std::vector<std::unique_ptr<grpc::ClientContext>> stream_contexts;
  std::vector<std::thread> streams;
  for (int i = 0; i < 8; ++i) {
    v1::GenerateRequest r = TokenRequest(ref["cases"][size_t(i)]["prompt_ids"].get<std::vector<int32_t>>(), 3000);
    r.mutable_sampling()->set_ignore_eos(true);
    stream_contexts.push_back(std::make_unique<grpc::ClientContext>());
    streams.emplace_back([&cluster, r, context = stream_contexts.back().get()] {
      auto reader = cluster.router().Generate(context, r);
      v1::GenerateResponse message;
      while (reader->Read(&message)) {
      }
      reader->Finish();
    });
  }
  for (int i = 0; i < 400; ++i) {
    std::vector<v1::WorkerStats> stats = cluster.DecodeStats();
    if (!stats.empty() && stats[0].num_requests_running() == 8) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  auto decode = v1::DecodeWorker::NewStub(
      grpc::CreateChannel(cluster.worker_addresses()[0], grpc::InsecureChannelCredentials()));
  std::mt19937 rng(7);
  int failed = 0;
  for (int i = 0; i < 200; ++i) {
    const std::string id = "direct-" + std::to_string(i);
    v1::ReserveKvRequest request;
    request.set_request_id(id);
    request.set_transfer_id(0x7000000000000000ull + uint64_t(i));
    request.set_num_prompt_tokens(16);
    request.set_lease_ms(30000);
    v1::ReserveKvResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::microseconds(200 + rng() % 3000));
    if (!decode->ReserveKv(&context, request, &response).ok()) ++failed;
    grpc::ClientContext abort_context;
    v1::WorkerAbortRequest abort;
    abort.set_request_id(id);
    abort.set_release_now(true);  // as the router's: no prefill worker was given a target
    v1::WorkerAbortResponse aborted;
    EXPECT_TRUE(decode->Abort(&abort_context, abort, &aborted).ok());
  }
  for (auto& c : stream_contexts) c->TryCancel();
  for (std::thread& t : streams) t.join();
  std::string detail;
  EXPECT_TRUE(WaitForIdleKv(cluster, 1, &detail, /*timeout_ms=*/1000)) << failed << " calls failed\n" << detail;
  EXPECT_GT(failed, 0);
}

// With request migration off (tests/integration/cluster_migration_test.cpp has it on).
TEST(ClusterTest, KilledDecodeWorkerFailsItsStreamsPromptlyAndSurvivorsServe) {
  LocalCluster cluster({1, 2, {}, {"--max-request-migrations", "0"}});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  ASSERT_TRUE(cluster.WaitForAllWorkersUp());  // streams on both decode workers
  const json ref = Reference();
  struct Ended {
    StreamResult result;
    std::chrono::steady_clock::time_point at;
  };
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::future<Ended>> streams;
  for (int i = 0; i < 8; ++i) {
    v1::GenerateRequest r = TokenRequest(ref["cases"][size_t(i)]["prompt_ids"].get<std::vector<int32_t>>(), 3000);
    r.mutable_sampling()->set_ignore_eos(true);
    // Streams on the survivor run until the test cancels them (or, failing that, their deadline).
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    contexts.back()->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    streams.push_back(std::async(std::launch::async, [&cluster, r, ctx = contexts.back().get()] {
      StreamResult result = RunGenerate(cluster.router(), r, *ctx);
      return Ended{result, std::chrono::steady_clock::now()};
    }));
  }
  // Let every stream start decoding on one of the two decode workers (prefill can take seconds on
  // a loaded machine), then kill the first.
  const auto start_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  int on_victim = 0;
  for (;;) {
    const std::vector<v1::WorkerStats> stats = cluster.DecodeStats();
    int running = 0;
    for (const v1::WorkerStats& s : stats) running += s.num_requests_running();
    on_victim = stats.empty() ? 0 : stats[0].num_requests_running();
    if (stats.size() == 2 && running == 8 && on_victim > 0) break;
    if (std::chrono::steady_clock::now() > start_deadline) {
      ADD_FAILURE() << "the streams did not all start decoding: " << running << " running";
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const auto killed_at = std::chrono::steady_clock::now();
  cluster.decode_process(0).Signal(SIGKILL);
  // The victim's streams fail within seconds; the survivor's would decode on, so once that time is
  // up every stream still open is cancelled.
  for (auto& f : streams) f.wait_until(killed_at + std::chrono::seconds(5));
  for (auto& ctx : contexts) ctx->TryCancel();
  int unavailable = 0;
  for (auto& f : streams) {
    Ended ended = f.get();
    if (ended.result.status.error_code() == grpc::StatusCode::UNAVAILABLE) {
      ++unavailable;
      EXPECT_LT(ended.at - killed_at, std::chrono::seconds(5)) << "the client waited too long for the error";
      EXPECT_NE(ended.result.status.error_message().find("decode worker"), std::string::npos)
          << ended.result.status.error_message();
    } else {
      EXPECT_EQ(ended.result.status.error_code(), grpc::StatusCode::CANCELLED) << ended.result.status.error_message();
    }
  }
  // Every stream the killed worker was decoding failed, and only those.
  EXPECT_EQ(unavailable, on_victim);
  EXPECT_LT(on_victim, 8) << "every stream was on the killed worker";
  EXPECT_TRUE(RouterServing(cluster));
  // New requests go to the survivor.
  for (int i = 0; i < 4; ++i) {
    StreamResult after = RunGenerate(cluster.router(), TokenRequest(ref["cases"][4]["prompt_ids"].get<std::vector<int32_t>>(), 8));
    ASSERT_TRUE(after.status.ok()) << after.status.error_message();
    EXPECT_EQ(after.token_ids.size(), 8u);
  }
}

}  // namespace
}  // namespace duet

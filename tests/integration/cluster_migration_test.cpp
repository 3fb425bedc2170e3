// Request migration on a real cluster: a decode worker SIGKILLed while it streams, its requests
// continue on the other decode worker (re-prefilled with their output so far) with no token lost
// or repeated: every stream equals an uninterrupted run of it (greedy ones begin with the
// reference's tokens). When no pair can take them, the clients get UNAVAILABLE saying so. Nothing
// stays reserved on the survivors.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <future>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "metrics/test_http_client.h"
#include "nlohmann/json.hpp"
#include "tests/integration/local_cluster.h"

namespace duet {
namespace {

using nlohmann::json;
using testing::ClusterOptions;
using testing::LocalCluster;

// Two decode workers, so a killed one's streams have a survivor to move to.
ClusterOptions MigrationCluster() {
  ClusterOptions options;
  options.num_prefill = 1;
  options.num_decode = 2;
  options.metrics = true;
  return options;
}

json Reference() {
  std::ifstream in(std::string(DUET_MODELS_DIR) + "/tiny-code-llama/reference_greedy.json");
  return json::parse(in);
}

// Everything a client saw of one stream.
struct Stream {
  grpc::Status status;
  std::vector<int32_t> token_ids;
  std::string text;
  std::string finish_reason;
  std::vector<int32_t> prompt_token_ids;
  int messages_with_prompt = 0;
  int logprobs = 0;
  int32_t prompt_tokens = 0, completion_tokens = 0;  // usage
};

// `received`, when given, follows the count of tokens received while the stream runs, and is
// kStreamEnded once it has ended.
constexpr int kStreamEnded = -1;
Stream RunStream(v1::Duet::Stub& stub, const v1::GenerateRequest& request, std::atomic<int>* received) {
  Stream s;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader = stub.Generate(&ctx, request);
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
    s.token_ids.insert(s.token_ids.end(), msg.token_ids().begin(), msg.token_ids().end());
    if (received != nullptr) received->store(int(s.token_ids.size()));
    s.text += msg.text();
    s.logprobs += msg.logprobs_size();
    if (msg.prompt_token_ids_size() > 0) {
      ++s.messages_with_prompt;
      s.prompt_token_ids.assign(msg.prompt_token_ids().begin(), msg.prompt_token_ids().end());
    }
    if (msg.finished()) {
      s.finish_reason = msg.finish_reason();
      s.prompt_tokens = msg.usage().prompt_tokens();
      s.completion_tokens = msg.usage().completion_tokens();
    }
  }
  s.status = reader->Finish();
  if (received != nullptr) received->store(kStreamEnded);
  return s;
}

// The tokens each stream of StartStreams has received so far.
using Progress = std::vector<std::atomic<int>>;

std::vector<std::future<Stream>> StartStreams(LocalCluster& cluster, const std::vector<v1::GenerateRequest>& requests,
                                              Progress* progress = nullptr) {
  std::vector<std::future<Stream>> streams;
  for (size_t i = 0; i < requests.size(); ++i) {
    std::atomic<int>* received = progress != nullptr ? &(*progress)[i] : nullptr;
    streams.push_back(std::async(std::launch::async, [&cluster, r = requests[i], received] {
      return RunStream(cluster.router(), r, received);
    }));
  }
  return streams;
}

std::vector<Stream> Collect(std::vector<std::future<Stream>>& streams) {
  std::vector<Stream> done;
  for (auto& f : streams) done.push_back(f.get());
  return done;
}

// The decode worker to kill, and how many streams it was decoding when chosen.
struct Victim {
  int index = -1;
  int running = 0;
};

// Waits until a decode worker holds two or more unfinished streams, one or more of them decoding,
// and returns it (killed at once, they move), or index -1. With `total`, also until all `total`
// streams are on the decode workers (none still prefilling). With `progress`, also until no stream
// still open has received more than `max_received` tokens, so that none of the victim's decoding
// streams can finish between this look and the kill: each of them migrates; and until one has
// received `min_received` or more (a re-prefill then carries that much output). (A stream only
// reserved there, its KV not yet sent, is placed again rather than migrated.)
Victim WaitForTwoStreamsOnADecodeWorker(LocalCluster& cluster, int total = 0, const Progress* progress = nullptr,
                                        int max_received = 0, int min_received = 0) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  const auto ages_fit = [&] {
    return progress == nullptr ||
           (std::all_of(progress->begin(), progress->end(), [&](const std::atomic<int>& n) { return n <= max_received; }) &&
            std::any_of(progress->begin(), progress->end(), [&](const std::atomic<int>& n) { return n >= min_received; }));
  };
  while (std::chrono::steady_clock::now() < deadline) {
    const std::vector<v1::WorkerStats> stats = cluster.DecodeStats();
    if (stats.size() == 2) {
      const int on_zero = stats[0].num_requests_running() + stats[0].num_requests_waiting();
      const int on_one = stats[1].num_requests_running() + stats[1].num_requests_waiting();
      const int index = on_zero >= on_one ? 0 : 1;
      const int running = stats[size_t(index)].num_requests_running();
      if ((total == 0 || on_zero + on_one == total) && std::max(on_zero, on_one) >= 2 && running >= 1 && ages_fit()) {
        return Victim{index, running};
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return Victim{};
}

// The router's duet:request_migrations_total for `outcome`.
double Migrations(LocalCluster& cluster, const std::string& outcome) {
  const metrics::testing::HttpResponse r =
      metrics::testing::HttpGet(uint16_t(cluster.router_metrics_port()), "/metrics", std::chrono::seconds(5));
  const std::string prefix = "duet:request_migrations_total{model_name=\"tiny-code-llama\",role=\"router\",outcome=\"" +
                             outcome + "\"} ";
  std::istringstream lines(r.body);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(prefix, 0) == 0) return std::stod(line.substr(prefix.size()));
  }
  return -1;
}

// Waits until every worker still answering holds no KV block, lease or request.
bool SurvivorsIdle(LocalCluster& cluster, size_t decode_workers, size_t prefill_workers, std::string* detail,
                   std::chrono::seconds wait = std::chrono::seconds(10)) {
  const auto deadline = std::chrono::steady_clock::now() + wait;
  for (;;) {
    std::vector<v1::WorkerStats> all = cluster.DecodeStats();
    bool idle = all.size() == decode_workers;
    const std::vector<v1::WorkerStats> prefill = cluster.PrefillStats();
    idle = idle && prefill.size() == prefill_workers;
    all.insert(all.end(), prefill.begin(), prefill.end());
    *detail = "";
    for (const v1::WorkerStats& s : all) {
      *detail += s.ShortDebugString() + "\n";
      idle = idle && s.num_free_kv_blocks() == s.num_kv_blocks() && s.num_kv_leases() == 0 &&
             s.num_requests_running() == 0 && s.num_requests_waiting() == 0;
    }
    if (idle) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// Four reference cases whose greedy continuations have top-2 logit margins of at least 0.09 over
// all 128 reference tokens.
std::vector<size_t> WideMarginCases() { return {0, 4, 6, 7}; }
constexpr int kReferenceTokens = 128;
// Streams run past the reference: the CPU backend's logits are the same bits whatever the steps
// that computed a sequence's KV (LlamaCpuTest), so a stream re-prefilled with its output on a
// survivor continues exactly as an uninterrupted run of it, which is what a migrated stream is
// compared with.
constexpr int kTokens = 512;
// A decode worker is killed while every open stream has at most this many tokens, so that the
// victim's streams cannot end between that look and the kill, however far the worker runs ahead of
// what the client has received. The streams are long so that two of them overlap on one decode
// worker while young even when a prefill step takes as long as a hundred decode steps (a slow or
// busy machine: the prefill worker delivers the four prompts in two steps, the first two streams
// decoding meanwhile).
constexpr int kYoungTokens = kTokens / 2;
// ... and once one has this many: a re-prefill carries some output, not just the prompt.
constexpr int kMinReceivedTokens = 32;
// The victim's streams that moved: at least one. Every one it was decoding when chosen is the
// intent, but one can still end there between that look and the kill on a machine that stalls the
// test; the streams' tokens are what must hold whatever moved.
constexpr double kMinMigrated = 1;

std::vector<v1::GenerateRequest> GreedyRequests(const json& ref, int max_tokens = kTokens) {
  std::vector<v1::GenerateRequest> requests;
  for (size_t i : WideMarginCases()) {
    v1::GenerateRequest r;
    for (int32_t id : ref["cases"][i]["prompt_ids"].get<std::vector<int32_t>>()) r.mutable_token_ids()->add_ids(id);
    r.mutable_sampling()->set_temperature(0.0f);
    r.mutable_sampling()->set_max_tokens(max_tokens);
    r.mutable_sampling()->set_ignore_eos(true);
    requests.push_back(r);
  }
  return requests;
}

// The streams of `requests` when a decode worker holding two or more of them is SIGKILLed while
// they are young. The cluster has run them once before (the prefill worker is warm).
std::vector<Stream> RunKillingADecodeWorker(LocalCluster& cluster, const std::vector<v1::GenerateRequest>& requests,
                                            Victim* victim) {
  Progress progress(requests.size());
  std::vector<std::future<Stream>> streams = StartStreams(cluster, requests, &progress);
  *victim = WaitForTwoStreamsOnADecodeWorker(cluster, 0, &progress, kYoungTokens, kMinReceivedTokens);
  if (victim->index >= 0) cluster.decode_process(victim->index).Signal(SIGKILL);
  return Collect(streams);
}

// Each migrated stream is what the client saw of the uninterrupted run, and the router counted
// the migrations.
void ExpectSameStreams(LocalCluster& cluster, const std::vector<Stream>& uninterrupted,
                       const std::vector<Stream>& migrated, const Victim& victim) {
  ASSERT_EQ(migrated.size(), uninterrupted.size());
  for (size_t i = 0; i < migrated.size(); ++i) {
    const Stream& want = uninterrupted[i];
    const Stream& got = migrated[i];
    ASSERT_TRUE(want.status.ok()) << i << ": " << want.status.error_message();
    ASSERT_TRUE(got.status.ok()) << i << ": " << got.status.error_message();
    EXPECT_EQ(got.token_ids, want.token_ids) << i;
    EXPECT_EQ(got.text, want.text) << i;
    EXPECT_EQ(got.finish_reason, want.finish_reason) << i;
    EXPECT_EQ(got.logprobs, want.logprobs) << i;
    EXPECT_EQ(got.messages_with_prompt, 1) << i;
    EXPECT_EQ(got.prompt_token_ids, want.prompt_token_ids) << i;
    EXPECT_EQ(got.prompt_tokens, want.prompt_tokens) << i;
    EXPECT_EQ(got.completion_tokens, int32_t(want.token_ids.size())) << i;
  }
  EXPECT_GE(Migrations(cluster, "success"), kMinMigrated) << "the victim was decoding " << victim.running;
  EXPECT_EQ(Migrations(cluster, "failure"), 0);
  std::string detail;
  EXPECT_TRUE(SurvivorsIdle(cluster, 1, 1, &detail)) << detail;
}

TEST(ClusterMigrationTest, GreedyStreamsOfAKilledDecodeWorkerEqualTheReference) {
  LocalCluster cluster(MigrationCluster());
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const json ref = Reference();
  const std::vector<v1::GenerateRequest> requests = GreedyRequests(ref);
  std::vector<std::future<Stream>> first = StartStreams(cluster, requests);
  const std::vector<Stream> uninterrupted = Collect(first);
  ASSERT_EQ(Migrations(cluster, "success"), 0);
  for (size_t k = 0; k < uninterrupted.size(); ++k) {
    const json& c = ref["cases"][WideMarginCases()[k]];
    const Stream& s = uninterrupted[k];
    ASSERT_TRUE(s.status.ok()) << "case " << WideMarginCases()[k] << ": " << s.status.error_message();
    const std::vector<int32_t> greedy = c["greedy_ids"].get<std::vector<int32_t>>();
    ASSERT_GE(greedy.size(), size_t(kReferenceTokens));
    ASSERT_EQ(s.token_ids.size(), size_t(kTokens));
    EXPECT_EQ(std::vector<int32_t>(s.token_ids.begin(), s.token_ids.begin() + kReferenceTokens),
              std::vector<int32_t>(greedy.begin(), greedy.begin() + kReferenceTokens))
        << "case " << WideMarginCases()[k];
    EXPECT_EQ(s.finish_reason, "length");
    EXPECT_EQ(s.prompt_token_ids, c["prompt_ids"].get<std::vector<int32_t>>());
    EXPECT_EQ(s.prompt_tokens, int32_t(c["prompt_ids"].size()));
  }
  Victim victim;
  const std::vector<Stream> migrated = RunKillingADecodeWorker(cluster, requests, &victim);
  ASSERT_GE(victim.index, 0);
  ExpectSameStreams(cluster, uninterrupted, migrated, victim);
}

std::vector<v1::GenerateRequest> SampledRequests() {
  const std::vector<std::string> prompts = {"def merge_sort(items):\n", "class Stack:\n    def __init__(self):\n",
                                            "import json\n\n\ndef load(path):\n", "for i in range(10):\n"};
  std::vector<v1::GenerateRequest> requests;
  for (int i = 0; i < 4; ++i) {
    v1::GenerateRequest r;
    r.set_text(prompts[size_t(i) % prompts.size()]);
    v1::SamplingOptions* s = r.mutable_sampling();
    s->set_max_tokens(kTokens);
    s->set_ignore_eos(true);
    s->set_temperature(0.8f);
    s->set_top_p(0.95f);
    s->set_top_k(i % 2 == 0 ? 0 : 40);
    s->set_seed(300 + uint64_t(i));
    if (i == 1) s->set_frequency_penalty(0.5f);
    if (i == 2) s->set_logprobs(2);
    if (i == 3) s->add_stop("return None");  // may stop, or never match
    requests.push_back(r);
  }
  return requests;
}

TEST(ClusterMigrationTest, SeededStreamsOfAKilledDecodeWorkerEqualTheUninterruptedRun) {
  LocalCluster cluster(MigrationCluster());
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::vector<v1::GenerateRequest> requests = SampledRequests();
  std::vector<std::future<Stream>> first = StartStreams(cluster, requests);
  const std::vector<Stream> uninterrupted = Collect(first);
  ASSERT_EQ(Migrations(cluster, "success"), 0);
  Victim victim;
  const std::vector<Stream> migrated = RunKillingADecodeWorker(cluster, requests, &victim);
  ASSERT_GE(victim.index, 0);
  ExpectSameStreams(cluster, uninterrupted, migrated, victim);
}

// The prefill worker dies first: the streams of the decode worker killed next find no pair to
// continue on and get UNAVAILABLE saying so, the other decode worker's streams finish, and the
// re-prefills' reservations are released there.
TEST(ClusterMigrationTest, WithNoPrefillWorkerLeftMigrationFailsClearly) {
  LocalCluster cluster(MigrationCluster());
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const json ref = Reference();
  // Long streams: every one is on a decode worker before the first ends, however slow the
  // prefill, and the victim is chosen while each has hundreds of tokens to go (only the failures'
  // messages are checked, not the tokens). The two kills follow each other at once: a killed
  // process can take seconds to be reaped on a loaded machine, long enough for the streams to end,
  // and a prefill worker that has been sent SIGKILL serves nothing more.
  constexpr int kLongTokens = 600;
  const std::vector<v1::GenerateRequest> requests = GreedyRequests(ref, kLongTokens);
  Progress progress(requests.size());
  std::vector<std::future<Stream>> streams = StartStreams(cluster, requests, &progress);
  const int victim = WaitForTwoStreamsOnADecodeWorker(cluster, int(requests.size()), &progress, kLongTokens / 2).index;
  ASSERT_GE(victim, 0);
  cluster.prefill_process(0).Signal(SIGKILL);
  cluster.decode_process(victim).Signal(SIGKILL);
  ASSERT_NE(cluster.prefill_process(0).Wait(std::chrono::seconds(10)), Subprocess::kStillRunning);
  int failed = 0;
  for (Stream& s : Collect(streams)) {
    if (s.status.ok()) {
      EXPECT_EQ(s.token_ids.size(), size_t(kLongTokens));
      continue;
    }
    ++failed;
    EXPECT_EQ(s.status.error_code(), grpc::StatusCode::UNAVAILABLE) << s.status.error_message();
    const std::string failed_worker = "decode worker " + std::to_string(victim) + " failed; ";
    EXPECT_EQ(s.status.error_message().rfind(failed_worker + "the request could not be migrated: ", 0), 0u)
        << s.status.error_message();
    EXPECT_NE(s.status.error_message().find("prefill worker"), std::string::npos) << s.status.error_message();
  }
  EXPECT_GE(failed, 2);
  EXPECT_LT(failed, int(requests.size()));
  EXPECT_EQ(Migrations(cluster, "failure"), failed);
  std::string detail;
  // A re-prefill's reservation whose Prefill reached the prefill worker before the kill goes at
  // once when the router's probe finds the worker gone; a worker still dying when probed (no
  // answer, the port not yet closed) may be a stalled one, and its reservation waits for the KV
  // lease (the router's default, 30 s).
  EXPECT_TRUE(SurvivorsIdle(cluster, 1, 0, &detail, std::chrono::seconds(40))) << detail;
}

}  // namespace
}  // namespace duet

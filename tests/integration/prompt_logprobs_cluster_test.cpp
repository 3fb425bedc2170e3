// Prompt logprobs through a real local cluster (router, prefill and decode worker processes on
// loopback, the bundled model): gRPC's GenerateResponse.prompt_logprobs, HTTP's vLLM-style
// `prompt_logprobs` and `echo` + `logprobs` equal what `duet generate` writes offline for the same
// requests. The workers cut prompts into 24-token chunks (chunked prefill) and cache prefixes:
// each prompt runs once without prompt logprobs first, so its blocks are cached on both workers
// (the decode worker then takes only the uncached part of the KV) and must be computed again.
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "metrics/test_http_client.h"
#include "nlohmann/json.hpp"
#include "tests/integration/local_cluster.h"
#include "tests/integration/process.h"

namespace duet {
namespace {

using nlohmann::json;
using testing::LocalCluster;

constexpr int kTopK = 3;
constexpr int kMaxTokens = 8;
const std::vector<std::string> kPrompts = {
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    middle = len(items) // 2\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import json\n",
};

json HttpPost(int port, const std::string& path, const json& body) {
  const metrics::testing::HttpResponse r =
      metrics::testing::HttpPost(uint16_t(port), path, body.dump(), std::chrono::seconds(120));
  EXPECT_EQ(r.status, 200) << path << ": " << r.body;
  return r.status == 200 ? json::parse(r.body) : json();
}

// Everything one greedy gRPC Generate returned.
struct GrpcResult {
  grpc::Status status;
  std::vector<int32_t> prompt_token_ids, token_ids;
  std::vector<v1::TokenLogprobs> prompt_logprobs;
  int messages_with_prompt_logprobs = 0;
};

GrpcResult GrpcGenerate(v1::Duet::Stub& stub, const std::string& prompt, int prompt_logprobs) {
  v1::GenerateRequest request;
  request.set_text(prompt);
  request.mutable_sampling()->set_temperature(0);
  request.mutable_sampling()->set_max_tokens(kMaxTokens);
  request.mutable_sampling()->set_ignore_eos(true);
  if (prompt_logprobs >= 0) request.mutable_sampling()->set_prompt_logprobs(prompt_logprobs);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
  GrpcResult result;
  auto reader = stub.Generate(&context, request);
  v1::GenerateResponse m;
  while (reader->Read(&m)) {
    result.token_ids.insert(result.token_ids.end(), m.token_ids().begin(), m.token_ids().end());
    if (m.prompt_token_ids_size() > 0) {
      result.prompt_token_ids.assign(m.prompt_token_ids().begin(), m.prompt_token_ids().end());
    }
    if (m.prompt_logprobs_size() > 0) {
      ++result.messages_with_prompt_logprobs;
      result.prompt_logprobs.assign(m.prompt_logprobs().begin(), m.prompt_logprobs().end());
    }
  }
  result.status = reader->Finish();
  return result;
}

// An offline prompt_logprobs position against a served one, both in vLLM's shape
// {"<id>": {logprob, rank, decoded_token}}: the same ids, ranks and tokens, logprobs within
// float32 noise (the offline run computes the prompt in other chunks).
void ExpectSamePosition(const json& got, const json& want, const std::string& what) {
  ASSERT_TRUE(want.is_object()) << what;
  ASSERT_TRUE(got.is_object()) << what << ": " << got.dump();
  ASSERT_EQ(got.size(), want.size()) << what << ": " << got.dump() << " vs " << want.dump();
  for (const auto& [id, entry] : want.items()) {
    ASSERT_TRUE(got.contains(id)) << what << ": token " << id;
    EXPECT_NEAR(got[id]["logprob"].get<double>(), entry["logprob"].get<double>(), 1e-4) << what << " token " << id;
    EXPECT_EQ(got[id]["rank"], entry["rank"]) << what << " token " << id;
    EXPECT_EQ(got[id]["decoded_token"], entry["decoded_token"]) << what << " token " << id;
  }
}

// A gRPC TokenLogprobs of prompt token `id` in vLLM's shape (without decoded_token, which gRPC
// does not carry: it is taken from `want`).
json GrpcPosition(const v1::TokenLogprobs& lp, int32_t id, const json& want) {
  json out = json::object();
  auto add = [&](int32_t token, float logprob, int rank) {
    const std::string key = std::to_string(token);
    out[key] = {{"logprob", logprob}, {"rank", rank},
                {"decoded_token", want.contains(key) ? want[key]["decoded_token"] : json(nullptr)}};
  };
  add(id, lp.logprob(), lp.rank());
  for (int t = 0; t < lp.top_size(); ++t) {
    if (lp.top(t).token_id() != id) add(lp.top(t).token_id(), lp.top(t).logprob(), t + 1);
  }
  return out;
}

class PromptLogprobsClusterTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // Offline first: duet generate with the same requests.
    const std::string dir = testing::MakeTempDir("prompt-logprobs");
    std::vector<json> rows;
    for (size_t i = 0; i < kPrompts.size(); ++i) {
      rows.push_back({{"id", std::to_string(i)}, {"prompt", kPrompts[i]}, {"max_tokens", kMaxTokens},
                      {"temperature", 0}, {"ignore_eos", true}, {"prompt_logprobs", kTopK}});
    }
    testing::WriteJsonlFile(dir + "/in.jsonl", rows);
    generate_exit_ = testing::RunCommand(testing::DuetBinary() + " generate --backend cpu --model " DUET_MODELS_DIR
                                         "/tiny-code-llama --input " + dir + "/in.jsonl --output " + dir +
                                         "/out.jsonl", dir + "/log.txt");
    if (generate_exit_ == 0) offline_ = new std::vector<json>(testing::ReadJsonlFile(dir + "/out.jsonl"));
    testing::ClusterOptions options{1, 1, {"--max-num-batched-tokens", "24"}};
    options.http = true;
    cluster_ = new LocalCluster(options);
  }
  static void TearDownTestSuite() {
    delete cluster_;
    delete offline_;
  }
  void SetUp() override {
    ASSERT_EQ(generate_exit_, 0) << "duet generate failed";
    ASSERT_NE(offline_, nullptr);
    ASSERT_EQ(offline_->size(), kPrompts.size());
    ASSERT_TRUE(cluster_->ok()) << cluster_->error();
  }

  static int generate_exit_;
  static std::vector<json>* offline_;
  static LocalCluster* cluster_;
};
int PromptLogprobsClusterTest::generate_exit_ = -1;
std::vector<json>* PromptLogprobsClusterTest::offline_ = nullptr;
LocalCluster* PromptLogprobsClusterTest::cluster_ = nullptr;

TEST_F(PromptLogprobsClusterTest, GrpcAndHttpEqualDuetGenerate) {
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    const json& want = (*offline_)[i];
    const std::vector<int32_t> prompt = want["prompt_token_ids"].get<std::vector<int32_t>>();
    const json& want_lp = want["prompt_logprobs"];
    ASSERT_EQ(want_lp.size(), prompt.size()) << i;
    ASSERT_TRUE(want_lp[0].is_null());

    // Cache the prompt's blocks on both workers (the second run finds them); the next requests
    // must not take them on the prefill worker, where logits are made.
    for (int run = 0; run < 2; ++run) {
      GrpcResult warm = GrpcGenerate(cluster_->router(), kPrompts[i], -1);
      ASSERT_TRUE(warm.status.ok()) << warm.status.error_message();
      EXPECT_TRUE(warm.prompt_logprobs.empty());
    }
    const int64_t prefill_hits = cluster_->PrefillStats().at(0).prefix_cache_hits();
    const int64_t decode_hits = cluster_->DecodeStats().at(0).prefix_cache_hits();

    GrpcResult got = GrpcGenerate(cluster_->router(), kPrompts[i], kTopK);
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    EXPECT_EQ(got.prompt_token_ids, prompt) << i;
    EXPECT_EQ(got.token_ids, want["token_ids"].get<std::vector<int32_t>>()) << i;
    EXPECT_EQ(got.messages_with_prompt_logprobs, 1) << i;
    ASSERT_EQ(got.prompt_logprobs.size(), prompt.size() - 1) << i;
    for (size_t p = 1; p < prompt.size(); ++p) {
      ExpectSamePosition(GrpcPosition(got.prompt_logprobs[p - 1], prompt[p], want_lp[p]), want_lp[p],
                         absl::StrCat("gRPC prompt ", i, " position ", p));
    }

    const json http = HttpPost(cluster_->http_port(), "/v1/completions",
                               {{"prompt", kPrompts[i]}, {"max_tokens", kMaxTokens}, {"temperature", 0},
                                {"ignore_eos", true}, {"prompt_logprobs", kTopK}});
    ASSERT_TRUE(http.contains("choices")) << http.dump();
    const json& served = http["choices"][0]["prompt_logprobs"];
    ASSERT_EQ(served.size(), prompt.size()) << i;
    EXPECT_TRUE(served[0].is_null());
    for (size_t p = 1; p < prompt.size(); ++p) {
      ExpectSamePosition(served[p], want_lp[p], absl::StrCat("HTTP prompt ", i, " position ", p));
    }
    EXPECT_EQ(http["choices"][0]["text"], want["text"]) << i;

    // echo + logprobs: the prompt's tokens lead, scored as offline (the top-K stands in logprobs).
    const json echo = HttpPost(cluster_->http_port(), "/v1/completions",
                               {{"prompt", kPrompts[i]}, {"max_tokens", kMaxTokens}, {"temperature", 0},
                                {"ignore_eos", true}, {"echo", true}, {"logprobs", kTopK}});
    ASSERT_TRUE(echo.contains("choices")) << echo.dump();
    const json& l = echo["choices"][0]["logprobs"];
    EXPECT_EQ(echo["choices"][0]["text"], kPrompts[i] + want["text"].get<std::string>()) << i;
    ASSERT_EQ(l["tokens"].size(), prompt.size() + size_t(kMaxTokens)) << i;
    EXPECT_TRUE(l["token_logprobs"][0].is_null());
    for (size_t p = 1; p < prompt.size(); ++p) {
      const std::string id = std::to_string(prompt[p]);
      EXPECT_NEAR(l["token_logprobs"][p].get<double>(), want_lp[p][id]["logprob"].get<double>(), 1e-4)
          << "echo prompt " << i << " position " << p;
      EXPECT_EQ(l["top_logprobs"][p].size(), size_t(kTopK)) << i;
    }
    for (size_t t = 0; t < size_t(kMaxTokens); ++t) {
      EXPECT_FALSE(l["token_logprobs"][prompt.size() + t].is_null()) << i;
    }
    // Prompts of more than a block: the prefill worker had them cached but computed them whole
    // three times, while the decode worker took its cached blocks (only the rest of the KV moved).
    if (prompt.size() > 16) {
      EXPECT_GT(prefill_hits, 0) << i;
      EXPECT_EQ(cluster_->PrefillStats().at(0).prefix_cache_hits(), prefill_hits) << i;
      EXPECT_GT(cluster_->DecodeStats().at(0).prefix_cache_hits(), decode_hits) << i;
    }
  }
  // Bad values are refused naming the field, and the cluster serves on.
  v1::GenerateRequest bad;
  bad.set_text("x");
  bad.mutable_sampling()->set_prompt_logprobs(21);
  grpc::ClientContext context;
  v1::GenerateResponse m;
  auto reader = cluster_->router().Generate(&context, bad);
  while (reader->Read(&m)) {
  }
  const grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("prompt_logprobs"), std::string::npos) << status.error_message();
  GrpcResult after = GrpcGenerate(cluster_->router(), kPrompts[2], 0);
  ASSERT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(after.prompt_logprobs.size(), after.prompt_token_ids.size() - 1);
}

}  // namespace
}  // namespace duet

// Grammar-constrained sampling through the engine with the bundled model: every output of the
// structured-output test set (tests/structured_outputs/cases.json), sampled at temperature 0.9
// with several seeds in one continuous batch, parses and validates.
#include <cstdio>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include "backends/executor_factory.h"
#include "engine/llm_engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/structured_outputs/schema_validator.h"

namespace duet {
namespace {

using json = nlohmann::json;
using grammar::StructuredOutput;

constexpr char kModel[] = DUET_MODELS_DIR "/tiny-code-llama";
constexpr char kDraftModel[] = DUET_MODELS_DIR "/tiny-code-llama-draft";
constexpr int kSeeds = 8;

json Cases() {
  std::ifstream in(std::string(DUET_SOURCE_DIR) + "/tests/structured_outputs/cases.json");
  std::stringstream ss;
  ss << in.rdbuf();
  return json::parse(ss.str());
}

std::unique_ptr<LlmEngine> NewEngine() {
  EngineConfig config;
  config.model_dir = kModel;
  config.num_kv_blocks = 1024;
  config.scheduler.max_num_seqs = 64;
  absl::StatusOr<std::unique_ptr<LlmEngine>> e = CreateEngine(config);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

// One constrained request of the test set, and how its output is checked.
struct Case {
  std::string name;
  StructuredOutput constraint;
  json schema;                        // json_schema cases (null: any object)
  std::string pattern;                // regex and grammar cases: the whole output matches
  std::vector<std::string> choices;  // choice cases
  json sampling;                      // the case's prompt and sampling, where it has its own
};

std::vector<Case> AllCases() {
  const json cases = Cases();
  std::vector<Case> out;
  for (const json& c : cases["json_schema"]) {
    Case k{c["name"], {}, nullptr, "", {}, c};
    if (c.contains("json_object")) {
      k.constraint.kind = StructuredOutput::Kind::kJsonObject;
      k.schema = json{{"type", "object"}};
    } else {
      k.constraint = {StructuredOutput::Kind::kJsonSchema, c["schema"].dump(), {}};
      k.schema = c["schema"];
    }
    out.push_back(k);
  }
  for (const json& c : cases["regex"]) {
    out.push_back({c["name"], {StructuredOutput::Kind::kRegex, c["pattern"], {}}, nullptr, c["pattern"], {}, c});
  }
  for (const json& c : cases["choice"]) {
    std::vector<std::string> choices = c["choices"];
    out.push_back({c["name"], {StructuredOutput::Kind::kChoice, "", choices}, nullptr, "", choices, c});
  }
  for (const json& c : cases["grammar"]) {
    out.push_back({c["name"], {StructuredOutput::Kind::kGrammar, c["grammar"], {}}, nullptr, c["pattern"], {}, c});
  }
  return out;
}

// "" when `text` satisfies the case, else why not.
std::string Check(const Case& c, const std::string& text) {
  if (!c.choices.empty()) {
    return std::find(c.choices.begin(), c.choices.end(), text) != c.choices.end() ? "" : "not one of the choices";
  }
  if (!c.pattern.empty()) return std::regex_match(text, std::regex(c.pattern)) ? "" : "does not match the pattern";
  const json value = json::parse(text, nullptr, false);
  if (value.is_discarded()) return "not JSON";
  return testing::ValidateJson(value, c.schema, c.schema);
}

// Python that writes short literals, so that free strings end well within max_tokens (the tiny
// model, trained on Python, can run a string on for ever: the grammar cannot end it for it).
std::vector<int32_t> PromptFor(const LlmEngine& e, const Case& c, int seed) {
  if (c.sampling.contains("prompt")) return e.tokenizer().Encode(c.sampling["prompt"].get<std::string>());
  const char* prompts[] = {"config = {\"name\": \"x\", \"size\": 3}\n", "x = [1, 2, 3]\ny = \"a\"\n",
                           "DEFAULTS = {\"debug\": False, \"level\": 2}\n"};
  return e.tokenizer().Encode(std::string(prompts[seed % 3]) + "# " + c.name + "\nvalue = ");
}

TEST(StructuredOutputTest, EveryConstrainedOutputParsesAndValidates) {
  std::unique_ptr<LlmEngine> e = NewEngine();
  const std::vector<Case> cases = AllCases();
  ASSERT_GE(cases.size(), 14u);
  for (size_t i = 0; i < cases.size(); ++i) {
    for (int seed = 0; seed < kSeeds; ++seed) {
      SamplingParams p;
      p.temperature = cases[i].sampling.value("temperature", 0.9f);
      p.top_p = cases[i].sampling.value("top_p", 1.0f);
      p.repetition_penalty = cases[i].sampling.value("repetition_penalty", 1.0f);
      p.seed = uint64_t(1000 + seed);
      p.max_tokens = 384;
      p.structured_output = cases[i].constraint;
      const std::string id = cases[i].name + "/" + std::to_string(seed);
      ASSERT_TRUE(e->AddRequest(id, PromptFor(*e, cases[i], seed), p).ok()) << id;
    }
  }
  std::map<std::string, std::string> streamed;
  while (e->HasUnfinished()) {
    absl::StatusOr<std::vector<RequestOutput>> outs = e->Step();
    ASSERT_TRUE(outs.ok()) << outs.status();
    for (const RequestOutput& o : *outs) streamed[o.id] += o.new_text;
  }
  int valid = 0, total = 0;
  for (const Case& c : cases) {
    for (int seed = 0; seed < kSeeds; ++seed) {
      const std::string id = c.name + "/" + std::to_string(seed);
      const Request* r = e->Find(id);
      ASSERT_NE(r, nullptr);
      ++total;
      EXPECT_EQ(r->finish_reason, FinishReason::kStop) << id << ": " << r->text;
      EXPECT_EQ(streamed[id], r->text) << id;
      const std::string why = Check(c, r->text);
      EXPECT_EQ(why, "") << id << ": " << r->text;
      valid += why.empty();
    }
  }
  EXPECT_EQ(valid, total);
  // Different seeds explore: not every case gave the same text for every seed.
  int varied = 0;
  for (const Case& c : cases) varied += e->Find(c.name + "/0")->text != e->Find(c.name + "/1")->text;
  EXPECT_GT(varied, int(cases.size()) / 2);
}

// ---- Structured outputs with speculation ----------------------------------------------------

// Every mode drafts every step (no adaptive budget), so verification runs on every case.
std::unique_ptr<LlmEngine> NewSpeculatingEngine() {
  EngineConfig config;
  config.model_dir = kModel;
  config.num_kv_blocks = 1024;
  config.scheduler.max_num_seqs = 64;
  config.speculation.draft_model_dir = kDraftModel;
  config.speculation.self_spec_layers = 2;
  config.speculation.max_draft_tokens = 5;
  config.speculation.adaptive = false;
  absl::StatusOr<std::unique_ptr<LlmEngine>> e = CreateEngine(config);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

struct CaseRun {
  std::vector<int32_t> output;
  std::string text;
  FinishReason finish_reason = FinishReason::kNone;
};

// Runs every case of the test set once in `mode` on a fresh engine, greedy or seeded at
// temperature 0.9, and returns the outputs by case name and the engine's speculation counters.
std::map<std::string, CaseRun> RunCases(SpeculationMode mode, bool greedy, SpecDecodeStats* stats) {
  std::unique_ptr<LlmEngine> e = NewSpeculatingEngine();
  const std::vector<Case> cases = AllCases();
  for (size_t i = 0; i < cases.size(); ++i) {
    SamplingParams p;
    p.temperature = greedy ? 0.0f : cases[i].sampling.value("temperature", 0.9f);
    p.top_p = cases[i].sampling.value("top_p", 1.0f);
    p.repetition_penalty = cases[i].sampling.value("repetition_penalty", 1.0f);
    p.seed = 77 + uint64_t(i);
    p.max_tokens = 384;
    p.structured_output = cases[i].constraint;
    p.speculation = mode;
    EXPECT_TRUE(e->AddRequest(cases[i].name, PromptFor(*e, cases[i], int(i)), p).ok()) << cases[i].name;
  }
  while (e->HasUnfinished()) EXPECT_TRUE(e->Step().ok());
  std::map<std::string, CaseRun> runs;
  for (const Case& c : cases) {
    const Request* r = e->Find(c.name);
    runs[c.name] = {r->output, r->text, r->finish_reason};
  }
  if (stats != nullptr) *stats = e->Stats().spec_decode;
  return runs;
}

// Drafts are cut to the grammar and every node is drawn under its grammar state's mask, so each
// mode gives exactly the constrained output without speculation, greedy or seeded (each drawn
// token takes one number of the request's stream, as without drafts), and drafts are accepted.
void ExpectConstrainedSpeculationLossless(bool greedy) {
  const std::map<std::string, CaseRun> plain = RunCases(SpeculationMode::kNone, greedy, nullptr);
  for (SpeculationMode mode : {SpeculationMode::kLookahead, SpeculationMode::kDraft, SpeculationMode::kSelf}) {
    SpecDecodeStats stats;
    const std::map<std::string, CaseRun> spec = RunCases(mode, greedy, &stats);
    for (const Case& c : AllCases()) {
      const CaseRun& want = plain.at(c.name);
      const CaseRun& got = spec.at(c.name);
      EXPECT_EQ(got.output, want.output) << c.name << " " << SpeculationModeName(mode);
      EXPECT_EQ(got.text, want.text) << c.name << " " << SpeculationModeName(mode);
      EXPECT_EQ(got.finish_reason, FinishReason::kStop) << c.name << " " << SpeculationModeName(mode) << ": " << got.text;
      EXPECT_EQ(Check(c, got.text), "") << c.name << " " << SpeculationModeName(mode) << ": " << got.text;
    }
    EXPECT_GT(stats.num_drafts, 0) << SpeculationModeName(mode);
    EXPECT_GT(stats.num_accepted_tokens, 0) << SpeculationModeName(mode);
    std::printf("%s %s: %lld drafts, %lld draft tokens verified, %lld accepted (%.2f per draft)\n",
                greedy ? "greedy" : "seeded", SpeculationModeName(mode), static_cast<long long>(stats.num_drafts),
                static_cast<long long>(stats.num_draft_tokens), static_cast<long long>(stats.num_accepted_tokens),
                double(stats.num_accepted_tokens) / double(stats.num_drafts));
  }
}

TEST(StructuredOutputTest, GreedyConstrainedOutputIsUnchangedBySpeculation) {
  ExpectConstrainedSpeculationLossless(true);
}

TEST(StructuredOutputTest, SeededConstrainedSamplingIsUnchangedBySpeculation) {
  ExpectConstrainedSpeculationLossless(false);
}

TEST(StructuredOutputTest, GreedyConstrainedOutputIsDeterministic) {
  std::string first;
  for (int run = 0; run < 2; ++run) {
    std::unique_ptr<LlmEngine> e = NewEngine();
    SamplingParams p;
    p.temperature = 0.0f;
    p.max_tokens = 128;
    p.structured_output = {StructuredOutput::Kind::kJsonObject, "", {}};
    ASSERT_TRUE(e->AddRequest("r", e->tokenizer().Encode("config = "), p).ok());
    while (e->HasUnfinished()) ASSERT_TRUE(e->Step().ok());
    if (run == 0) first = e->Find("r")->text;
    EXPECT_EQ(e->Find("r")->text, first);
  }
  EXPECT_TRUE(first.starts_with("{")) << first;
}

TEST(StructuredOutputTest, BadConstraintsAreInvalidArgument) {
  std::unique_ptr<LlmEngine> e = NewEngine();
  const std::vector<int32_t> prompt = e->tokenizer().Encode("x = ");
  const std::vector<StructuredOutput> bad = {
      {StructuredOutput::Kind::kJsonSchema, "{not json", {}},
      {StructuredOutput::Kind::kJsonSchema, R"({"type": "integer", "multipleOf": 3})", {}},
      {StructuredOutput::Kind::kRegex, "(a", {}},
      {StructuredOutput::Kind::kGrammar, "root ::= missing", {}},
      {StructuredOutput::Kind::kChoice, "", {}},
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    SamplingParams p;
    p.structured_output = bad[i];
    absl::Status s = e->AddRequest("r" + std::to_string(i), prompt, p);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << i << " " << s;
  }
  EXPECT_FALSE(e->HasUnfinished());
}

}  // namespace
}  // namespace duet

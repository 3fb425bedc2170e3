// `duet generate` against Hugging Face transformers' float32 greedy continuations of the
// bundled model (reference_greedy.json): every case, all at once (continuous batching) and one
// at a time, with and without KV-cache pressure, and after a warm-up.
#include <cstdlib>
#include <fstream>

#include "gtest/gtest.h"
#include "tests/integration/process.h"

namespace duet {
namespace {

using nlohmann::json;

class GenerateReferenceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::ifstream in(std::string(DUET_MODELS_DIR) + "/tiny-code-llama/reference_greedy.json");
    ASSERT_TRUE(in.good());
    reference_ = json::parse(in);
    dir_ = testing::MakeTempDir("generate-ref");
    std::vector<json> rows;
    for (size_t i = 0; i < reference_["cases"].size(); ++i) {
      const json& c = reference_["cases"][i];
      rows.push_back({{"id", "case-" + std::to_string(i)}, {"prompt_token_ids", c["prompt_ids"]},
                      {"temperature", 0}, {"max_tokens", 128}});
    }
    testing::WriteJsonlFile(dir_ + "/in.jsonl", rows);
  }

  // Runs duet generate with `flags` and checks every case's tokens against the reference.
  // `output`: where the flags have the JSONL written (default: --output there).
  void ExpectReference(const std::string& flags, std::string output = "") {
    const std::string out = output.empty() ? dir_ + "/out.jsonl" : output, log = dir_ + "/log.txt";
    const std::string cmd = testing::DuetBinary() + " generate --backend cpu --model " DUET_MODELS_DIR
                            "/tiny-code-llama --input " + dir_ + "/in.jsonl " +
                            (output.empty() ? "--output " + out + " " : "") + flags;
    ASSERT_EQ(testing::RunCommand(cmd, log), 0) << testing::ReadText(log);
    std::vector<json> rows = testing::ReadJsonlFile(out);
    ASSERT_EQ(rows.size(), reference_["cases"].size());
    for (size_t i = 0; i < rows.size(); ++i) {
      const json& c = reference_["cases"][i];
      EXPECT_EQ(rows[i]["id"], "case-" + std::to_string(i));
      EXPECT_EQ(rows[i]["prompt_token_ids"], c["prompt_ids"]);
      const std::vector<int> got = rows[i]["token_ids"].get<std::vector<int>>();
      const std::vector<int> want = c["greedy_ids"].get<std::vector<int>>();
      size_t first_diff = 0;
      while (first_diff < got.size() && first_diff < want.size() && got[first_diff] == want[first_diff]) ++first_diff;
      EXPECT_EQ(got, want) << "case " << i << " (" << flags << ") first differs at step " << first_diff
                           << " where the reference top-2 margin is "
                           << (first_diff < c["top2_margins"].size() ? c["top2_margins"][first_diff].dump() : "-");
      EXPECT_EQ(rows[i]["finish_reason"], "length");
      EXPECT_EQ(rows[i]["text"], c["greedy_text"]) << "case " << i;
    }
  }

  json reference_;
  std::string dir_;
};

TEST_F(GenerateReferenceTest, AllCasesBatchedTogether) { ExpectReference(""); }

TEST_F(GenerateReferenceTest, OneCaseAtATime) { ExpectReference("--max-num-seqs 1"); }

// One request per step, so each prompt's prefill is a step of its own and runs on the ranks
// (ring attention); the continuation must be the reference's all the same.
TEST_F(GenerateReferenceTest, SequenceParallelPrefillOnTwoThreeAndFourRanks) {
  for (int ranks : {2, 3, 4}) ExpectReference("--max-num-seqs 1 --sp-min-tokens 8 --sp-ranks " + std::to_string(ranks));
}

// --devices places sequence-parallel ranks on GPUs: the CPU backend (ranks on threads) refuses it,
// and so does a count that does not match --sp-ranks, before anything runs.
TEST_F(GenerateReferenceTest, DevicesAreForTheCudaBackendWithOnePerRank) {
  const std::string base = testing::DuetBinary() + " generate --model " DUET_MODELS_DIR "/tiny-code-llama --input " +
                           dir_ + "/in.jsonl --output " + dir_ + "/devices.jsonl ";
  const std::string log = dir_ + "/devices.txt";
  EXPECT_NE(std::system((base + "--backend cpu --sp-ranks 2 --devices 0,1 > " + log + " 2>&1").c_str()), 0);
  EXPECT_NE(testing::ReadText(log).find("--devices is for the cuda backend"), std::string::npos)
      << testing::ReadText(log);
  EXPECT_NE(std::system((base + "--backend cpu --sp-transport carrier-pigeon > " + log + " 2>&1").c_str()), 0);
  EXPECT_NE(testing::ReadText(log).find("--sp-transport"), std::string::npos) << testing::ReadText(log);
}

// The warm-up runs the first cases once and releases them; the batch then reuses their ids.
TEST_F(GenerateReferenceTest, AfterAWarmUpOfTheFirstCases) { ExpectReference("--warmup 3"); }

// --progress draws vLLM's "Processed prompts" line on stderr even when it is a file; the JSONL,
// written to stdout here, holds the reference rows and nothing else.
TEST_F(GenerateReferenceTest, ProgressOnStderrLeavesTheJsonlAlone) {
  const std::string stdout_path = dir_ + "/stdout.jsonl";
  ExpectReference("--progress --output /dev/stdout > " + stdout_path, stdout_path);
  const std::string log = testing::ReadText(dir_ + "/log.txt");
  const std::string cases = std::to_string(reference_["cases"].size());
  EXPECT_NE(log.find("Processed prompts: 100%|"), std::string::npos) << log;
  EXPECT_NE(log.find("| " + cases + "/" + cases + " ["), std::string::npos) << log;
  EXPECT_NE(log.find("toks/s]"), std::string::npos) << log;
}

// On a terminal (a pseudo-terminal from script(1)) the line comes by itself and is redrawn in
// place; --no-progress turns it off. Without a terminal and without --progress there is none.
TEST_F(GenerateReferenceTest, ProgressByDefaultOnlyOnATerminal) {
  ExpectReference("");
  EXPECT_EQ(testing::ReadText(dir_ + "/log.txt").find("Processed prompts"), std::string::npos);
  const std::string generate = testing::DuetBinary() + " generate --backend cpu --model " DUET_MODELS_DIR
                               "/tiny-code-llama --input " + dir_ + "/in.jsonl --output " + dir_ + "/tty.jsonl";
  for (const bool off : {false, true}) {
    const std::string tty = dir_ + "/tty.txt";
    ASSERT_EQ(testing::RunCommand("script -qec '" + generate + (off ? " --no-progress" : "") + "' /dev/null > " + tty,
                                  dir_ + "/script.log"),
              0)
        << testing::ReadText(dir_ + "/script.log");
    const std::string text = testing::ReadText(tty);
    EXPECT_EQ(text.find("\rProcessed prompts: 100%|") != std::string::npos, !off) << text;
    EXPECT_EQ(testing::ReadJsonlFile(dir_ + "/tty.jsonl").size(), reference_["cases"].size());
  }
}

// A small cache and token budget force chunked prefill and preemption with recomputation.
TEST_F(GenerateReferenceTest, UnderKvPressureWithChunkedPrefill) {
  ExpectReference("--num-kv-blocks 100 --block-size 8 --max-num-batched-tokens 96");
}

// A small mixed-step budget: prompts go in chunks beside decoding requests, whole when none decodes.
TEST_F(GenerateReferenceTest, WithASmallMixedStepBudget) {
  ExpectReference("--max-num-batched-tokens 512 --max-num-mixed-tokens 24");
}

}  // namespace
}  // namespace duet

// LlamaCpu's step invariance: a token's logits are the same bits whether its prompt runs in one
// step, in chunks of any size, or beside another sequence's tokens, and whatever the pool's
// thread count (CMakeLists.txt runs these tests again on three threads). Prefix caching, chunked
// prefill, continuous batching and speculation rely on it for outputs equal to a lone run.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "backends/cpu/llama_cpu.h"
#include "engine/kv/kv_cache.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "nlohmann/json.hpp"

namespace duet {
namespace {

const std::string kModel = std::string(DUET_MODELS_DIR) + "/tiny-code-llama";
constexpr int64_t kBlockSize = 16;

class LlamaCpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto model = LlamaCpu::Load(kModel);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
    std::mt19937 rng(11);
    // Longer than one row block of the batched GEMV (192 rows).
    prompt_.resize(300);
    for (int32_t& t : prompt_) t = int32_t(rng() % uint32_t(model_->config().vocab_size));
  }

  // Every prompt token's logits, [prompt size, vocab], from the prompt run as steps of the
  // given chunk sizes (summing to its size). `beside` > 0 adds that many tokens of another
  // sequence (its own blocks) to every step, ahead of the prompt's chunk. `last_rows` > 0: each
  // chunk asks for the logits of its last `last_rows` tokens only (what the result then holds).
  std::vector<float> Logits(const std::vector<int64_t>& chunk_sizes, int64_t beside, int64_t last_rows = 0) {
    const int64_t vocab = model_->config().vocab_size;
    const int64_t blocks = int64_t(prompt_.size()) / kBlockSize + 1;
    std::unique_ptr<KvCache> cache = *model_->CreateKvCache(2 * blocks + 2 * int64_t(chunk_sizes.size()), kBlockSize);
    std::vector<int32_t> table(static_cast<size_t>(blocks)), other_table;
    for (int64_t i = 0; i < blocks; ++i) table[size_t(i)] = int32_t(2 * i + 1);  // interleaved with the other's
    std::vector<int32_t> other_tokens;
    std::vector<float> out, step_logits;
    int64_t position = 0;
    for (int64_t size : chunk_sizes) {
      std::vector<SequenceChunk> chunks;
      if (beside > 0) {
        // A fresh neighbour each step: its tokens' K/V go to blocks of its own.
        other_tokens.assign(size_t(beside), int32_t(position % 7 + 3));
        other_table.clear();
        for (int64_t b = 0; b * kBlockSize < beside; ++b) other_table.push_back(int32_t(2 * b));
        SequenceChunk& other = chunks.emplace_back();
        other.tokens = other_tokens;
        other.block_table = other_table;
        other.sequence_id = 2;
        other.num_logits = 1;
      }
      SequenceChunk& chunk = chunks.emplace_back();
      chunk.tokens = absl::MakeConstSpan(prompt_).subspan(size_t(position), size_t(size));
      chunk.start_position = position;
      chunk.block_table = table;
      chunk.sequence_id = 1;
      chunk.num_logits = int32_t(last_rows > 0 ? std::min(size, last_rows) : size);
      const absl::Status s = model_->Forward(chunks, *cache, step_logits);
      EXPECT_TRUE(s.ok()) << s;
      const int64_t skip = beside > 0 ? vocab : 0;  // the neighbour's row comes first
      out.insert(out.end(), step_logits.begin() + skip, step_logits.end());
      position += size;
    }
    return out;
  }

  std::unique_ptr<LlamaCpu> model_;
  std::vector<int32_t> prompt_;
};

TEST_F(LlamaCpuTest, LogitsAreTheSameBitsWhateverTheStepsOfThePrompt) {
  const std::vector<float> whole = Logits({300}, 0);
  ASSERT_EQ(whole.size(), 300 * size_t(model_->config().vocab_size));
  const std::vector<std::pair<std::vector<int64_t>, int64_t>> cases = {
      {{1, 16, 17, 266}, 0},   // across the sizes of decode, verification and prefill steps
      {{150, 150}, 0},
      {{299, 1}, 0},           // the last token alone, as a decode step
      {{100, 9, 191}, 5},      // beside another sequence's prompt chunk
      {{300}, 40}};
  for (const auto& [sizes, beside] : cases) {
    const std::vector<float> got = Logits(sizes, beside);
    ASSERT_EQ(got.size(), whole.size());
    for (size_t i = 0; i < whole.size(); ++i) {
      ASSERT_EQ(got[i], whole[i]) << "chunks of " << testing::PrintToString(sizes) << " beside " << beside
                                  << ": token " << i / size_t(model_->config().vocab_size);
    }
  }
}

// The last layer's output projection and MLP run only on the rows that give logits
// (LlamaCpu::KeepLogitRows): a chunk asking for its last one or three rows' logits, alone or beside
// another sequence's chunk, gets the same bits for them as a step giving every row's logits.
TEST_F(LlamaCpuTest, ChunksGivingFewerLogitsGetTheSameBitsForTheirRows) {
  const size_t vocab = size_t(model_->config().vocab_size);
  const std::vector<float> whole = Logits({300}, 0);
  const std::vector<std::pair<std::vector<int64_t>, int64_t>> cases = {
      {{1, 16, 17, 266}, 0}, {{150, 150}, 0}, {{100, 9, 191}, 5}, {{300}, 40}};
  for (const int64_t last_rows : {1, 3}) {
    for (const auto& [sizes, beside] : cases) {
      const std::vector<float> got = Logits(sizes, beside, last_rows);
      std::vector<float> want;
      int64_t end = 0;
      for (int64_t size : sizes) {
        end += size;
        const int64_t first = end - std::min(size, last_rows);
        want.insert(want.end(), whole.begin() + first * int64_t(vocab), whole.begin() + end * int64_t(vocab));
      }
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_EQ(got[i], want[i]) << "last " << last_rows << " rows of chunks of " << testing::PrintToString(sizes)
                                   << " beside " << beside << ": row " << i / vocab;
      }
    }
  }
}

// kModel's checkpoint as one model.safetensors in `dir`, config.json's tie_word_embeddings set to
// `tied`: tied, without lm_head.weight; untied, with a copy of the embeddings as lm_head.weight.
void WriteCheckpointWithTheEmbeddingsAsLmHead(const std::string& dir, bool tied) {
  std::filesystem::create_directories(dir);
  nlohmann::json config = nlohmann::json::parse(std::ifstream(kModel + "/config.json"));
  config["tie_word_embeddings"] = tied;
  std::ofstream(dir + "/config.json") << config.dump();
  std::unique_ptr<WeightStore> store = *WeightStore::Open(kModel);
  std::vector<std::pair<std::string, const TensorView*>> tensors;
  for (const std::string& name : store->Names()) {
    if (name != "lm_head.weight") tensors.emplace_back(name, *store->Get(name));
  }
  if (!tied) tensors.emplace_back("lm_head.weight", *store->Get("model.embed_tokens.weight"));
  nlohmann::json header;
  size_t offset = 0;
  for (const auto& [name, t] : tensors) {
    header[name] = {{"dtype", DTypeName(t->dtype)}, {"shape", t->shape}, {"data_offsets", {offset, offset + t->nbytes}}};
    offset += t->nbytes;
  }
  const std::string text = header.dump();
  const uint64_t size = text.size();  // little-endian, as the host
  std::ofstream out(dir + "/model.safetensors", std::ios::binary);
  out.write(reinterpret_cast<const char*>(&size), sizeof(size));
  out << text;
  for (const auto& [name, t] : tensors) out.write(reinterpret_cast<const char*>(t->data), std::streamsize(t->nbytes));
}

// The logits of every token of `prompt`, run as one step.
std::vector<float> PromptLogits(LlamaCpu& model, const std::vector<int32_t>& prompt) {
  const int64_t blocks = int64_t(prompt.size()) / kBlockSize + 1;
  std::unique_ptr<KvCache> cache = *model.CreateKvCache(blocks, kBlockSize);
  std::vector<int32_t> table(static_cast<size_t>(blocks));
  for (int64_t i = 0; i < blocks; ++i) table[size_t(i)] = int32_t(i);
  SequenceChunk chunk;
  chunk.tokens = prompt;
  chunk.block_table = table;
  chunk.num_logits = int32_t(prompt.size());
  std::vector<float> logits;
  const absl::Status s = model.Forward(absl::MakeConstSpan(&chunk, 1), *cache, logits);
  EXPECT_TRUE(s.ok()) << s;
  return logits;
}

TEST(LlamaCpuTiedEmbeddingsTest, TheTableIsKeptOnceAsTheLmHeadAndLooksUpTheSameRows) {
  // Tied, the table is kept once, packed as the LM head, and a token's embedding is gathered from
  // it; untied with the same matrix as lm_head.weight, the lookup reads the table as read and the
  // LM head is a packed copy: the same logits, bit for bit.
  const std::string dir = testing::TempDir() + "/llama_cpu_tied";
  WriteCheckpointWithTheEmbeddingsAsLmHead(dir + "/tied", true);
  WriteCheckpointWithTheEmbeddingsAsLmHead(dir + "/untied", false);
  absl::StatusOr<std::unique_ptr<LlamaCpu>> tied = LlamaCpu::Load(dir + "/tied");
  absl::StatusOr<std::unique_ptr<LlamaCpu>> untied = LlamaCpu::Load(dir + "/untied");
  ASSERT_TRUE(tied.ok()) << tied.status();
  ASSERT_TRUE(untied.ok()) << untied.status();
  std::mt19937 rng(13);
  std::vector<int32_t> prompt(40);
  for (int32_t& t : prompt) t = int32_t(rng() % uint32_t((*tied)->config().vocab_size));
  const std::vector<float> want = PromptLogits(**untied, prompt);
  const std::vector<float> got = PromptLogits(**tied, prompt);
  ASSERT_EQ(got.size(), prompt.size() * size_t((*tied)->config().vocab_size));
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << "logit " << i;
}

}  // namespace
}  // namespace duet

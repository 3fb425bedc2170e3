// Sequence-parallel prefill on the CPU backend (LlamaCpu::EnableSequenceParallel) against the
// one-rank forward of the same prompt: logits and every layer's K/V in the cache.
#include <cmath>
#include <random>
#include <string>

#include "backends/cpu/llama_cpu.h"
#include "engine/kv/kv_cache.h"
#include "gtest/gtest.h"

namespace duet {
namespace {

const std::string kModel = std::string(DUET_MODELS_DIR) + "/tiny-code-llama";
constexpr int64_t kBlockSize = 16;

struct Prefill {
  std::vector<float> logits;
  std::unique_ptr<KvCache> cache;
};

Prefill RunPrefill(LlamaCpu& model, const std::vector<int32_t>& tokens, const std::vector<int32_t>& table, int32_t num_logits) {
  Prefill out;
  out.cache = *model.CreateKvCache(int64_t(table.size()) + 3, kBlockSize);
  SequenceChunk chunk;
  chunk.tokens = tokens;
  chunk.block_table = table;
  chunk.num_logits = num_logits;
  const absl::Status s = model.Forward({&chunk, 1}, *out.cache, out.logits);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

void ExpectRelativelyClose(const float* got, const float* want, int64_t n, float tolerance, const std::string& what) {
  float scale = 0;
  for (int64_t i = 0; i < n; ++i) scale = std::max(scale, std::fabs(want[i]));
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(got[i], want[i], tolerance * scale) << what << " element " << i << " (scale " << scale << ")";
  }
}

class SequenceParallelPrefillTest : public ::testing::TestWithParam<int> {};

TEST_P(SequenceParallelPrefillTest, LogitsAndCacheEqualOneRank) {
  const int ranks = GetParam();
  auto one = LlamaCpu::Load(kModel);
  auto sp = LlamaCpu::Load(kModel);
  ASSERT_TRUE(one.ok() && sp.ok());
  (*sp)->EnableSequenceParallel(ranks, 1);
  const ModelConfig& c = (*one)->config();
  std::mt19937 rng(static_cast<uint32_t>(ranks));
  // Lengths whose zigzag chunks end inside KV blocks, one that fills blocks exactly, and longer
  // ones up to the model's whole context (4 ranks; it costs seconds on two cores).
  const int64_t longest = ranks == 4 ? c.max_position_embeddings : 1000;
  for (int64_t n : {int64_t(2 * ranks + 1), int64_t(37), int64_t(128), int64_t(301), longest}) {
    std::vector<int32_t> tokens(static_cast<size_t>(n));
    for (int32_t& t : tokens) t = int32_t(rng() % uint32_t(c.vocab_size));
    // Blocks in reverse order: a shard's slots are found through the block table.
    std::vector<int32_t> table(size_t((n + kBlockSize - 1) / kBlockSize));
    for (size_t i = 0; i < table.size(); ++i) table[i] = int32_t(table.size() - i + 1);
    const int32_t num_logits = n >= 8 * ranks ? 2 : 1;
    const Prefill want = RunPrefill(**one, tokens, table, num_logits);
    const Prefill got = RunPrefill(**sp, tokens, table, num_logits);
    const std::string what = "ranks " + std::to_string(ranks) + ", " + std::to_string(n) + " tokens";
    ASSERT_EQ(got.logits.size(), want.logits.size()) << what;
    ExpectRelativelyClose(got.logits.data(), want.logits.data(), int64_t(want.logits.size()), 1e-5f, what + " logits");
    const KvCacheShape& shape = want.cache->shape();
    const int64_t pool = shape.num_blocks * shape.num_kv_heads * shape.block_size * shape.head_dim;
    for (int64_t layer = 0; layer < shape.num_layers; ++layer) {
      ExpectRelativelyClose(static_cast<const float*>(got.cache->key_pool(layer)),
                            static_cast<const float*>(want.cache->key_pool(layer)), pool, 1e-5f,
                            what + " K layer " + std::to_string(layer));
      ExpectRelativelyClose(static_cast<const float*>(got.cache->value_pool(layer)),
                            static_cast<const float*>(want.cache->value_pool(layer)), pool, 1e-5f,
                            what + " V layer " + std::to_string(layer));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, SequenceParallelPrefillTest, ::testing::Values(2, 3, 4));

TEST(SequenceParallelPrefillTest, ShortOrChunkedStepsRunOnOneRank) {
  auto sp = LlamaCpu::Load(kModel);
  ASSERT_TRUE(sp.ok());
  (*sp)->EnableSequenceParallel(4, 64);
  auto one = LlamaCpu::Load(kModel);
  ASSERT_TRUE(one.ok());
  // Below --sp-min-tokens the step is the one-rank forward exactly (bit for bit).
  std::vector<int32_t> tokens(40, 7), table = {0, 1, 2};
  const Prefill a = RunPrefill(**sp, tokens, table, 1), b = RunPrefill(**one, tokens, table, 1);
  EXPECT_EQ(a.logits, b.logits);
}

}  // namespace
}  // namespace duet

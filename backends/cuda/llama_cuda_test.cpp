// The CUDA backend against the CPU backend (the float32 reference) and against Hugging Face's
// float32 greedy output on the bundled model. Label gpu: every test skips without a device.
#include "backends/cuda/llama_cuda.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <numeric>
#include <regex>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "backends/cpu/llama_cpu.h"
#include "backends/executor_factory.h"
#include "engine/llm_engine.h"

namespace duet {
namespace {

bool HasGpu() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  cudaGetLastError();
  return ok;
}

#define SKIP_WITHOUT_GPU() \
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device"

// The models directory: $DUET_MODELS_DIR (the GPU machine runs this binary from another
// checkout path), else the one this build was configured with.
std::string ModelDir() {
  const char* env = std::getenv("DUET_MODELS_DIR");
  return std::string(env != nullptr ? env : DUET_MODELS_DIR) + "/tiny-code-llama";
}

double RelativeError(absl::Span<const float> out, absl::Span<const float> ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = double(out[i]) - double(ref[i]);
    num += d * d;
    den += double(ref[i]) * double(ref[i]);
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

// Runs the same steps through the CPU and CUDA executors with identical block tables.
class BackendPair {
 public:
  explicit BackendPair(LlamaCudaOptions options = {}) {
    auto cpu = LlamaCpu::Load(ModelDir());
    EXPECT_TRUE(cpu.ok()) << cpu.status();
    cpu_ = std::move(*cpu);
    auto gpu = LlamaCuda::Load(ModelDir(), options);
    EXPECT_TRUE(gpu.ok()) << gpu.status();
    gpu_ = std::move(*gpu);
    cpu_cache_ = *cpu_->CreateKvCache(kBlocks, kBlockSize);
    gpu_cache_ = *gpu_->CreateKvCache(kBlocks, kBlockSize);
  }
  // Returns the relative error of the CUDA logits against the CPU logits for the step.
  double Step(absl::Span<const SequenceChunk> chunks, std::vector<float>* gpu_logits = nullptr) {
    std::vector<float> cpu_logits, cuda_logits;
    EXPECT_TRUE(cpu_->Forward(chunks, *cpu_cache_, cpu_logits).ok());
    absl::Status s = gpu_->Forward(chunks, *gpu_cache_, cuda_logits);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(cpu_logits.size(), cuda_logits.size());
    if (gpu_logits != nullptr) *gpu_logits = cuda_logits;
    return RelativeError(cuda_logits, cpu_logits);
  }
  // Applies the same KV slot moves to both caches.
  void Move(absl::Span<const int32_t> block_table, absl::Span<const KvSlotMove> moves) {
    EXPECT_TRUE(cpu_->MoveKvSlots(*cpu_cache_, block_table, moves).ok());
    absl::Status s = gpu_->MoveKvSlots(*gpu_cache_, block_table, moves);
    EXPECT_TRUE(s.ok()) << s;
  }
  LlamaCuda& gpu() { return *gpu_; }
  KvCache& gpu_cache() { return *gpu_cache_; }

  static constexpr int kBlocks = 512;
  static constexpr int kBlockSize = 16;

 private:
  std::unique_ptr<LlamaCpu> cpu_;
  std::unique_ptr<LlamaCuda> gpu_;
  std::unique_ptr<KvCache> cpu_cache_, gpu_cache_;
};

std::vector<int32_t> Range(int32_t begin, int32_t n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), begin);
  return v;
}

int32_t Argmax(absl::Span<const float> row) {
  return int32_t(std::max_element(row.begin(), row.end()) - row.begin());
}

TEST(LlamaCuda, Bf16PrefillAndGraphDecodeMatchCpu) {
  SKIP_WITHOUT_GPU();
  BackendPair pair;
  // Two sequences with shuffled, non-contiguous blocks; prompts of 37 and 100 tokens.
  std::vector<int32_t> table_a = {7, 3, 100, 41, 9, 12, 13, 14, 15};
  std::vector<int32_t> table_b = {200, 201, 50, 51, 52, 53, 54, 60, 61, 62, 63};
  std::vector<int32_t> prompt_a = Range(5, 37), prompt_b = Range(300, 100);
  SequenceChunk a{prompt_a, 0, table_a, 1, 1}, b{prompt_b, 0, table_b, 2, 1};
  std::vector<float> logits;
  const double prefill_error = pair.Step({a, b}, &logits);
  std::printf("prefill logits relative error %.2e\n", prefill_error);
  EXPECT_LT(prefill_error, 1e-2);
  // Decode 20 steps (graph replay) feeding back the CUDA argmax.
  int32_t next_a = Argmax(absl::MakeSpan(logits).subspan(0, 8192));
  int32_t next_b = Argmax(absl::MakeSpan(logits).subspan(8192, 8192));
  double worst = 0;
  for (int step = 0; step < 20; ++step) {
    std::vector<int32_t> ta = {next_a}, tb = {next_b};
    SequenceChunk da{ta, int64_t(37 + step), table_a, 1, 1}, db{tb, int64_t(100 + step), table_b, 2, 1};
    worst = std::max(worst, pair.Step({da, db}, &logits));
    next_a = Argmax(absl::MakeSpan(logits).subspan(0, 8192));
    next_b = Argmax(absl::MakeSpan(logits).subspan(8192, 8192));
  }
  std::printf("decode logits worst relative error %.2e\n", worst);
  EXPECT_LT(worst, 1e-2);
}

// Prompt-sized steps through the tiled tensor-core GEMM (kernels/gemm/wide_gemm.h, SiLU·mul in
// its epilogue): a 437-token prefill of two prompts (three 160-row tiles), then a mixed step of a
// 150-token chunk beside both sequences' decode rows (one tile).
TEST(LlamaCuda, Bf16PromptStepsThroughWideGemmMatchCpu) {
  SKIP_WITHOUT_GPU();
  LlamaCudaOptions options;
  options.wide_gemm_min_rows = 128;
  BackendPair pair(options);
  std::vector<int32_t> table_a = Range(0, 12), table_b = Range(20, 25), table_c = Range(60, 12);
  std::vector<int32_t> prompt_a = Range(5, 137), prompt_b = Range(900, 300), prompt_c = Range(2000, 150);
  SequenceChunk a{prompt_a, 0, table_a, 1, 1}, b{prompt_b, 0, table_b, 2, 1};
  std::vector<float> logits;
  const double prefill_error = pair.Step({a, b}, &logits);
  std::printf("prefill logits relative error %.2e\n", prefill_error);
  EXPECT_LT(prefill_error, 1e-2);
  std::vector<int32_t> next_a = {Argmax(absl::MakeSpan(logits).subspan(0, 8192))};
  std::vector<int32_t> next_b = {Argmax(absl::MakeSpan(logits).subspan(8192, 8192))};
  SequenceChunk da{next_a, 137, table_a, 1, 1}, db{next_b, 300, table_b, 2, 1}, c{prompt_c, 0, table_c, 3, 1};
  const double mixed_error = pair.Step({da, db, c});
  std::printf("mixed step logits relative error %.2e\n", mixed_error);
  EXPECT_LT(mixed_error, 1e-2);
}

// Every projection shape that reaches cuBLAS run by a tuned cuBLASLt algorithm (kept whatever
// the timing says): a 437-token prefill of two prompts (448 rows as cuBLAS sees them), a mixed
// step of a 150-token chunk beside both sequences' decode rows, and graph-replayed decode of 40
// sequences (64 rows, captured with the tuned algorithm).
TEST(LlamaCuda, Bf16StepsThroughTunedGemmsMatchCpu) {
  SKIP_WITHOUT_GPU();
  LlamaCudaOptions options;
  options.gemm_tuning_max_rows = 512;
  options.gemm_tuning_max_time_ratio = 1e9;
  BackendPair pair(options);
  const std::vector<cuda::GemmTuning::Result>& tuning = pair.gpu().gemm_tuning();
  EXPECT_EQ(tuning.size(), 8u * 4u);  // 64, 128, ..., 512 rows × qkv, o, gate_up, down
  for (const cuda::GemmTuning::Result& r : tuning) EXPECT_TRUE(r.kept) << r.shape.rows << " " << r.shape.out;
  std::vector<int32_t> table_a = Range(0, 12), table_b = Range(20, 25), table_c = Range(60, 12);
  std::vector<int32_t> prompt_a = Range(5, 137), prompt_b = Range(900, 300), prompt_c = Range(2000, 150);
  SequenceChunk a{prompt_a, 0, table_a, 1, 1}, b{prompt_b, 0, table_b, 2, 1};
  std::vector<float> logits;
  EXPECT_LT(pair.Step({a, b}, &logits), 1e-2);
  std::vector<int32_t> next_a = {Argmax(absl::MakeSpan(logits).subspan(0, 8192))};
  std::vector<int32_t> next_b = {Argmax(absl::MakeSpan(logits).subspan(8192, 8192))};
  SequenceChunk da{next_a, 137, table_a, 1, 1}, db{next_b, 300, table_b, 2, 1}, c{prompt_c, 0, table_c, 3, 1};
  EXPECT_LT(pair.Step({da, db, c}), 1e-2);
  constexpr int kSeqs = 40;
  std::vector<std::vector<int32_t>> tables(kSeqs), prompts = tables, next = tables;
  std::vector<SequenceChunk> step;
  for (int i = 0; i < kSeqs; ++i) {
    tables[size_t(i)] = {100 + 2 * i, 101 + 2 * i};  // 32 tokens of room
    prompts[size_t(i)] = Range(50 + 37 * i, 9);
    step.push_back(SequenceChunk{prompts[size_t(i)], 0, tables[size_t(i)], SequenceId(10 + i), 1});
  }
  EXPECT_LT(pair.Step(step, &logits), 1e-2);
  double worst = 0;
  for (int t = 0; t < 4; ++t) {
    step.clear();
    for (int i = 0; i < kSeqs; ++i) {
      next[size_t(i)] = {Argmax(absl::MakeSpan(logits).subspan(size_t(i) * 8192, 8192))};
      step.push_back(SequenceChunk{next[size_t(i)], int64_t(9 + t), tables[size_t(i)], SequenceId(10 + i), 1});
    }
    worst = std::max(worst, pair.Step(step, &logits));
  }
  EXPECT_LT(worst, 1e-2);
}

// Graph-replayed decode of 5, 24 and 64 sequences through the tensor-core skinny GEMM (its 16-,
// 32- and 64-row tiles, split K on the tiny model's narrow projections).
TEST(LlamaCuda, Bf16GraphDecodeOfManySequencesMatchesCpu) {
  SKIP_WITHOUT_GPU();
  LlamaCudaOptions options;
  options.skinny_gemm_max_rows = kernels::kSkinnyGemmMaxRows;
  BackendPair pair(options);
  for (const int n : {5, 24, 64}) {
    std::vector<std::vector<int32_t>> tables(static_cast<size_t>(n)), prompts = tables, next = tables;
    std::vector<SequenceChunk> step;
    for (int i = 0; i < n; ++i) {
      tables[size_t(i)] = {2 * i, 2 * i + 1, 2 * n + i};  // 48 tokens of room, blocks of the sequences interleaved
      prompts[size_t(i)] = Range(50 + 37 * i, 17);
      step.push_back(SequenceChunk{prompts[size_t(i)], 0, tables[size_t(i)], SequenceId(i + 1), 1});
    }
    std::vector<float> logits;
    EXPECT_LT(pair.Step(step, &logits), 1e-2) << n << " prompts";
    double worst = 0;
    for (int t = 0; t < 4; ++t) {
      step.clear();
      for (int i = 0; i < n; ++i) {
        next[size_t(i)] = {Argmax(absl::MakeSpan(logits).subspan(size_t(i) * 8192, 8192))};
        step.push_back(SequenceChunk{next[size_t(i)], int64_t(17 + t), tables[size_t(i)], SequenceId(i + 1), 1});
      }
      worst = std::max(worst, pair.Step(step, &logits));
    }
    std::printf("%d sequences: decode logits worst relative error %.2e\n", n, worst);
    EXPECT_LT(worst, 1e-2) << n << " sequences";
  }
}

TEST(LlamaCuda, Bf16ChunkedPrefillMixedWithDecodeMatchesCpu) {
  SKIP_WITHOUT_GPU();
  BackendPair pair;
  std::vector<int32_t> table_a = {1, 2, 3, 4, 5, 6, 7, 8}, table_b = {20, 21, 22, 23};
  std::vector<int32_t> prompt = Range(10, 90);
  // The first 50 prompt tokens, no logits.
  SequenceChunk first{absl::MakeSpan(prompt).subspan(0, 50), 0, table_a, 1, 0};
  std::vector<int32_t> b_prompt = Range(1000, 30);
  SequenceChunk b{b_prompt, 0, table_b, 2, 1};
  EXPECT_LT(pair.Step({first, b}), 1e-2);
  // The rest of A's prompt (with prompt logits for its last 5 tokens) beside a decode step of B.
  std::vector<int32_t> b_next = {77};
  SequenceChunk rest{absl::MakeSpan(prompt).subspan(50), 50, table_a, 1, 5};
  SequenceChunk b_decode{b_next, 30, table_b, 2, 1};
  EXPECT_LT(pair.Step({rest, b_decode}), 1e-2);
}

// An eager step's last layer runs its output projection and MLP only on the rows that give logits
// (LlamaCudaOptions::last_layer_logit_rows_only): the same steps with it off give the same
// logits within bf16 rounding, both against the CPU backend's. The steps: a chunk without logits alone
// (no row leaves the last layer), its continuation beside a prompt asking for its last 3 rows'
// logits, then decode rows ahead of a prompt chunk. The later steps attend to the earlier steps'
// last-layer K/V, so skipped rows that wrote wrong K/V would show.
TEST(LlamaCuda, Bf16LastLayerOnLogitRowsOnlyMatchesEveryRow) {
  SKIP_WITHOUT_GPU();
  LlamaCudaOptions every_row;
  every_row.last_layer_logit_rows_only = false;
  BackendPair pruned, full(every_row);
  std::vector<int32_t> table_a = Range(0, 10), table_b = Range(40, 10), table_c = Range(80, 10);
  std::vector<int32_t> prompt_a = Range(11, 130), prompt_b = Range(700, 70), prompt_c = Range(3000, 90);
  std::vector<int32_t> next_a = {5}, next_b = {9};
  const std::vector<std::vector<SequenceChunk>> steps = {
      {SequenceChunk{absl::MakeSpan(prompt_a).subspan(0, 64), 0, table_a, 1, 0}},
      {SequenceChunk{absl::MakeSpan(prompt_a).subspan(64), 64, table_a, 1, 1}, SequenceChunk{prompt_b, 0, table_b, 2, 3}},
      {SequenceChunk{next_a, 130, table_a, 1, 1}, SequenceChunk{next_b, 70, table_b, 2, 1},
       SequenceChunk{prompt_c, 0, table_c, 3, 1}}};
  for (size_t i = 0; i < steps.size(); ++i) {
    std::vector<float> pruned_logits, full_logits;
    const double pruned_error = pruned.Step(steps[i], &pruned_logits);
    const double full_error = full.Step(steps[i], &full_logits);
    ASSERT_EQ(pruned_logits.size(), full_logits.size());
    const double between = RelativeError(pruned_logits, full_logits);
    std::printf("step %zu: against the CPU %.2e (every row %.2e), between the two %.2e\n", i, pruned_error, full_error,
                between);
    EXPECT_LT(pruned_error, 1e-2);
    EXPECT_LT(between, 1e-2);
  }
}

// Decoding sequences ahead of prompt chunks, the order the scheduler gives a decode step that takes
// a prompt in (conditional disaggregation, chunked prefill): the leading one-token sequences'
// attention runs in the paged decode kernel, the rest's in the prefill kernel. Their logits against
// the CPU backend's, the contexts crossing KV blocks and the decode sequences in different blocks.
TEST(LlamaCuda, Bf16DecodeSequencesAheadOfPromptChunksMatchCpu) {
  SKIP_WITHOUT_GPU();
  BackendPair pair;
  std::vector<int32_t> table_a = {3, 9, 4}, table_b = {40, 41, 42, 43, 44, 45}, table_c = {70, 71, 72, 73, 74};
  std::vector<int32_t> table_d = {90, 91};
  std::vector<int32_t> prompt_a = Range(200, 33), prompt_b = Range(500, 80), prompt_c = Range(900, 60);
  EXPECT_LT(pair.Step({SequenceChunk{prompt_a, 0, table_a, 1, 1}, SequenceChunk{prompt_b, 0, table_b, 2, 1}}), 1e-2);
  // A and B decode; C's first 40 prompt tokens (no logits) and D's whole prompt come after them.
  std::vector<int32_t> next_a = {17}, next_b = {23}, prompt_d = Range(1500, 12);
  std::vector<float> logits;
  const double mixed_error =
      pair.Step({SequenceChunk{next_a, 33, table_a, 1, 1}, SequenceChunk{next_b, 80, table_b, 2, 1},
                 SequenceChunk{absl::MakeSpan(prompt_c).subspan(0, 40), 0, table_c, 3, 0},
                 SequenceChunk{prompt_d, 0, table_d, 4, 1}},
                &logits);
  std::printf("decode rows ahead of prompt chunks: logits relative error %.2e\n", mixed_error);
  EXPECT_LT(mixed_error, 1e-2);
  EXPECT_EQ(logits.size(), size_t(3 * pair.gpu().config().vocab_size));
  // The rest of C's prompt after three decode rows, then a step of one-token chunks only, one of
  // them without logits (not a decode step: all of it in the paged decode kernel).
  std::vector<int32_t> next_a2 = {18}, next_b2 = {24}, next_d = {31};
  EXPECT_LT(pair.Step({SequenceChunk{next_a2, 34, table_a, 1, 1}, SequenceChunk{next_b2, 81, table_b, 2, 1},
                       SequenceChunk{next_d, 12, table_d, 4, 1},
                       SequenceChunk{absl::MakeSpan(prompt_c).subspan(40), 40, table_c, 3, 1}}),
            1e-2);
  std::vector<int32_t> next_a3 = {19}, next_c = {44};
  std::vector<int32_t> prompt_e = {7}, table_e = {100};
  EXPECT_LT(pair.Step({SequenceChunk{next_a3, 35, table_a, 1, 1}, SequenceChunk{next_c, 60, table_c, 3, 1},
                       SequenceChunk{prompt_e, 0, table_e, 5, 0}}),
            1e-2);
}

// Speculative verification: a draft tree beside a plain decode step, tree attention against the
// CPU backend's, then the accepted path's K/V moved and decoding continued from it. With graphs
// the verification step replays a padded verification graph; without, it runs eagerly.
void ExpectDraftTreeVerificationMatchesCpu(bool cuda_graphs) {
  LlamaCudaOptions options;
  options.cuda_graphs = cuda_graphs;
  BackendPair pair(options);
  std::vector<int32_t> table_a = {9, 4, 30, 31, 32}, table_b = {60, 61, 62};
  std::vector<int32_t> prompt_a = Range(100, 40), prompt_b = Range(700, 20);
  EXPECT_LT(pair.Step({SequenceChunk{prompt_a, 0, table_a, 1, 1}, SequenceChunk{prompt_b, 0, table_b, 2, 1}}), 1e-2);
  // Root 5 at position 40 with two branches: 6 -> 7 -> 8 and 9 -> 10, plus 11 under the root.
  std::vector<int32_t> tree = {5, 6, 7, 8, 9, 10, 11}, parents = {-1, 0, 1, 2, 0, 4, 0};
  SequenceChunk verify{tree, 40, table_a, 1, int32_t(tree.size())};
  verify.tree_parents = parents;
  std::vector<int32_t> next_b = {3};
  std::vector<float> logits;
  const double tree_error = pair.Step({verify, SequenceChunk{next_b, 20, table_b, 2, 1}}, &logits);
  std::printf("tree verification logits relative error %.2e\n", tree_error);
  EXPECT_LT(tree_error, 1e-2);
  // Accept the branch 9 -> 10: slots 44, 45 move to 41, 42; then decode one token after it.
  const KvSlotMove moves[] = {{44, 41}, {45, 42}};
  pair.Move(table_a, moves);
  std::vector<int32_t> next_a = {12};
  const double after_error = pair.Step({SequenceChunk{next_a, 43, table_a, 1, 1}});
  std::printf("decode after the KV moves: logits relative error %.2e\n", after_error);
  EXPECT_LT(after_error, 1e-2);
}

TEST(LlamaCuda, Bf16DraftTreeVerificationAndKvMovesMatchCpu) {
  SKIP_WITHOUT_GPU();
  ExpectDraftTreeVerificationMatchesCpu(/*cuda_graphs=*/true);
}

TEST(LlamaCuda, Bf16DraftTreeVerificationEagerMatchesCpu) {
  SKIP_WITHOUT_GPU();
  ExpectDraftTreeVerificationMatchesCpu(/*cuda_graphs=*/false);
}

// Sequence-parallel prefill on virtual ranks of the one device: a 2,001-token prompt (uneven
// zigzag chunks, chunk edges inside KV blocks) gives the CPU backend's logits for its last 7
// tokens (the logits rows follow their tokens through the rank-major order), and the same as a
// one-rank CUDA prefill; then decoding from the cache it wrote matches the CPU backend too.
// devices empty: virtual ranks; else a group with a rank on each device.
void ExpectSequenceParallelPrefillMatches(int ranks, const std::vector<int>& devices = {},
                                          const std::string& transport = "peer") {
  BackendPair pair;
  LlamaCudaOptions options;
  auto one_rank = LlamaCuda::Load(ModelDir(), options);
  ASSERT_TRUE(one_rank.ok()) << one_rank.status();
  std::unique_ptr<KvCache> one_rank_cache = *(*one_rank)->CreateKvCache(BackendPair::kBlocks, BackendPair::kBlockSize);
  const absl::Status enabled = pair.gpu().EnableSequenceParallel(ranks, 64, devices, transport);
  ASSERT_TRUE(enabled.ok()) << enabled;
  ASSERT_EQ(pair.gpu().sequence_parallel_ranks(), ranks);
  ASSERT_EQ(pair.gpu().sequence_parallel_devices(), devices);
  const int n = 2001;
  std::vector<int32_t> prompt(n), table = Range(300, (n + 40) / BackendPair::kBlockSize + 1);
  for (int i = 0; i < n; ++i) prompt[size_t(i)] = int32_t((i * 7919 + 13) % 8000 + 3);
  const SequenceChunk chunk{prompt, 0, table, 1, 7};
  std::vector<float> sp_logits, one_rank_logits;
  const double cpu_error = pair.Step({chunk}, &sp_logits);
  ASSERT_TRUE((*one_rank)->Forward({chunk}, *one_rank_cache, one_rank_logits).ok());
  const double one_rank_error = RelativeError(sp_logits, one_rank_logits);
  const char* kind = devices.empty() ? "virtual" : "group";
  std::printf("%d %s ranks: prefill logits relative error %.2e against the CPU, %.2e against one CUDA rank\n", ranks,
              kind, cpu_error, one_rank_error);
  EXPECT_LT(cpu_error, 1e-2);
  EXPECT_LT(one_rank_error, 1e-2);
  for (int row = 0; row < 7; ++row) {
    EXPECT_EQ(Argmax(absl::MakeSpan(sp_logits).subspan(size_t(row) * 8192, 8192)),
              Argmax(absl::MakeSpan(one_rank_logits).subspan(size_t(row) * 8192, 8192)))
        << "row " << row;
  }
  // A decode step over the cache the ranks wrote (shorter steps run on one rank).
  int32_t next = Argmax(absl::MakeSpan(sp_logits).subspan(6 * 8192, 8192));
  double worst = 0;
  for (int step = 0; step < 8; ++step) {
    std::vector<int32_t> token = {next};
    std::vector<float> logits;
    worst = std::max(worst, pair.Step({SequenceChunk{token, int64_t(n + step), table, 1, 1}}, &logits));
    next = Argmax(logits);
  }
  std::printf("%d %s ranks: decode after it, worst logits relative error %.2e against the CPU\n", ranks, kind, worst);
  EXPECT_LT(worst, 1e-2);
}

TEST(LlamaCuda, Bf16SequenceParallelPrefillTwoRanks) {
  SKIP_WITHOUT_GPU();
  ExpectSequenceParallelPrefillMatches(2);
}

TEST(LlamaCuda, Bf16SequenceParallelPrefillThreeRanks) {
  SKIP_WITHOUT_GPU();
  ExpectSequenceParallelPrefillMatches(3);
}

TEST(LlamaCuda, Bf16SequenceParallelPrefillEightRanks) {
  SKIP_WITHOUT_GPU();
  ExpectSequenceParallelPrefillMatches(8);
}

// A group of executors, one per rank (here all on GPU 0; on a multi-GPU machine the same code
// spreads them): the same numerics as one rank.
TEST(LlamaCuda, Bf16SequenceParallelGroupPrefillTwoRanks) {
  SKIP_WITHOUT_GPU();
  ExpectSequenceParallelPrefillMatches(2, {0, 0});
}

TEST(LlamaCuda, Bf16SequenceParallelGroupPrefillThreeRanks) {
  SKIP_WITHOUT_GPU();
  ExpectSequenceParallelPrefillMatches(3, {0, 0, 0});
}

TEST(LlamaCuda, Bf16SequenceParallelGroupPrefillFourRanksOnEveryGpu) {
  SKIP_WITHOUT_GPU();
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  std::vector<int> devices;
  for (int r = 0; r < 4; ++r) devices.push_back(r % count);  // one GPU: all on it
  ExpectSequenceParallelPrefillMatches(4, devices);
}

// Device sampling through the group: the greedy token is the argmax of the group's logits, a
// seeded draw repeats, and a short prompt (below --sp-min-tokens) runs on rank 0 alone.
TEST(LlamaCuda, Bf16SequenceParallelGroupSamplesOnRankZero) {
  SKIP_WITHOUT_GPU();
  auto group = LlamaCuda::Load(ModelDir(), {});
  ASSERT_TRUE(group.ok());
  ASSERT_TRUE((*group)->EnableSequenceParallel(2, 512, {0, 0}).ok());
  std::unique_ptr<KvCache> group_cache = *(*group)->CreateKvCache(BackendPair::kBlocks, BackendPair::kBlockSize);
  for (int n : {1500, 100}) {
    std::vector<int32_t> prompt(static_cast<size_t>(n)), table = Range(0, n / BackendPair::kBlockSize + 1);
    for (int i = 0; i < n; ++i) prompt[size_t(i)] = int32_t((i * 104729 + 5) % 8000 + 3);
    const SequenceChunk chunk{prompt, 0, table, 1, 1};
    std::vector<float> logits;
    ASSERT_TRUE((*group)->Forward({chunk}, *group_cache, logits).ok());
    DeviceSamplingRow greedy;
    greedy.temperature = 0.0f;
    DeviceSamplingRow seeded;
    seeded.temperature = 0.9f;
    seeded.seed = 77;
    std::vector<DeviceSample> a, b, c;
    ASSERT_TRUE((*group)->ForwardSample({chunk}, *group_cache, {greedy}, a).ok());
    ASSERT_TRUE((*group)->ForwardSample({chunk}, *group_cache, {seeded}, b).ok());
    ASSERT_TRUE((*group)->ForwardSample({chunk}, *group_cache, {seeded}, c).ok());
    ASSERT_EQ(a.size(), 1u);
    EXPECT_EQ(a[0].token, Argmax(logits)) << n << " tokens";
    EXPECT_EQ(b[0].token, c[0].token) << n << " tokens";
  }
}

int GpuCount() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

// NCCL passes the blocks when every rank has a GPU of its own (skipped on one GPU).
TEST(LlamaCuda, Bf16SequenceParallelGroupOverNcclMatchesOneRank) {
  SKIP_WITHOUT_GPU();
  if (GpuCount() < 2) GTEST_SKIP() << "one GPU: NCCL takes one rank per GPU";
  ExpectSequenceParallelPrefillMatches(2, {0, 1}, "nccl");
  if (GpuCount() >= 4) ExpectSequenceParallelPrefillMatches(4, {0, 1, 2, 3}, "nccl");
}

TEST(LlamaCuda, SequenceParallelGroupOverNcclNeedsAGpuPerRank) {
  SKIP_WITHOUT_GPU();
  auto model = LlamaCuda::Load(ModelDir(), {});
  ASSERT_TRUE(model.ok());
  const absl::Status s = (*model)->EnableSequenceParallel(2, 64, {0, 0}, "nccl");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ((*model)->sequence_parallel_ranks(), 1);
}

TEST(LlamaCuda, SequenceParallelGroupNeedsOneDevicePerRank) {
  SKIP_WITHOUT_GPU();
  auto model = LlamaCuda::Load(ModelDir(), {});
  ASSERT_TRUE(model.ok());
  EXPECT_EQ((*model)->EnableSequenceParallel(3, 64, {0, 0}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*model)->EnableSequenceParallel(2, 64, {1, 0}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(LlamaCuda, Bf16DeviceSamplingGreedyIsArgmaxAndSeededDrawsRepeat) {
  SKIP_WITHOUT_GPU();
  BackendPair pair;
  std::vector<int32_t> table = {4, 5, 6, 7}, prompt = Range(40, 20);
  SequenceChunk chunk{prompt, 0, table, 1, 1};
  std::vector<float> logits;
  pair.Step({chunk}, &logits);
  std::vector<int32_t> next = {Argmax(logits)};
  SequenceChunk decode{next, 20, table, 1, 1};
  std::vector<float> decode_logits;
  ASSERT_TRUE(pair.gpu().Forward({decode}, pair.gpu_cache(), decode_logits).ok());
  std::vector<DeviceSample> samples;
  ASSERT_TRUE(pair.gpu().ForwardSample({decode}, pair.gpu_cache(), {DeviceSamplingRow{}}, samples).ok());
  ASSERT_EQ(samples.size(), 1u);
  EXPECT_EQ(samples[0].token, Argmax(decode_logits));
  const DeviceSamplingRow seeded{0.8f, 50, 0.95f, 0.0f, 1234, 7};
  std::vector<DeviceSample> first, second;
  ASSERT_TRUE(pair.gpu().ForwardSample({decode}, pair.gpu_cache(), {seeded}, first).ok());
  ASSERT_TRUE(pair.gpu().ForwardSample({decode}, pair.gpu_cache(), {seeded}, second).ok());
  EXPECT_EQ(first[0].token, second[0].token);
  EXPECT_TRUE(std::isfinite(first[0].logprob) && first[0].logprob <= 0.0f);
}

// A grammar mask on a device-sampled row: greedy takes the best allowed token, draws stay in the
// mask, the logprob is the raw one; the unmasked row beside it is unchanged.
TEST(LlamaCuda, Bf16DeviceSamplingHonoursGrammarMasks) {
  SKIP_WITHOUT_GPU();
  BackendPair pair;
  const int vocab = int(pair.gpu().config().vocab_size);
  std::vector<int32_t> table_a = {4, 5}, table_b = {8, 9}, prompt = Range(40, 20);
  const SequenceChunk a{prompt, 0, table_a, 1, 1}, b{prompt, 0, table_b, 1, 1};
  std::vector<float> logits;
  ASSERT_TRUE(pair.gpu().Forward({a, b}, pair.gpu_cache(), logits).ok());
  const absl::Span<const float> row(logits.data(), size_t(vocab));
  const int32_t best = Argmax(row);
  // Allow every third token except the argmax.
  std::vector<uint32_t> mask(size_t(vocab + 31) / 32, 0);
  for (int t = 0; t < vocab; t += 3) mask[size_t(t) / 32] |= 1u << (t % 32);
  mask[size_t(best) / 32] &= ~(1u << (best % 32));
  std::vector<float> masked(row.begin(), row.end());
  for (int t = 0; t < vocab; ++t) {
    if (!((mask[size_t(t) / 32] >> (t % 32)) & 1)) masked[size_t(t)] = -INFINITY;
  }
  DeviceSamplingRow greedy_masked;
  greedy_masked.allowed_tokens = mask;
  std::vector<DeviceSample> samples;
  ASSERT_TRUE(pair.gpu().ForwardSample({a, b}, pair.gpu_cache(), {greedy_masked, DeviceSamplingRow{}}, samples).ok());
  ASSERT_EQ(samples.size(), 2u);
  EXPECT_EQ(samples[0].token, Argmax(masked));
  EXPECT_NE(samples[0].token, best);
  EXPECT_EQ(samples[1].token, Argmax(absl::Span<const float>(logits.data() + vocab, size_t(vocab))));
  double sum = 0;
  for (float x : row) sum += std::exp(double(x) - double(row[size_t(best)]));
  const double raw_logprob = double(row[size_t(samples[0].token)]) - double(row[size_t(best)]) - std::log(sum);
  EXPECT_NEAR(samples[0].logprob, raw_logprob, 1e-3);
  for (uint64_t seed = 0; seed < 64; ++seed) {
    DeviceSamplingRow drawn{1.0f, 0, 1.0f, 0.0f, seed, 0};
    drawn.allowed_tokens = mask;
    ASSERT_TRUE(pair.gpu().ForwardSample({a, b}, pair.gpu_cache(), {drawn, drawn}, samples).ok());
    for (const DeviceSample& d : samples) EXPECT_EQ(d.token % 3, 0) << "seed " << seed << " drew " << d.token;
  }
}

// Constrained requests through the engine on the CUDA backend, where they sample on the device:
// every output satisfies its constraint, greedy outputs equal those of host sampling (a request
// asking for a top logprob samples its whole step on the host), and seeded draws repeat.
TEST(LlamaCuda, Bf16ConstrainedRequestsSampleOnTheDeviceWithTheirMasks) {
  SKIP_WITHOUT_GPU();
  using grammar::StructuredOutput;
  EngineConfig config;
  config.model_dir = ModelDir();
  config.backend = "cuda";
  config.gpu_memory_utilization = 0.2;
  auto engine = CreateEngine(config);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const std::vector<StructuredOutput> constraints = {
      {StructuredOutput::Kind::kJsonSchema,
       R"({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
           "name": {"type": "string", "maxLength": 12}}, "required": ["color", "ok", "name"],
           "additionalProperties": false})",
       {}},
      {StructuredOutput::Kind::kRegex, R"([a-z]{2,8}@[a-z]{2,8}\.(com|org))", {}},
      {StructuredOutput::Kind::kChoice, "", {"def main():", "import os", "class Foo:"}},
  };
  const std::vector<int32_t> prompt = (*engine)->tokenizer().Encode("def parse(text):\n    return");
  // Runs every constraint at once; returns the texts by constraint index.
  auto run = [&](float temperature, bool host_logprobs, uint64_t seed) {
    for (size_t i = 0; i < constraints.size(); ++i) {
      SamplingParams p;
      p.temperature = temperature;
      p.seed = seed + i;
      p.max_tokens = 96;
      p.structured_output = constraints[i];
      if (host_logprobs) p.logprobs = 1;
      const absl::Status added = (*engine)->AddRequest(std::to_string(i), prompt, p);
      EXPECT_TRUE(added.ok()) << added;
    }
    std::map<std::string, std::vector<int32_t>> ids;
    std::map<std::string, FinishReason> reasons;
    while ((*engine)->HasUnfinished()) {
      auto step = (*engine)->Step();
      EXPECT_TRUE(step.ok()) << step.status();
      if (!step.ok()) break;
      for (const RequestOutput& out : *step) {
        ids[out.id].insert(ids[out.id].end(), out.new_token_ids.begin(), out.new_token_ids.end());
        if (out.finished) reasons[out.id] = out.finish_reason;
      }
    }
    std::vector<std::string> texts;
    for (size_t i = 0; i < constraints.size(); ++i) {
      EXPECT_EQ(reasons[std::to_string(i)], FinishReason::kStop) << "constraint " << i << " did not complete";
      texts.push_back((*engine)->tokenizer().Decode(ids[std::to_string(i)]));
      (*engine)->Release(std::to_string(i));
    }
    return texts;
  };
  auto expect_valid = [&](const std::vector<std::string>& texts) {
    const nlohmann::json object = nlohmann::json::parse(texts[0], nullptr, false);
    ASSERT_TRUE(object.is_object()) << texts[0];
    EXPECT_TRUE(object["color"] == "red" || object["color"] == "green" || object["color"] == "blue") << texts[0];
    EXPECT_TRUE(object["ok"].is_boolean()) << texts[0];
    EXPECT_TRUE(object["name"].is_string()) << texts[0];
    EXPECT_TRUE(std::regex_match(texts[1], std::regex(R"([a-z]{2,8}@[a-z]{2,8}\.(com|org))"))) << texts[1];
    EXPECT_TRUE(texts[2] == "def main():" || texts[2] == "import os" || texts[2] == "class Foo:") << texts[2];
  };
  const std::vector<std::string> device_greedy = run(0.0f, false, 0);
  expect_valid(device_greedy);
  EXPECT_EQ(device_greedy, run(0.0f, true, 0));
  const std::vector<std::string> drawn = run(0.9f, false, 100);
  expect_valid(drawn);
  EXPECT_EQ(drawn, run(0.9f, false, 100));
}

// Async scheduling on the device: each step launched before the previous one's tokens are on the
// host, its decode tokens put in from the previous step's samples on the device. Requests that all
// fit the batch and end by length keep the schedule of steps run one at a time (prompt chunks
// beside decode rows in eager mixed steps, decode-only steps as graphs), so greedy and seeded
// outputs are the same tokens. Each step after a launched one is planned at its midpoint (late
// scheduling: the event every step, eager or graph, records halfway through its layers).
TEST(LlamaCuda, Bf16AsyncSchedulingGivesTheTokensOfStepsOneAtATime) {
  SKIP_WITHOUT_GPU();
  auto run = [](bool async) {
    EngineConfig config;
    config.model_dir = ModelDir();
    config.backend = "cuda";
    config.gpu_memory_utilization = 0.2;
    config.async_scheduling = async;
    config.scheduler.max_num_seqs = 16;
    config.scheduler.max_num_batched_tokens = 256;
    config.scheduler.max_num_mixed_tokens = 96;
    absl::StatusOr<std::unique_ptr<LlmEngine>> engine = CreateEngine(config);
    EXPECT_TRUE(engine.ok()) << engine.status();
    const std::vector<int32_t> base = (*engine)->tokenizer().Encode(
        "import numpy as np\n\ndef moving_average(x, n):\n    return np.convolve(x, np.ones(n) / n, mode='valid')\n");
    for (int i = 0; i < 16; ++i) {
      std::vector<int32_t> prompt;
      for (int k = 0; k <= i % 5; ++k) prompt.insert(prompt.end(), base.begin() + (k + i) % 7, base.end());
      SamplingParams p;
      p.temperature = i % 3 == 0 ? 0.8f : 0.0f;
      p.seed = uint64_t(i);
      p.max_tokens = 6 + (i * 7) % 29;
      p.ignore_eos = true;
      EXPECT_TRUE((*engine)->AddRequest(std::to_string(i), prompt, p).ok());
    }
    std::map<std::string, std::vector<int32_t>> tokens;
    bool first_step_gave_tokens = false;
    for (int step = 0; (*engine)->HasUnfinished(); ++step) {
      (*engine)->WaitForSchedulingPoint();
      absl::StatusOr<std::vector<RequestOutput>> outputs = (*engine)->Step();
      EXPECT_TRUE(outputs.ok()) << outputs.status();
      if (!outputs.ok()) break;
      if (step == 0) first_step_gave_tokens = !outputs->empty();
      for (const RequestOutput& out : *outputs) {
        tokens[out.id].insert(tokens[out.id].end(), out.new_token_ids.begin(), out.new_token_ids.end());
      }
    }
    // A launched first step gives its tokens with the second.
    EXPECT_EQ(first_step_gave_tokens, !async);
    const EngineStats stats = (*engine)->Stats();
    EXPECT_EQ(stats.num_free_kv_blocks, stats.num_kv_blocks);
    EXPECT_EQ(stats.num_late_scheduled_steps > 10, async) << stats.num_late_scheduled_steps;
    return tokens;
  };
  const std::map<std::string, std::vector<int32_t>> one_at_a_time = run(false), ahead = run(true);
  ASSERT_EQ(ahead.size(), 16u);
  for (const auto& [id, want] : one_at_a_time) {
    EXPECT_EQ(ahead.at(id), want) << "request " << id;
    EXPECT_EQ(want.size(), size_t(6 + (std::stoi(id) * 7) % 29)) << "request " << id;
  }
}

// Device out-of-memory is an error the caller sees (ResourceExhausted, saying what was asked
// for), not an abort; the executor stays usable after a cache that did not fit.
// Disaggregation's late KV target on the device: a prefill engine keeps a finished prompt's blocks
// (LlmEngine::KeepKvWhenFinished) while another request runs on it and reuses the freed ones; the
// kept blocks, copied afterwards into a decode engine's reservation, continue the greedy output
// exactly as one engine does alone.
TEST(LlamaCuda, Bf16KeptKvAfterOtherStepsContinuesTheLocalOutput) {
  SKIP_WITHOUT_GPU();
  EngineConfig config;
  config.model_dir = ModelDir();
  config.backend = "cuda";
  config.gpu_memory_utilization = 0.1;
  config.num_kv_blocks = 64;
  auto make_engine = [&] {
    absl::StatusOr<std::unique_ptr<LlmEngine>> e = CreateEngine(config);
    EXPECT_TRUE(e.ok()) << e.status();
    return std::move(*e);
  };
  std::unique_ptr<LlmEngine> local = make_engine(), prefill = make_engine(), decode = make_engine();
  const std::vector<int32_t> prompt = local->tokenizer().Encode("import numpy as np\n\ndef moving_average(x, n):\n");
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = 24;
  p.ignore_eos = true;
  auto run = [](LlmEngine& e) {
    while (e.HasUnfinished()) ASSERT_TRUE(e.Step().ok());
  };
  ASSERT_TRUE(local->AddRequest("x", prompt, p).ok());
  run(*local);

  SamplingParams first = p;
  first.max_tokens = 1;
  ASSERT_TRUE(prefill->AddRequest("x", prompt, first).ok());
  ASSERT_TRUE(prefill->KeepKvWhenFinished("x").ok());
  run(*prefill);
  const Request* done = prefill->Find("x");
  ASSERT_TRUE(done->kept_kv.has_value());
  const SequenceId kept = *done->kept_kv;
  const SampledToken token{done->output[0]};
  prefill->Release("x");
  // Another prompt through the prefill engine: it takes the free blocks, never the kept ones.
  SamplingParams other = p;
  other.max_tokens = 8;
  ASSERT_TRUE(prefill->AddRequest("y", std::vector<int32_t>(prompt.rbegin(), prompt.rend()), other).ok());
  run(*prefill);

  absl::StatusOr<LlmEngine::KvReservation> reservation = decode->ReserveKv(prompt, "", 0);
  ASSERT_TRUE(reservation.ok()) << reservation.status();
  const std::vector<int32_t> src = prefill->BlockTable(kept);
  const std::vector<int32_t> dst = decode->BlockTable(reservation->seq);
  ASSERT_EQ(src.size(), dst.size());
  const KvCacheShape shape = prefill->kv_cache().shape();
  const size_t block_bytes = size_t(shape.block_elems()) * sizeof(__nv_bfloat16);
  for (int64_t layer = 0; layer < shape.num_layers; ++layer) {
    for (size_t b = 0; b < src.size(); ++b) {
      for (const auto& [to, from] : {std::pair{decode->kv_cache().key_pool(layer), prefill->kv_cache().key_pool(layer)},
                                     std::pair{decode->kv_cache().value_pool(layer), prefill->kv_cache().value_pool(layer)}}) {
        ASSERT_EQ(cudaMemcpy(static_cast<char*>(to) + dst[b] * block_bytes, static_cast<const char*>(from) + src[b] * block_bytes,
                             block_bytes, cudaMemcpyDeviceToDevice),
                  cudaSuccess);
      }
    }
  }
  EXPECT_EQ(prefill->Stats().num_free_kv_blocks, prefill->Stats().num_kv_blocks - int32_t(src.size()));
  prefill->ReleaseKv(kept);
  EXPECT_EQ(prefill->Stats().num_free_kv_blocks, prefill->Stats().num_kv_blocks);
  ASSERT_TRUE(decode->AddPrefilledRequest("x", prompt, p, reservation->seq, token).ok());
  run(*decode);
  EXPECT_EQ(decode->Find("x")->output, local->Find("x")->output);
}

TEST(LlamaCuda, OutOfDeviceMemoryIsResourceExhausted) {
  SKIP_WITHOUT_GPU();
  auto has = [](const absl::Status& s, const char* text) { return std::string(s.message()).find(text) != std::string::npos; };
  LlamaCudaOptions huge;
  huge.max_num_batched_tokens = 1 << 27;  // a ~275 GB residual stream
  absl::StatusOr<std::unique_ptr<LlamaCuda>> too_big = LlamaCuda::Load(ModelDir(), huge);
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted) << too_big.status();
  EXPECT_TRUE(has(too_big.status(), "out of device memory: residual needs")) << too_big.status();

  absl::StatusOr<std::unique_ptr<LlamaCuda>> model = LlamaCuda::Load(ModelDir(), {});
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<std::unique_ptr<cuda::DeviceKvCache>> cache = (*model)->CreateDeviceKvCache(4'000'000, 16);  // ~393 GB
  ASSERT_FALSE(cache.ok());
  EXPECT_EQ(cache.status().code(), absl::StatusCode::kResourceExhausted) << cache.status();
  EXPECT_TRUE(has(cache.status(), "bytes free on the device")) << cache.status();
  EXPECT_TRUE((*model)->CreateDeviceKvCache(64, 16).ok());

  EngineConfig config;
  config.model_dir = ModelDir();
  config.backend = "cuda";
  config.scheduler.max_num_batched_tokens = 1 << 27;
  absl::StatusOr<std::unique_ptr<LlmEngine>> engine = CreateEngine(config);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kResourceExhausted) << engine.status();

  // A KV cache larger than the device, asked for through the engine (ModelExecutor::CreateKvCache).
  EngineConfig big_cache;
  big_cache.model_dir = ModelDir();
  big_cache.backend = "cuda";
  big_cache.num_kv_blocks = 4'000'000;
  absl::StatusOr<std::unique_ptr<LlmEngine>> no_room = CreateEngine(big_cache);
  ASSERT_FALSE(no_room.ok());
  EXPECT_EQ(no_room.status().code(), absl::StatusCode::kResourceExhausted) << no_room.status();
  EXPECT_TRUE(has(no_room.status(), "bytes free on the device")) << no_room.status();
}

// Every reference case through the engine on the CUDA backend, all in one continuous batch.
// bf16 compute may flip a token only where the float32 reference's top-2 margin is tiny.
void ExpectGreedyMatchesReference(const std::string& speculation) {
  std::ifstream in(ModelDir() + "/reference_greedy.json");
  ASSERT_TRUE(in.good());
  const nlohmann::json reference = nlohmann::json::parse(in);
  EngineConfig config;
  config.model_dir = ModelDir();
  config.backend = "cuda";
  config.gpu_memory_utilization = 0.2;
  config.speculation.default_mode = *ParseSpeculationMode(speculation);
  config.speculation.adaptive = false;  // every request drafts every step: verification is exercised
  if (speculation == "draft") config.speculation.draft_model_dir = ModelDir() + "-draft";
  auto engine = CreateEngine(config);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const auto& cases = reference["cases"];
  for (size_t i = 0; i < cases.size(); ++i) {
    SamplingParams params;
    params.temperature = 0.0f;
    params.max_tokens = int32_t(cases[i]["greedy_ids"].size());
    params.ignore_eos = true;
    ASSERT_TRUE((*engine)->AddRequest(std::to_string(i), cases[i]["prompt_ids"].get<std::vector<int32_t>>(), params).ok());
  }
  std::map<std::string, std::vector<int32_t>> outputs;
  while ((*engine)->HasUnfinished()) {
    auto step = (*engine)->Step();
    ASSERT_TRUE(step.ok()) << step.status();
    for (const RequestOutput& out : *step) {
      auto& ids = outputs[out.id];
      ids.insert(ids.end(), out.new_token_ids.begin(), out.new_token_ids.end());
    }
  }
  int exact = 0, total_tokens = 0, agreeing_tokens = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto expected = cases[i]["greedy_ids"].get<std::vector<int32_t>>();
    const auto margins = cases[i]["top2_margins"].get<std::vector<double>>();
    const auto& got = outputs[std::to_string(i)];
    ASSERT_EQ(got.size(), expected.size());
    size_t first_diff = 0;
    while (first_diff < got.size() && got[first_diff] == expected[first_diff]) ++first_diff;
    total_tokens += int(expected.size());
    agreeing_tokens += int(first_diff);
    if (first_diff == got.size()) {
      ++exact;
      continue;
    }
    std::printf("case %zu diverges at token %zu (reference top-2 margin %.4f)\n", i, first_diff, margins[first_diff]);
    EXPECT_LT(margins[first_diff], 0.05) << "case " << i << " diverged where the reference was not close";
  }
  std::printf("CUDA greedy (speculation %s) vs HF float32 reference: %d/%zu cases exact, %d/%d tokens before any "
              "divergence\n", speculation.c_str(), exact, cases.size(), agreeing_tokens, total_tokens);
  if (speculation != "none") {
    const SpecDecodeStats stats = (*engine)->Stats().spec_decode;
    std::printf("  %lld drafts, %lld draft tokens, %lld accepted\n", (long long)stats.num_drafts,
                (long long)stats.num_draft_tokens, (long long)stats.num_accepted_tokens);
    EXPECT_GT(stats.num_drafts, 0);
  }
}

TEST(LlamaCuda, Bf16GreedyMatchesHuggingFaceReference) {
  SKIP_WITHOUT_GPU();
  ExpectGreedyMatchesReference("none");
}

// Lossless speculation on the device: the same criterion with every mode verifying drafts.
TEST(LlamaCuda, Bf16GreedyWithLookaheadMatchesHuggingFaceReference) {
  SKIP_WITHOUT_GPU();
  ExpectGreedyMatchesReference("lookahead");
}

TEST(LlamaCuda, Bf16GreedyWithDraftModelMatchesHuggingFaceReference) {
  SKIP_WITHOUT_GPU();
  ExpectGreedyMatchesReference("draft");
}

TEST(LlamaCuda, Bf16GreedyWithSelfSpeculationMatchesHuggingFaceReference) {
  SKIP_WITHOUT_GPU();
  ExpectGreedyMatchesReference("self");
}

}  // namespace
}  // namespace duet

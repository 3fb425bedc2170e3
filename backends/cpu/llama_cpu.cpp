#include "backends/cpu/llama_cpu.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "backends/cpu/cpu_attention.h"
#include "backends/cpu/cpu_gemv.h"
#include "backends/cpu/ring_attention.h"
#include "common/check.h"
#include "common/status_macros.h"
#include "common/parallel_for.h"
#include "engine/kv/kv_cache.h"
#include "parallel/host_communicator.h"
#include "parallel/zigzag.h"

namespace duet {
namespace {

// y[rows, n] = x[rows, k] · w[n, k]ᵀ  (w in Hugging Face [out_features, in_features] layout,
// packed), split across the shared pool's threads. Every product of every step goes through the
// batched GEMV, whose y[r, j] is one fixed-order chain whatever the step's rows and the thread
// count: a token's results then never depend on the other tokens of its step (prefix cache on
// or off, chunked or whole prefill, speculation) nor on the machine's cores. OpenBLAS sgemm sums
// in an order that varies with both.
void MatMulTransposed(const float* x, const PackedWeights& w, float* y, int64_t rows) {
  BatchedGemv(x, w, y, rows, &ParallelFor::Shared());
}

// Hugging Face LlamaRMSNorm in float32: x / sqrt(mean(x²) + eps) · weight.
void RmsNorm(const float* x, const float* weight, float* out, int64_t n, double eps) {
  double sum_squares = 0.0;
  for (int64_t i = 0; i < n; ++i) sum_squares += double(x[i]) * x[i];
  const float inv_rms = 1.0f / std::sqrt(float(sum_squares / double(n)) + float(eps));
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv_rms);
}

// What an attention row attends to, in position order: slots [0, direct), then `tree_tail` (a
// tree token's ancestors after the context, itself last). Causal rows are all direct.
struct RowContext {
  absl::Span<const int32_t> block_table;
  int64_t direct = 0;
  std::vector<int64_t> tree_tail;
  int64_t size() const { return direct + int64_t(tree_tail.size()); }
};

// One RowContext per token of the step; `total_context` gets the sum of their sizes.
std::vector<RowContext> RowContexts(absl::Span<const SequenceChunk> chunks, int64_t* total_context) {
  std::vector<RowContext> rows;
  for (const SequenceChunk& chunk : chunks) {
    for (size_t j = 0; j < chunk.tokens.size(); ++j) {
      RowContext& r = rows.emplace_back();
      r.block_table = chunk.block_table;
      if (chunk.tree_parents.empty()) {  // causal: positions [0, start + j]
        r.direct = chunk.start_position + int64_t(j) + 1;
      } else {
        r.direct = chunk.start_position;
        for (int64_t a = int64_t(j); a >= 0; a = chunk.tree_parents[size_t(a)]) {
          r.tree_tail.push_back(chunk.start_position + a);
        }
        std::reverse(r.tree_tail.begin(), r.tree_tail.end());
      }
      *total_context += r.size();
    }
  }
  return rows;
}

absl::Status ReadInto(const WeightStore& weights, const std::string& name,
                      std::vector<int64_t> shape, std::vector<float>& out, size_t offset = 0) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  if (out.size() < offset + size_t(numel)) out.resize(offset + size_t(numel));
  return weights.ReadFloat32(name, shape, absl::MakeSpan(out.data() + offset, size_t(numel)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<LlamaCpu>> LlamaCpu::Load(const std::string& model_dir) {
  absl::StatusOr<ModelConfig> config = LoadModelConfig(model_dir);
  if (!config.ok()) return config.status();
  absl::StatusOr<std::unique_ptr<WeightStore>> weights = WeightStore::Open(model_dir);
  if (!weights.ok()) return weights.status();
  return FromWeights(*config, **weights);
}

absl::StatusOr<std::unique_ptr<LlamaCpu>> LlamaCpu::FromWeights(const ModelConfig& config,
                                                                const WeightStore& weights) {
  std::unique_ptr<LlamaCpu> model(new LlamaCpu(config));
  if (absl::Status s = model->LoadWeights(weights); !s.ok()) return s;
  model->inv_freq_ = config.rope.InverseFrequencies(static_cast<int>(config.head_dim));
  return model;
}

absl::Status LlamaCpu::LoadWeights(const WeightStore& weights) {
  const ModelConfig& c = config_;
  const int64_t hidden = c.hidden_size, inter = c.intermediate_size, hd = c.head_dim;
  const int64_t q_rows = c.num_heads * hd, kv_rows = c.num_kv_heads * hd;
  absl::Status s;
  auto read = [&](const std::string& name, std::vector<int64_t> shape, std::vector<float>& out,
                  size_t offset = 0) {
    if (s.ok()) s = ReadInto(weights, name, std::move(shape), out, offset);
  };
  std::vector<float> matrix;  // the one being read, before it is packed
  // The matrices `parts` (name, rows) of `cols` columns stacked by rows, packed.
  auto read_packed = [&](const std::vector<std::pair<std::string, int64_t>>& parts, int64_t cols,
                         PackedWeights& out) {
    int64_t rows = 0;
    for (const auto& [name, part_rows] : parts) {
      read(name, {part_rows, cols}, matrix, size_t(rows * cols));
      rows += part_rows;
    }
    if (s.ok()) out = PackedWeights(matrix.data(), rows, cols);
  };
  read("model.norm.weight", {hidden}, final_norm_);
  if (c.tie_word_embeddings) {
    read_packed({{"model.embed_tokens.weight", c.vocab_size}}, hidden, lm_head_);
  } else {
    if (!weights.Has("lm_head.weight")) {
      return absl::InvalidArgumentError(
          "checkpoint has no lm_head.weight and config.json does not tie word embeddings");
    }
    read_packed({{"model.embed_tokens.weight", c.vocab_size}}, hidden, embed_);
    read_packed({{"lm_head.weight", c.vocab_size}}, hidden, lm_head_);
  }
  layers_.resize(c.num_layers);
  for (int64_t i = 0; i < c.num_layers && s.ok(); ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    Layer& l = layers_[i];
    read(p + "input_layernorm.weight", {hidden}, l.input_norm);
    read(p + "post_attention_layernorm.weight", {hidden}, l.post_norm);
    read_packed({{p + "self_attn.q_proj.weight", q_rows},
                 {p + "self_attn.k_proj.weight", kv_rows},
                 {p + "self_attn.v_proj.weight", kv_rows}},
                hidden, l.qkv);
    if (c.qkv_bias) {
      read(p + "self_attn.q_proj.bias", {q_rows}, l.qkv_bias, 0);
      read(p + "self_attn.k_proj.bias", {kv_rows}, l.qkv_bias, q_rows);
      read(p + "self_attn.v_proj.bias", {kv_rows}, l.qkv_bias, q_rows + kv_rows);
    }
    read_packed({{p + "self_attn.o_proj.weight", hidden}}, q_rows, l.o);
    if (c.o_bias) read(p + "self_attn.o_proj.bias", {hidden}, l.o_bias);
    read_packed({{p + "mlp.gate_proj.weight", inter}, {p + "mlp.up_proj.weight", inter}}, hidden, l.gate_up);
    read_packed({{p + "mlp.down_proj.weight", hidden}}, inter, l.down);
    if (c.mlp_bias) return absl::UnimplementedError("mlp_bias is not supported");
  }
  return s;
}

void LlamaCpu::ApplyRope(float* vec, int64_t num_heads, int64_t position) const {
  const int64_t half = config_.head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    // As transformers: the angle is a float32 product, cos/sin of that float32 value.
    const float angle = inv_freq_[i] * static_cast<float>(position);
    const float c = static_cast<float>(std::cos(double(angle)));
    const float s = static_cast<float>(std::sin(double(angle)));
    for (int64_t h = 0; h < num_heads; ++h) {
      float* x = vec + h * config_.head_dim;
      const float x1 = x[i], x2 = x[i + half];
      x[i] = x1 * c - x2 * s;
      x[i + half] = x2 * c + x1 * s;
    }
  }
}

void LlamaCpu::WriteStepKv(absl::Span<const SequenceChunk> chunks, int64_t layer, const float* qkv,
                           HostKvCache& cache) const {
  const int64_t hd = config_.head_dim, nh = config_.num_heads, nkv = config_.num_kv_heads;
  const int64_t qkv_stride = (nh + 2 * nkv) * hd;
  const int64_t bs = cache.shape().block_size;
  float* kpool = cache.keys(layer);
  float* vpool = cache.values(layer);
  // Token j of a chunk goes to slot start_position + j (for a tree, not its position).
  int64_t row = 0;
  for (const SequenceChunk& chunk : chunks) {
    for (size_t j = 0; j < chunk.tokens.size(); ++j, ++row) {
      const int64_t slot_index = chunk.start_position + int64_t(j);
      const int64_t block = chunk.block_table[slot_index / bs], slot = slot_index % bs;
      const float* k = qkv + row * qkv_stride + nh * hd;
      const float* v = k + nkv * hd;
      for (int64_t g = 0; g < nkv; ++g) {
        std::copy_n(k + g * hd, hd, kpool + cache.Offset(block, g, slot));
        std::copy_n(v + g * hd, hd, vpool + cache.Offset(block, g, slot));
      }
    }
  }
}

void LlamaCpu::Attention(absl::Span<const SequenceChunk> chunks, int64_t layer, const float* qkv,
                         HostKvCache& cache, float* out) const {
  const int64_t hd = config_.head_dim, nh = config_.num_heads, nkv = config_.num_kv_heads;
  const int64_t group = nh / nkv;
  const int64_t qkv_stride = (nh + 2 * nkv) * hd;
  const int64_t bs = cache.shape().block_size;
  float* kpool = cache.keys(layer);
  float* vpool = cache.values(layer);

  // Write this step's keys and values first: a token attends to earlier tokens of its own chunk.
  WriteStepKv(chunks, layer, qkv, cache);
  int64_t total_context = 0;
  const std::vector<RowContext> rows = RowContexts(chunks, &total_context);

  // Every (row, head) is independent and one thread's work: the same sums in the same order
  // however the pairs are split (AttendHead).
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  auto attend = [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<KvRun> runs;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / nh, h = item % nh, g = h / group;
      const RowContext& r = rows[size_t(row)];
      runs.clear();
      for (int64_t first = 0; first < r.direct; first += bs) {  // a block's slots are consecutive
        const int64_t offset = cache.Offset(r.block_table[first / bs], g, 0);
        runs.push_back({kpool + offset, vpool + offset, std::min(bs, r.direct - first)});
      }
      for (int64_t t : r.tree_tail) {
        const int64_t offset = cache.Offset(r.block_table[t / bs], g, t % bs);
        runs.push_back({kpool + offset, vpool + offset, 1});
      }
      scores.resize(size_t(r.size()));
      AttendHead(qkv + row * qkv_stride + h * hd, runs, hd, scale, scores.data(), out + row * nh * hd + h * hd);
    }
  };
  const int64_t items = int64_t(rows.size()) * nh;
  // Below this many multiply-adds the workers' wake-up costs more than they save.
  constexpr int64_t kMinParallelWork = int64_t(1) << 16;
  ParallelFor& pool = ParallelFor::Shared();
  if (total_context * nh * hd < kMinParallelWork || pool.num_threads() == 1) {
    attend(0, items);
    return;
  }
  const int64_t parts = pool.num_threads();
  pool.Run([&](int part) { attend(items * part / parts, items * (part + 1) / parts); });
}

absl::StatusOr<std::unique_ptr<KvCache>> LlamaCpu::CreateKvCache(int64_t num_blocks, int64_t block_size) {
  DUET_ASSIGN_OR_RETURN(std::unique_ptr<HostKvCache> cache,
                        HostKvCache::Create(KvCacheShape{config_.num_layers, num_blocks, config_.num_kv_heads,
                                                         block_size, config_.head_dim}));
  return cache;
}

absl::Status LlamaCpu::Forward(absl::Span<const SequenceChunk> chunks, KvCache& kv_cache,
                               std::vector<float>& logits, const LayerDoneCallback& on_layer_done) {
  return ForwardLayers(chunks, kv_cache, logits, config_.num_layers, on_layer_done);
}

absl::Status LlamaCpu::ForwardLayers(absl::Span<const SequenceChunk> chunks, KvCache& kv_cache,
                                     std::vector<float>& logits, int64_t num_layers,
                                     const LayerDoneCallback& on_layer_done) {
  if (num_layers < 1 || num_layers > config_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("cannot run ", num_layers, " of ", config_.num_layers, " layers"));
  }
  auto* host_cache = dynamic_cast<HostKvCache*>(&kv_cache);
  if (host_cache == nullptr) return absl::InvalidArgumentError("the CPU backend needs a host KV cache");
  HostKvCache& cache = *host_cache;
  if (absl::Status s = CheckChunks(chunks, cache.shape().block_size); !s.ok()) return s;
  int64_t num_tokens = 0;
  for (const SequenceChunk& chunk : chunks) num_tokens += int64_t(chunk.tokens.size());
  if (num_tokens == 0) {
    logits.clear();
    return absl::OkStatus();
  }

  if (RunsSequenceParallel(chunks)) return ForwardSequenceParallel(chunks[0], cache, logits, num_layers, on_layer_done);

  StepBuffers b = Embed(chunks, num_tokens);
  for (int64_t li = 0; li < num_layers; ++li) {
    const Layer& l = layers_[li];
    ProjectQkv(l, b);
    Attention(chunks, li, b.qkv.data(), cache, b.attn.data());
    if (on_layer_done) on_layer_done(li, chunks);
    if (li + 1 == num_layers) KeepLogitRows(chunks, b);
    AddAttentionOutput(l, b);
    AddMlpOutput(l, b);
  }
  ComputeLogits(b, logits);
  return absl::OkStatus();
}

void LlamaCpu::EnableSequenceParallel(int ranks, int64_t min_tokens) {
  sp_ranks_ = std::max(1, ranks);
  sp_min_tokens_ = min_tokens;
}

bool LlamaCpu::RunsSequenceParallel(absl::Span<const SequenceChunk> chunks) const {
  if (sp_ranks_ <= 1 || chunks.size() != 1) return false;
  const SequenceChunk& c = chunks[0];
  const int64_t n = int64_t(c.tokens.size());
  // The logits rows must all lie in the last zigzag chunk, which rank 0 holds.
  const std::vector<parallel::TokenChunk> shards = parallel::ZigzagChunks(n, sp_ranks_);
  return c.start_position == 0 && c.tree_parents.empty() && n >= std::max<int64_t>(sp_min_tokens_, 2 * sp_ranks_) &&
         c.num_logits <= shards.back().end - shards.back().begin;
}

absl::Status LlamaCpu::ForwardSequenceParallel(const SequenceChunk& chunk, HostKvCache& cache,
                                               std::vector<float>& logits, int64_t num_layers,
                                               const LayerDoneCallback& on_layer_done) {
  const ModelConfig& c = config_;
  const int64_t nh = c.num_heads, nkv = c.num_kv_heads, hd = c.head_dim;
  const int64_t qkv_stride = (nh + 2 * nkv) * hd;
  const AttentionShape shape{nh, nkv, hd, 1.0f / std::sqrt(static_cast<float>(hd))};
  const int64_t n = int64_t(chunk.tokens.size());
  const std::vector<parallel::TokenChunk> shards = parallel::ZigzagChunks(n, sp_ranks_);
  std::vector<std::unique_ptr<parallel::Communicator>> comms = parallel::CreateHostCommunicators(sp_ranks_);
  std::vector<absl::Status> status(static_cast<size_t>(sp_ranks_));

  auto run_rank = [&](int rank) {
    parallel::Communicator& comm = *comms[size_t(rank)];
    // The rank's two zigzag chunks as two chunks of the same sequence: Embed and WriteStepKv
    // then place them at their positions and slots.
    std::vector<SequenceChunk> mine;
    for (int index : parallel::ChunksOfRank(rank, sp_ranks_)) {
      const parallel::TokenChunk& t = shards[size_t(index)];
      SequenceChunk part;
      part.sequence_id = chunk.sequence_id;
      part.start_position = t.begin;
      part.tokens = chunk.tokens.subspan(size_t(t.begin), size_t(t.end - t.begin));
      part.block_table = chunk.block_table;
      part.num_logits = t.end == n ? chunk.num_logits : 0;
      mine.push_back(std::move(part));
    }
    int64_t local = 0;
    for (const SequenceChunk& part : mine) local += int64_t(part.tokens.size());
    StepBuffers b = Embed(mine, local);
    std::vector<float> k(size_t(local * nkv * hd)), v(k.size());
    for (int64_t li = 0; li < num_layers && status[size_t(rank)].ok(); ++li) {
      const Layer& l = layers_[size_t(li)];
      ProjectQkv(l, b);
      WriteStepKv(mine, li, b.qkv.data(), cache);
      std::vector<float> q(size_t(local * nh * hd));
      for (int64_t row = 0; row < local; ++row) {
        const float* r = b.qkv.data() + row * qkv_stride;
        std::copy_n(r, nh * hd, q.data() + row * nh * hd);
        std::copy_n(r + nh * hd, nkv * hd, k.data() + row * nkv * hd);
        std::copy_n(r + (nh + nkv) * hd, nkv * hd, v.data() + row * nkv * hd);
      }
      status[size_t(rank)] = RingAttention(shape, q, k, v, b.positions, comm, b.attn);
      if (!status[size_t(rank)].ok()) break;
      // The hook sees the layer once every rank's K/V is in the cache.
      if (on_layer_done) {
        if (absl::Status s = comm.Barrier(); !s.ok()) status[size_t(rank)] = s;
        if (rank == 0) on_layer_done(li, absl::MakeConstSpan(&chunk, 1));
      }
      if (li + 1 == num_layers) KeepLogitRows(mine, b);  // none on ranks other than 0
      AddAttentionOutput(l, b);
      AddMlpOutput(l, b);
    }
    if (rank == 0 && status[0].ok()) ComputeLogits(b, logits);
  };
  std::vector<std::thread> ranks;
  for (int rank = 1; rank < sp_ranks_; ++rank) ranks.emplace_back(run_rank, rank);
  run_rank(0);
  for (std::thread& t : ranks) t.join();
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status LlamaCpu::CheckChunks(absl::Span<const SequenceChunk> chunks, int64_t block_size) const {
  for (const SequenceChunk& chunk : chunks) {
    const int64_t end = chunk.start_position + int64_t(chunk.tokens.size());
    if (end > int64_t(chunk.block_table.size()) * block_size) {
      return absl::InternalError("block table too short for the chunk");
    }
    if (chunk.num_logits < 0 || chunk.num_logits > int32_t(chunk.tokens.size())) {
      return absl::InternalError("num_logits exceeds the chunk");
    }
    if (!chunk.tree_parents.empty()) {
      if (chunk.tree_parents.size() != chunk.tokens.size() || chunk.tree_parents[0] != -1) {
        return absl::InternalError("a draft tree needs one parent per token and token 0 as its root");
      }
      for (size_t j = 1; j < chunk.tree_parents.size(); ++j) {
        if (chunk.tree_parents[j] < 0 || chunk.tree_parents[j] >= int32_t(j)) {
          return absl::InternalError("a draft tree token's parent must come before it");
        }
      }
    }
    for (int32_t id : chunk.tokens) {
      if (id < 0 || id >= config_.vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("token id ", id, " outside the vocabulary [0, ", config_.vocab_size, ")"));
      }
    }
  }
  return absl::OkStatus();
}

LlamaCpu::StepBuffers LlamaCpu::Embed(absl::Span<const SequenceChunk> chunks, int64_t num_tokens) const {
  const ModelConfig& c = config_;
  const int64_t hidden = c.hidden_size, inter = c.intermediate_size;
  const int64_t q_width = c.num_heads * c.head_dim;
  StepBuffers b;
  b.num_tokens = num_tokens;
  b.x.resize(size_t(num_tokens * hidden));
  b.h.resize(size_t(num_tokens * hidden));
  b.qkv.resize(size_t(num_tokens * (q_width + 2 * c.num_kv_heads * c.head_dim)));
  b.attn.resize(size_t(num_tokens * q_width));
  b.gate_up.resize(size_t(num_tokens * 2 * inter));
  b.act.resize(size_t(num_tokens * inter));
  b.positions.reserve(size_t(num_tokens));

  int64_t row = 0;
  std::vector<int64_t> depths;  // a tree token's position is start + its depth in the tree
  for (const SequenceChunk& chunk : chunks) {
    depths.assign(chunk.tokens.size(), 0);
    for (size_t j = 0; j < chunk.tokens.size(); ++j, ++row) {
      float* x = b.x.data() + row * hidden;
      (c.tie_word_embeddings ? lm_head_ : embed_).CopyRow(chunk.tokens[j], x);
      if (!chunk.tree_parents.empty() && j > 0) depths[j] = depths[size_t(chunk.tree_parents[j])] + 1;
      b.positions.push_back(chunk.start_position + (chunk.tree_parents.empty() ? int64_t(j) : depths[j]));
    }
  }
  return b;
}

void LlamaCpu::ProjectQkv(const Layer& l, StepBuffers& b) const {
  const ModelConfig& c = config_;
  const int64_t hidden = c.hidden_size, nh = c.num_heads, nkv = c.num_kv_heads;
  const int64_t qkv_width = (nh + 2 * nkv) * c.head_dim;
  for (int64_t t = 0; t < b.num_tokens; ++t) {
    RmsNorm(b.x.data() + t * hidden, l.input_norm.data(), b.h.data() + t * hidden, hidden, c.rms_norm_eps);
  }
  MatMulTransposed(b.h.data(), l.qkv, b.qkv.data(), b.num_tokens);
  for (int64_t t = 0; t < b.num_tokens; ++t) {
    float* r = b.qkv.data() + t * qkv_width;
    if (!l.qkv_bias.empty()) {
      for (int64_t i = 0; i < qkv_width; ++i) r[i] += l.qkv_bias[i];
    }
    ApplyRope(r, nh, b.positions[t]);                    // queries
    ApplyRope(r + nh * c.head_dim, nkv, b.positions[t]);  // keys
  }
}

void LlamaCpu::AddAttentionOutput(const Layer& l, StepBuffers& b) const {
  const int64_t hidden = config_.hidden_size;
  MatMulTransposed(b.attn.data(), l.o, b.h.data(), b.num_tokens);
  for (int64_t t = 0; t < b.num_tokens; ++t) {
    float* xr = b.x.data() + t * hidden;
    const float* hr = b.h.data() + t * hidden;
    for (int64_t i = 0; i < hidden; ++i) xr[i] += hr[i] + (l.o_bias.empty() ? 0.0f : l.o_bias[i]);
  }
}

void LlamaCpu::AddMlpOutput(const Layer& l, StepBuffers& b) const {
  const ModelConfig& c = config_;
  const int64_t hidden = c.hidden_size, inter = c.intermediate_size;
  for (int64_t t = 0; t < b.num_tokens; ++t) {
    RmsNorm(b.x.data() + t * hidden, l.post_norm.data(), b.h.data() + t * hidden, hidden, c.rms_norm_eps);
  }
  MatMulTransposed(b.h.data(), l.gate_up, b.gate_up.data(), b.num_tokens);
  for (int64_t t = 0; t < b.num_tokens; ++t) {  // SiLU(gate) · up
    const float* g = b.gate_up.data() + t * 2 * inter;
    const float* u = g + inter;
    float* a = b.act.data() + t * inter;
    for (int64_t i = 0; i < inter; ++i) a[i] = (g[i] / (1.0f + std::exp(-g[i]))) * u[i];
  }
  MatMulTransposed(b.act.data(), l.down, b.h.data(), b.num_tokens);
  for (int64_t i = 0; i < b.num_tokens * hidden; ++i) b.x[size_t(i)] += b.h[size_t(i)];
}

void LlamaCpu::KeepLogitRows(absl::Span<const SequenceChunk> chunks, StepBuffers& b) const {
  const int64_t hidden = config_.hidden_size, q_width = config_.num_heads * config_.head_dim;
  int64_t row = 0, kept = 0;
  for (const SequenceChunk& chunk : chunks) {
    const int64_t n = int64_t(chunk.tokens.size());
    // Rows move only toward the front (kept <= the source row), so in place, in order.
    for (int64_t j = n - chunk.num_logits; j < n; ++j, ++kept) {
      std::copy_n(b.x.data() + (row + j) * hidden, hidden, b.x.data() + kept * hidden);
      std::copy_n(b.attn.data() + (row + j) * q_width, q_width, b.attn.data() + kept * q_width);
    }
    row += n;
  }
  b.num_tokens = kept;
}

void LlamaCpu::ComputeLogits(const StepBuffers& b, std::vector<float>& logits) const {
  const ModelConfig& c = config_;
  const int64_t hidden = c.hidden_size;
  std::vector<float> normed(size_t(b.num_tokens * hidden));
  for (int64_t row = 0; row < b.num_tokens; ++row) {
    RmsNorm(b.x.data() + row * hidden, final_norm_.data(), normed.data() + row * hidden, hidden, c.rms_norm_eps);
  }
  logits.resize(size_t(b.num_tokens * c.vocab_size));
  MatMulTransposed(normed.data(), lm_head_, logits.data(), b.num_tokens);
}

absl::Status LlamaCpu::MoveKvSlots(KvCache& kv_cache, absl::Span<const int32_t> block_table,
                                   absl::Span<const KvSlotMove> moves) {
  auto* host_cache = dynamic_cast<HostKvCache*>(&kv_cache);
  if (host_cache == nullptr) return absl::InvalidArgumentError("the CPU backend needs a host KV cache");
  HostKvCache& cache = *host_cache;
  const int64_t bs = cache.shape().block_size, hd = config_.head_dim;
  const int64_t capacity = int64_t(block_table.size()) * bs;
  for (const KvSlotMove& m : moves) {
    if (m.from < 0 || m.to < 0 || m.from >= capacity || m.to >= capacity) {
      return absl::InternalError("KV slot move outside the sequence's blocks");
    }
  }
  for (int64_t layer = 0; layer < cache.shape().num_layers; ++layer) {
    for (const KvSlotMove& m : moves) {
      for (int64_t g = 0; g < config_.num_kv_heads; ++g) {
        const int64_t from = cache.Offset(block_table[m.from / bs], g, m.from % bs);
        const int64_t to = cache.Offset(block_table[m.to / bs], g, m.to % bs);
        std::copy_n(cache.keys(layer) + from, hd, cache.keys(layer) + to);
        std::copy_n(cache.values(layer) + from, hd, cache.values(layer) + to);
      }
    }
  }
  return absl::OkStatus();
}

namespace {

// The first layers of a LlamaCpu as a draft model, sharing its weights and KV cache.
class LlamaCpuLayerPrefix : public ModelExecutor {
 public:
  LlamaCpuLayerPrefix(LlamaCpu& model, int64_t num_layers) : model_(model), num_layers_(num_layers) {}

  const ModelConfig& config() const override { return model_.config(); }
  KvDtype kv_dtype() const override { return model_.kv_dtype(); }
  absl::StatusOr<std::unique_ptr<KvCache>> CreateKvCache(int64_t num_blocks, int64_t block_size) override {
    return model_.CreateKvCache(num_blocks, block_size);
  }
  absl::Status Forward(absl::Span<const SequenceChunk> chunks, KvCache& cache, std::vector<float>& logits,
                       const LayerDoneCallback& on_layer_done = nullptr) override {
    return model_.ForwardLayers(chunks, cache, logits, num_layers_, on_layer_done);
  }
  bool SupportsTreeAttention() const override { return true; }
  absl::Status MoveKvSlots(KvCache& cache, absl::Span<const int32_t> block_table,
                           absl::Span<const KvSlotMove> moves) override {
    return model_.MoveKvSlots(cache, block_table, moves);
  }

 private:
  LlamaCpu& model_;
  int64_t num_layers_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ModelExecutor>> LlamaCpu::LayerPrefix(int64_t num_layers) {
  if (absl::Status s = CheckLayerPrefix(config_, num_layers); !s.ok()) return s;
  return std::make_unique<LlamaCpuLayerPrefix>(*this, num_layers);
}

}  // namespace duet

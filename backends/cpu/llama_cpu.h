// The Llama-family transformer (Llama 2/3/3.1, Mistral, Qwen2/2.5) on the CPU, float32 compute
// from bf16/fp16/fp32 weights, every product through the batched GEMV (cpu_gemv.h), so a token's
// results are the same bits whatever else shares its step. The numerical reference for every
// other backend: greedy output matches Hugging Face transformers' float32 forward.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "backends/cpu/cpu_gemv.h"
#include "engine/model_executor.h"
#include "model/safetensors.h"

namespace duet {

class LlamaCpu : public ModelExecutor {
 public:
  static absl::StatusOr<std::unique_ptr<LlamaCpu>> Load(const std::string& model_dir);
  static absl::StatusOr<std::unique_ptr<LlamaCpu>> FromWeights(const ModelConfig& config,
                                                               const WeightStore& weights);

  const ModelConfig& config() const override { return config_; }
  KvDtype kv_dtype() const override { return KvDtype::kFloat32; }
  absl::StatusOr<std::unique_ptr<KvCache>> CreateKvCache(int64_t num_blocks, int64_t block_size) override;
  absl::Status Forward(absl::Span<const SequenceChunk> chunks, KvCache& cache,
                       std::vector<float>& logits,
                       const LayerDoneCallback& on_layer_done = nullptr) override;
  bool SupportsTreeAttention() const override { return true; }
  absl::Status MoveKvSlots(KvCache& cache, absl::Span<const int32_t> block_table,
                           absl::Span<const KvSlotMove> moves) override;
  absl::StatusOr<std::unique_ptr<ModelExecutor>> LayerPrefix(int64_t num_layers) override;

  // Forward through the first `num_layers` layers only, then the final norm and LM head.
  absl::Status ForwardLayers(absl::Span<const SequenceChunk> chunks, KvCache& cache, std::vector<float>& logits,
                             int64_t num_layers, const LayerDoneCallback& on_layer_done = nullptr);

  // Sequence-parallel prefill over `ranks` threads of this process (ring attention with a host
  // communicator, zigzag shards): a step that is one prompt from position 0 with at least
  // `min_tokens` tokens (and no draft tree) runs on the ranks; every other step as before.
  // ranks 1: off.
  void EnableSequenceParallel(int ranks, int64_t min_tokens);
  int sequence_parallel_ranks() const { return sp_ranks_; }

 private:
  // The matrices packed for BatchedGemv; their shapes are HF's [out_features, in_features].
  struct Layer {
    std::vector<float> input_norm;      // [hidden]
    PackedWeights qkv;                  // [(heads + 2 * kv_heads) * head_dim, hidden]
    std::vector<float> qkv_bias;        // [(heads + 2 * kv_heads) * head_dim] or empty
    PackedWeights o;                    // [hidden, heads * head_dim]
    std::vector<float> o_bias;          // [hidden] or empty
    std::vector<float> post_norm;       // [hidden]
    PackedWeights gate_up;              // [2 * intermediate, hidden]: gate rows then up rows
    PackedWeights down;                 // [hidden, intermediate]
  };

  // One forward's activations, [T, width] row-major over the step's T tokens.
  struct StepBuffers {
    int64_t num_tokens = 0;
    std::vector<float> x;          // residual stream [T, hidden]
    std::vector<float> h;          // normed / projected [T, hidden]
    std::vector<float> qkv;        // [T, (nh + 2 nkv) hd]
    std::vector<float> attn;       // [T, nh hd]
    std::vector<float> gate_up;    // [T, 2 intermediate]
    std::vector<float> act;        // [T, intermediate]
    std::vector<int64_t> positions;  // [T]
  };

  explicit LlamaCpu(const ModelConfig& config) : config_(config) {}
  absl::Status LoadWeights(const WeightStore& weights);
  // The chunks' shape: block tables, logits rows, tree parents, token ids in the vocabulary.
  absl::Status CheckChunks(absl::Span<const SequenceChunk> chunks, int64_t block_size) const;
  // The step's buffers with x holding the tokens' embeddings and `positions` theirs.
  StepBuffers Embed(absl::Span<const SequenceChunk> chunks, int64_t num_tokens) const;
  // A layer in four parts: qkv = RoPE(QKV(norm(x))); attn = Attention(qkv) (which writes the
  // layer's K/V); x += O(attn); x += down(SiLU(gate) · up) of norm(x).
  void ProjectQkv(const Layer& l, StepBuffers& b) const;
  void AddAttentionOutput(const Layer& l, StepBuffers& b) const;
  void AddMlpOutput(const Layer& l, StepBuffers& b) const;
  // Before the last layer's output projection: keeps only the rows that need logits (each
  // chunk's last num_logits), moved to the front of x and attn. Their hidden state is all the LM
  // head reads, and the other rows' K/V of that layer are already in the cache.
  void KeepLogitRows(absl::Span<const SequenceChunk> chunks, StepBuffers& b) const;
  // The final norm and LM head for every row of b (the rows KeepLogitRows kept).
  void ComputeLogits(const StepBuffers& b, std::vector<float>& logits) const;
  // Writes this step's K/V (already rotated) into the cache, then attends: causally, or within
  // a draft tree to the context and the token's ancestors (SequenceChunk::tree_parents).
  void WriteStepKv(absl::Span<const SequenceChunk> chunks, int64_t layer, const float* qkv, HostKvCache& cache) const;
  void Attention(absl::Span<const SequenceChunk> chunks, int64_t layer, const float* qkv,
                 HostKvCache& cache, float* out) const;
  // Whether the step qualifies for sequence-parallel prefill (EnableSequenceParallel).
  bool RunsSequenceParallel(absl::Span<const SequenceChunk> chunks) const;
  // The step on sp_ranks_ threads: each rank its zigzag shard through every layer; the layer's
  // K/V land in `cache` before the hook sees it, the logits rows come from the rank holding the
  // prompt's end.
  absl::Status ForwardSequenceParallel(const SequenceChunk& chunk, HostKvCache& cache, std::vector<float>& logits,
                                       int64_t num_layers, const LayerDoneCallback& on_layer_done);
  void ApplyRope(float* vec, int64_t num_heads, int64_t position) const;

  ModelConfig config_;
  // The embeddings are packed like a product's weights (bf16 stays bf16); the lookup gathers a
  // token's row (PackedWeights::CopyRow). Tied ones are kept once, as the LM head, and embed_ is
  // empty.
  PackedWeights embed_;            // [vocab, hidden] or empty
  std::vector<float> final_norm_;  // [hidden]
  PackedWeights lm_head_;          // [vocab, hidden]
  std::vector<Layer> layers_;
  std::vector<float> inv_freq_;    // [head_dim / 2]
  int sp_ranks_ = 1;                // EnableSequenceParallel
  int64_t sp_min_tokens_ = 0;
};

}  // namespace duet

// The Llama family (Llama 2/3/3.1, Mistral, Qwen2/2.5) on an NVIDIA GPU: bf16 weights resident
// on the device, an fp32 residual stream, cuBLAS for the projections, Duet's kernels for
// everything else, the bf16 KV cache in device memory, and decode steps replayed from CUDA graphs
// captured per batch-size bucket. Stream-ordered: the only host synchronization in a step is
// reading its results (logits or sampled token ids).
#pragma once

#include <map>
#include <tuple>
#include <memory>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "absl/status/statusor.h"
#include "backends/cuda/cublas_linear.h"
#include "backends/cuda/device_kv_cache.h"
#include "backends/cuda/device_memory.h"
#include "engine/model_executor.h"
#include "model/safetensors.h"

namespace duet {

struct StepMetadataLayout;

struct LlamaCudaOptions {
  int device = 0;
  int max_num_seqs = 256;               // sequences in one step
  int max_num_batched_tokens = 8192;    // tokens in one step (activation buffers are sized by it)
  int64_t max_model_len = 0;            // 0: the model's max_position_embeddings
  bool cuda_graphs = true;              // replay decode steps from graphs
  // Launch Duet's kernels with programmatic dependent launch (kernels/launch.h; a process-wide
  // setting, applied when the executor loads): each kernel's start overlaps the previous one's tail.
  bool programmatic_launch = true;
  // Skinny decode batches compute RoPE + the KV write and SiLU·mul in the projections' epilogues
  // (kernels/gemv.h); off: as separate kernels (for comparison).
  bool fused_decode_epilogues = true;
  // Logits rows one head pass computes (at least max_num_seqs): a step verifying draft trees
  // gives a row per token and replays a graph only when its rows fit one pass. Device memory:
  // rows * vocab * 4 bytes.
  int max_logit_rows = 0;
};

class LlamaCuda : public ModelExecutor {
 public:
  static absl::StatusOr<std::unique_ptr<LlamaCuda>> Load(const std::string& model_dir, const LlamaCudaOptions& options);
  ~LlamaCuda() override;

  const ModelConfig& config() const override { return config_; }
  KvDtype kv_dtype() const override { return KvDtype::kBFloat16; }
  std::unique_ptr<KvCache> CreateKvCache(int64_t num_blocks, int64_t block_size) override;
  std::optional<int64_t> DeviceKvBudgetBytes(double memory_fraction) const override;

  absl::Status Forward(absl::Span<const SequenceChunk> chunks, KvCache& cache, std::vector<float>& logits,
                       const LayerDoneCallback& on_layer_done = nullptr) override;
  bool CanSampleOnDevice() const override { return true; }
  absl::Status ForwardSample(absl::Span<const SequenceChunk> chunks, KvCache& cache,
                             absl::Span<const DeviceSamplingRow> rows, std::vector<DeviceSample>& samples,
                             const LayerDoneCallback& on_layer_done = nullptr) override;

  // Speculative verification: draft trees attend through per-token ancestor masks (at most 64
  // tokens per tree); the accepted path's K/V move on the device, stream-ordered.
  bool SupportsTreeAttention() const override { return true; }
  absl::Status MoveKvSlots(KvCache& cache, absl::Span<const int32_t> block_table,
                           absl::Span<const KvSlotMove> moves) override;
  absl::StatusOr<std::unique_ptr<ModelExecutor>> LayerPrefix(int64_t num_layers) override;
  // Captures the sampling decode graph of every batch bucket and the verification graph of
  // every batch and token bucket a step of up to max_num_seqs sequences with up to
  // `max_draft_tokens` drafts each can take.
  absl::Status WarmUpVerification(KvCache& cache, int32_t max_draft_tokens) override {
    return WarmUpGraphs(cache, max_draft_tokens, int(layers_.size()));
  }
  // The same for the first `num_layers` layers (a self-speculation draft).
  absl::Status WarmUpGraphs(KvCache& cache, int32_t max_draft_tokens, int num_layers);
  int64_t num_one_time_setups() const override { return num_graph_captures_; }

  // Run with only the first `num_layers` layers, then the final norm and LM head (what
  // LayerPrefix's executor calls). Either logits or samples is null.
  absl::Status RunLayers(absl::Span<const SequenceChunk> chunks, KvCache& cache,
                         absl::Span<const DeviceSamplingRow> sampling, const LayerDoneCallback& on_layer_done,
                         std::vector<float>* logits, std::vector<DeviceSample>* samples, int num_layers);

  cudaStream_t stream() const { return stream_; }
  int64_t weight_bytes() const { return weight_bytes_; }

 private:
  struct Layer {
    const __nv_bfloat16* input_norm;  // [hidden]
    const __nv_bfloat16* qkv;         // [(heads + 2 * kv_heads) * head_dim, hidden]
    const __nv_bfloat16* qkv_bias;    // [(heads + 2 * kv_heads) * head_dim] or null
    const __nv_bfloat16* o;           // [hidden, heads * head_dim]
    const __nv_bfloat16* o_bias;      // [hidden] or null
    const __nv_bfloat16* post_norm;   // [hidden]
    const __nv_bfloat16* gate_up;     // [2 * intermediate, hidden]: gate rows then up rows
    const __nv_bfloat16* down;        // [hidden, intermediate]
  };
  // Host-side description of one step, uploaded before it runs.
  struct StepPlan;

  LlamaCuda(const ModelConfig& config, const LlamaCudaOptions& options);
  absl::Status Init(const WeightStore& weights);
  absl::Status LoadWeights(const WeightStore& weights);
  absl::Status AllocateActivations();

  absl::StatusOr<StepPlan> PlanStep(absl::Span<const SequenceChunk> chunks, int block_size) const;
  void Upload(const StepPlan& plan, absl::Span<const DeviceSamplingRow> sampling);
  // Pads a decode step to `batch` sequences (its graph's bucket) with rows that write nothing.
  void PadForGraph(StepPlan& plan, int batch) const;
  // Pads a verification step to `batch` sequences and `tokens` rows (its graph's buckets).
  void PadTreeStepForGraph(StepPlan& plan, int batch, int tokens) const;
  // Enqueues the whole step (embedding → the first num_layers layers → logits → optional
  // sampling) on stream_.
  void Enqueue(const StepPlan& plan, cuda::DeviceKvCache& cache, bool sample,
               absl::Span<const SequenceChunk> chunks, const LayerDoneCallback& on_layer_done, int num_layers);
  absl::Status LaunchGraph(const StepPlan& plan, cuda::DeviceKvCache& cache, bool sample, int num_layers);
  // Samples logits rows [first_row, first_row + rows) (in logits_ from its row 0) with the
  // uploaded per-row parameters.
  void EnqueueSampling(int first_row, int rows);
  // Copies logits rows [0, rows) of the last head pass to `dst` (through the pinned buffer).
  absl::Status CopyLogitsToHost(int rows, float* dst);
  // The logits head for eager steps, in passes of at most max_logit_rows_ rows.
  absl::Status EagerHead(const StepPlan& plan, bool sample, std::vector<float>* logits, std::vector<DeviceSample>* samples);

  ModelConfig config_;
  LlamaCudaOptions options_;
  cudaStream_t stream_ = nullptr;
  int num_sms_ = 0;
  cuda::DeviceArena arena_;
  std::vector<cuda::DeviceAllocation> weight_allocations_;
  int64_t weight_bytes_ = 0;
  std::unique_ptr<cuda::CublasLinear> linear_;

  const __nv_bfloat16* embed_ = nullptr;       // [vocab, hidden]
  const __nv_bfloat16* final_norm_ = nullptr;  // [hidden]
  const __nv_bfloat16* lm_head_ = nullptr;     // [vocab, hidden] (the embedding when tied)
  std::vector<Layer> layers_;
  cuda::DeviceAllocation rope_table_;          // [max_model_len, head_dim / 2] float2

  // Activations, sized for max_num_batched_tokens (T) and max logits rows (R).
  cuda::DeviceAllocation cublas_workspace_;
  cuda::DeviceAllocation residual_;     // [T, hidden] fp32
  cuda::DeviceAllocation normed_;       // [T, hidden] bf16
  cuda::DeviceAllocation qkv_;          // [T, (heads + 2 kv_heads) * head_dim] bf16
  cuda::DeviceAllocation q_;            // [T, heads, head_dim] bf16
  cuda::DeviceAllocation attn_;         // [T, heads, head_dim] bf16
  cuda::DeviceAllocation delta_;        // [T, hidden] bf16: each sublayer's output, added on the next norm
  cuda::DeviceAllocation gate_up_;      // [T, 2 * intermediate] bf16
  cuda::DeviceAllocation act_;          // [T, intermediate] bf16
  cuda::DeviceAllocation final_normed_; // [R, hidden] bf16
  cuda::DeviceAllocation logits_;       // [R, vocab] fp32
  cuda::DeviceAllocation decode_workspace_;
  size_t decode_workspace_bytes_ = 0;
  cuda::DeviceAllocation decode_split_counters_;  // int32, zero between launches (the kernel resets them)
  int decode_split_counters_count_ = 0;
  // Step metadata (device) and its pinned host staging.
  cuda::DeviceAllocation metadata_;
  cuda::PinnedBuffer metadata_host_;
  cuda::PinnedBuffer results_host_;
  std::unique_ptr<const StepMetadataLayout> layout_;  // fixed once the KV cache (block size) is known
  int block_size_ = 0;
  int max_blocks_per_seq_ = 0;
  int max_logit_rows_ = 0;
  int64_t num_graph_captures_ = 0;

  // Decode graphs by (padded batch size, samples on device).
  std::map<std::tuple<int, int, bool, int>, cudaGraphExec_t> graphs_;  // (batch, tree tokens, sample, layers)
  const KvCache* graph_cache_ = nullptr;  // the cache the graphs were captured with
};

}  // namespace duet

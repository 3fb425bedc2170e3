// The Llama family (Llama 2/3/3.1, Mistral, Qwen2/2.5) on an NVIDIA GPU: bf16 weights resident
// on the device, an fp32 residual stream, cuBLAS for the projections, Duet's kernels for
// everything else, the bf16 KV cache in device memory, and decode steps replayed from CUDA graphs
// captured per batch-size bucket. Stream-ordered: the only host synchronization in a step is
// reading its results (logits or sampled token ids).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "absl/status/statusor.h"
#include "backends/cuda/cublas_linear.h"
#include "backends/cuda/cuda_weights.h"
#include "backends/cuda/device_kv_cache.h"
#include "backends/cuda/device_memory.h"
#include "backends/cuda/graph_runner.h"
#include "backends/cuda/launched_samples.h"
#include "backends/cuda/ring_attention.h"
#include "backends/cuda/step_metadata.h"
#include "engine/model_executor.h"
#include "kernels/attention/paged_attention.h"
#include "kernels/attention/prefill_attention.h"
#include "kernels/gemm/skinny_gemm.h"
#include "model/safetensors.h"

namespace duet {

namespace cuda {
class SequenceParallelGroup;
}

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
  // A mixed step's decode rows and prompt chunks get their attention in one launch
  // (kernels/attention/mixed_attention.h); off: the decode kernel, then the prefill kernel.
  bool mixed_attention_launch = true;
  // An eager step's last layer runs its output projection and MLP only on the rows that give
  // logits (a prompt's other rows need only that layer's K/V); off: on every row (for comparison).
  bool last_layer_logit_rows_only = true;
  // Projections of 3 to this many rows (decode batches, short verification or prefill steps) go
  // through the tensor-core skinny GEMM (kernels/gemm/skinny_gemm.h), larger ones through cuBLAS;
  // 0: all of them through cuBLAS.
  int skinny_gemm_max_rows = kernels::kSkinnyGemmPreferredMaxRows;
  // Projections of at least this many rows (prompt chunks, mixed steps) go through the tiled
  // tensor-core GEMM (kernels/gemm/wide_gemm.h); 0 (the default until it is measured on the H200):
  // through cuBLAS.
  int wide_gemm_min_rows = cuda::kWideGemmDefaultMinRows;
  // The projections that reach cuBLAS, at each multiple of 64 rows up to this many (and
  // max_num_batched_tokens), get the cuBLASLt algorithm timed fastest on this model's weights at
  // load (cuda::GemmTuning; 2-5 s for Llama-3-8B's 64 shapes); 0: cuBLAS's default throughout.
  int gemm_tuning_max_rows = cuda::kGemmTuningDefaultMaxRows;
  // A tuned candidate replaces the default where it takes at most this share of its time (tests
  // give a large value, so that every tuned shape runs a cuBLASLt candidate).
  double gemm_tuning_max_time_ratio = cuda::GemmTuning::kMaxTimeRatio;
  // Logits rows one head pass computes (at least max_num_seqs): a step verifying draft trees
  // gives a row per token and replays a graph only when its rows fit one pass. Device memory:
  // rows * vocab * 4 bytes.
  int max_logit_rows = 0;
};

class LlamaCuda : public ModelExecutor {
 public:
  // Out of device memory (weights, activations, workspaces): ResourceExhausted, saying what was
  // asked for and what is free.
  static absl::StatusOr<std::unique_ptr<LlamaCuda>> Load(const std::string& model_dir, const LlamaCudaOptions& options);
  ~LlamaCuda() override;

  const ModelConfig& config() const override { return config_; }
  KvDtype kv_dtype() const override { return KvDtype::kBFloat16; }
  // The interface's cache creation, which cannot report an error: a failure of
  // CreateDeviceKvCache is fatal here.
  absl::StatusOr<std::unique_ptr<KvCache>> CreateKvCache(int64_t num_blocks, int64_t block_size) override;
  // The KV cache and the step metadata sized for its block size; out of device memory:
  // ResourceExhausted, saying what was asked for and what is free.
  absl::StatusOr<std::unique_ptr<cuda::DeviceKvCache>> CreateDeviceKvCache(int64_t num_blocks, int64_t block_size);
  std::optional<int64_t> DeviceKvBudgetBytes(double memory_fraction) const override;

  absl::Status Forward(absl::Span<const SequenceChunk> chunks, KvCache& cache, std::vector<float>& logits,
                       const LayerDoneCallback& on_layer_done = nullptr) override;
  bool CanSampleOnDevice() const override { return true; }
  absl::Status ForwardSample(absl::Span<const SequenceChunk> chunks, KvCache& cache,
                             absl::Span<const DeviceSamplingRow> rows, std::vector<DeviceSample>& samples,
                             const LayerDoneCallback& on_layer_done = nullptr,
                             const FillMasksCallback& fill_masks = nullptr) override;
  // Async scheduling, on one rank (sequence-parallel executors run steps one at a time): a
  // launched step's placeholders are resolved on the device from the step before's samples,
  // which stay in the step metadata until the launched step's sampling writes its own.
  bool CanLaunchAhead() const override { return ring_ == nullptr && group_ == nullptr; }
  absl::Status LaunchSample(absl::Span<const SequenceChunk> chunks, KvCache& cache,
                            absl::Span<const DeviceSamplingRow> rows) override;
  absl::Status CollectSamples(std::vector<DeviceSample>& samples) override;
  // Every step marks its midpoint (the start of layer num_layers / 2) for late scheduling.
  void WaitForLaunchedStepMidpoint() override { launched_samples_.WaitForMidpoint(); }
  bool OldestLaunchedStepDone() override { return launched_samples_.OldestDone(); }

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
    return WarmUpGraphs(cache, max_draft_tokens, int(weights_->num_layers()));
  }
  // The same for the first `num_layers` layers (a self-speculation draft).
  absl::Status WarmUpGraphs(KvCache& cache, int32_t max_draft_tokens, int num_layers);
  int64_t num_one_time_setups() const override { return graphs_ ? graphs_->num_captures() : 0; }

  // Run with only the first `num_layers` layers, then the final norm and LM head (what
  // LayerPrefix's executor calls). Either logits or samples is null; both are with
  // `launch_ahead` (LaunchSample: the samples go to launched_samples_, nothing is waited for).
  absl::Status RunLayers(absl::Span<const SequenceChunk> chunks, KvCache& cache,
                         absl::Span<const DeviceSamplingRow> sampling, const LayerDoneCallback& on_layer_done,
                         std::vector<float>* logits, std::vector<DeviceSample>* samples, int num_layers,
                         const FillMasksCallback& fill_masks = nullptr, bool launch_ahead = false);

  // Sequence-parallel prefill: a step that is one whole prompt of at least min_tokens tokens runs
  // as zigzag ring attention over `ranks` ranks, everything else as one rank.
  //   - devices empty: the ranks are virtual, all in this executor on its one device
  //     (backends/cuda/ring_attention.h), every rank's rows in the same GEMMs: for checking the
  //     numerics and measuring per-rank work. Device memory: ring buffers for
  //     max_num_batched_tokens.
  //   - devices (one per rank; devices[0] is this executor's): a group of executors, one per
  //     rank, each computing its own shard (backends/cuda/sequence_parallel_group.h); devices may
  //     repeat (several ranks on one GPU, for checking). Each further rank loads the weights on its
  //     device (shared with this executor on the same GPU) and activations for a shard.
  //     The ranks pass ring blocks over `transport` ("peer" copies or "nccl"; ring_transport.h).
  absl::Status EnableSequenceParallel(int ranks, int64_t min_tokens, const std::vector<int>& devices = {},
                                      const std::string& transport = "peer");
  int sequence_parallel_ranks() const;
  // The ranks' devices of a group (EnableSequenceParallel with devices); empty otherwise.
  std::vector<int> sequence_parallel_devices() const;
  int device() const { return options_.device; }
  // The group of EnableSequenceParallel with devices (null otherwise), for benchmarks.
  cuda::SequenceParallelGroup* sequence_parallel_group() const { return group_.get(); }
  // Events around the ring steps of the next sequence-parallel layer that runs (benchmarks);
  // null: none.
  void set_ring_step_events(cuda::RingStepEvents* events, int layer) {
    ring_events_ = events;
    ring_events_layer_ = layer;
  }

  // What the load's GEMM tuning found, one entry per projection shape it timed.
  const std::vector<cuda::GemmTuning::Result>& gemm_tuning() const { return gemm_tuning_; }

  cudaStream_t stream() const { return stream_; }
  int64_t weight_bytes() const { return weights_->bytes(); }

 private:
  friend class cuda::SequenceParallelGroup;
  // Where a layer's K/V rows also go: a ring's send block and the rows' slots in it (none: null;
  // no member initializers, so `{}` can be a default argument inside this class).
  struct RingKvWrite {
    const kernels::PagedKvView* view;
    const int32_t* slots;
  };

  LlamaCuda(const ModelConfig& config, const LlamaCudaOptions& options);
  // Another rank of a sequence-parallel group on `device`: this model's weights (shared when
  // `device` is this executor's), activations for `max_rows` rows, no graphs.
  absl::StatusOr<std::unique_ptr<LlamaCuda>> LoadRank(int device, int max_rows) const;
  // The step metadata for a KV cache of `block_size`.
  absl::Status CreateStepMetadata(int block_size);
  absl::Status Init(const WeightStore& weights);
  absl::Status InitDevice();
  absl::Status UploadRopeTable();
  absl::Status AllocateActivations();
  // Options' gemm_tuning_max_rows: tunes the projections' shapes that reach cuBLAS.
  absl::Status TuneProjections();

  // The cache as this executor's own (created by CreateDeviceKvCache).
  absl::StatusOr<cuda::DeviceKvCache*> OwnCache(KvCache& cache) const;
  // Whether the step can replay a graph; if so, pads the plan to the graph's buckets.
  bool PadForGraphIfEligible(cuda::StepPlan& plan, bool layer_callbacks) const;
  absl::Status LaunchGraph(const cuda::StepPlan& plan, cuda::DeviceKvCache& cache, bool sample, int num_layers);
  // Enqueues the whole step (embedding → the first num_layers layers → logits → optional
  // sampling) on stream_.
  void Enqueue(const cuda::StepPlan& plan, cuda::DeviceKvCache& cache, bool sample,
               absl::Span<const SequenceChunk> chunks, const LayerDoneCallback& on_layer_done, int num_layers);
  // The decode attention's split of each context: a graph serves any context up to
  // max_model_len, an eager step plans for its own.
  kernels::PagedDecodeAttentionPlan PlanDecodeAttention(const cuda::StepPlan& plan) const;
  // Skinny batches compute RoPE + the KV write and SiLU·mul in the projections' epilogues.
  bool UseFusedEpilogues(int rows) const;
  // Whether the step runs sequence-parallel (EnableSequenceParallel).
  bool RunsSequenceParallel(absl::Span<const SequenceChunk> chunks) const;
  // The rows a layer's output projection and MLP run on: rows 0 .. count - 1 of the step, or
  // (index set, device [count]) the step's rows index[0 .. count), their outputs compacted into
  // rows 0 .. count - 1 of delta_ while the residual stream keeps every row in place.
  struct LayerRows {
    int count = 0;
    const int32_t* index = nullptr;
  };
  static LayerRows AllRows(int count) { return {count, nullptr}; }
  // The last layer's rows: in an eager step only those that give logits (their hidden state is
  // all the LM head reads; the other rows' K/V come from the layer's input), otherwise all.
  LayerRows LastLayerRows(const cuda::StepPlan& plan) const;
  // One layer's attention sublayer: norm (adding the previous sublayer's output), QKV
  // projection, RoPE and the KV write, attention, output projection of `out_rows` into delta_.
  void EnqueueAttention(const cuda::CudaLayerWeights& l, int layer, const cuda::StepPlan& plan,
                        const kernels::PagedDecodeAttentionPlan& decode_plan, const kernels::PagedKvView& kv,
                        LayerRows out_rows);
  // The sublayer up to its attention (norm, QKV, RoPE, K/V into kv and the ring's block, q into
  // q_) and after it (output projection of attn_'s `rows` into delta_).
  void EnqueueAttentionInput(const cuda::CudaLayerWeights& l, bool first_layer, int rows,
                             const kernels::PagedKvView& kv, RingKvWrite ring = {});
  void EnqueueAttentionOutput(const cuda::CudaLayerWeights& l, LayerRows rows);
  void EnqueueQkvRopeKvWrite(const cuda::CudaLayerWeights& l, int rows, const kernels::PagedKvView& kv,
                             RingKvWrite ring);
  // The attention kernels' parameters for a step's decode rows and for its other sequences.
  kernels::PagedDecodeAttentionParams DecodeKernelParams(const cuda::StepPlan& plan, const kernels::PagedKvView& kv,
                                                         float scale);
  kernels::PrefillAttentionParams PrefillKernelParams(const cuda::StepPlan& plan, const kernels::PagedKvView& kv,
                                                      float scale);
  void EnqueueAttentionKernel(const cuda::StepPlan& plan, const kernels::PagedDecodeAttentionPlan& decode_plan,
                              const kernels::PagedKvView& kv, int layer);
  // One layer's MLP sublayer on `rows`: norm (adding the attention output), gate/up with
  // SiLU·mul, down projection into delta_.
  void EnqueueMlp(const cuda::CudaLayerWeights& l, LayerRows rows);
  // After the last layer (which ran on `last_rows`): a graph's step joins the last MLP output,
  // normalizes and computes every row's logits (and samples); an eager step only joins it
  // (EagerHead does the rest).
  void EnqueueFinalNorm(const cuda::StepPlan& plan, bool sample, LayerRows last_rows);
  // Samples logits rows [first_row, first_row + rows) (in logits_ from its row 0) with the
  // uploaded per-row parameters.
  void EnqueueSampling(int first_row, int rows);
  // Copies logits rows [0, rows) of the last head pass to `dst` (through the pinned buffer).
  absl::Status CopyLogitsToHost(int rows, float* dst);
  // Waits for the step's sampled tokens and logprobs (rows [0, rows)).
  absl::Status CopySamplesToHost(int rows, std::vector<DeviceSample>& samples);
  // The logits head for eager steps, in passes of at most max_logit_rows_ rows.
  absl::Status EagerHead(const cuda::StepPlan& plan, bool sample, std::vector<float>* logits);

  ModelConfig config_;
  LlamaCudaOptions options_;
  std::string model_dir_;
  cudaStream_t stream_ = nullptr;
  int num_sms_ = 0;
  cuda::DeviceArena arena_;
  std::unique_ptr<cuda::CublasLinear> linear_;
  std::vector<cuda::GemmTuning::Result> gemm_tuning_;
  std::shared_ptr<const cuda::CudaWeights> weights_;  // shared by the sequence-parallel ranks on this device
  cuda::DeviceAllocation rope_table_;  // [max_model_len, head_dim / 2] float2

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
  cuda::PinnedBuffer results_host_;
  cuda::LaunchedSamples launched_samples_;  // LaunchSample's steps, until CollectSamples
  int max_logit_rows_ = 0;
  // Fixed once the KV cache (its block size) is known.
  std::unique_ptr<cuda::StepMetadata> metadata_;
  std::unique_ptr<cuda::GraphRunner> graphs_;
  // Sequence-parallel prefill (EnableSequenceParallel); sp_step_ while such a step is enqueued.
  std::unique_ptr<cuda::VirtualRingAttention> ring_;
  int64_t sp_min_tokens_ = 0;
  bool sp_step_ = false;
  cuda::RingStepEvents* ring_events_ = nullptr;
  int ring_events_layer_ = 0;
  std::unique_ptr<cuda::SequenceParallelGroup> group_;  // EnableSequenceParallel with devices
};

}  // namespace duet

// The per-step metadata of the CUDA backend: token ids, positions, KV slots, query offsets,
// context lengths, logits rows, block tables, draft-tree masks and sampling parameters, built on
// the host in pinned memory and copied to the device before the step's first kernel. The arrays
// sit at offsets fixed for the executor's lifetime (StepMetadataLayout), so captured graphs keep
// pointing at the right places.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include <cuda_runtime.h>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "backends/cuda/device_memory.h"
#include "engine/model_executor.h"

namespace duet::cuda {

// Most tokens of one sequence in a verification graph (one query block of the prefill attention).
inline constexpr int kTreeGraphMaxChunkTokens = 64;

// Offsets (in int32 units) of the step-metadata arrays.
struct StepMetadataLayout {
  size_t tokens, positions, slots, q_start, context_lens, logit_rows, block_tables;
  size_t tree_masks;  // uint64 (2 units) per token
  size_t temperature, top_k, top_p, min_p, seeds, offsets;  // seeds/offsets: uint64 (2 units)
  size_t bitmask_index;  // per row: its grammar mask in the step's bitmasks, or -1
  size_t sampling_pitch;
  size_t sampled_tokens, sampled_logprobs;
  size_t total;

  // max_rows: sampled rows (a step of draft trees samples every token's row).
  StepMetadataLayout(int max_tokens, int max_seqs, int max_rows, int max_blocks_per_seq);
};

// Host-side description of one step, uploaded before it runs.
struct StepPlan {
  int num_tokens = 0;        // rows of the step (padded to the graph batch in graph mode)
  int num_seqs = 0;          // sequences (padded likewise)
  int num_logit_rows = 0;    // logits rows (padded likewise)
  int max_q_len = 0;
  int max_context_len = 0;
  bool decode_only = false;  // one token per sequence: paged decode attention
  bool has_trees = false;    // some chunk is a draft tree: attention uses the tree masks
  // A step that is neither decode_only nor has_trees: how many of its first sequences have one
  // token each (decoding requests ahead of prompt chunks, as the scheduler orders them). Their
  // attention runs in the paged decode kernel, the rest's in the prefill kernel, which would
  // give each of them a 64-row query block per head.
  int num_leading_decode_seqs = 0;
  // The sequences (the first ones) whose attention runs in the paged decode kernel.
  int num_decode_kernel_seqs() const { return decode_only ? num_seqs : num_leading_decode_seqs; }
  int graph_batch = 0;       // > 0: replay the graph of this padded batch size
  int graph_tokens = 0;      // > 0: the graph verifies draft trees in this many (padded) rows
  // Some token ids are PreviousStepSample placeholders (async scheduling): ResolvePreviousSamples
  // puts the previous step's samples in after the upload.
  bool has_previous_samples = false;
};

// What a step may hold.
struct StepLimits {
  int max_num_seqs = 0;
  int max_num_batched_tokens = 0;
  int64_t max_model_len = 0;
  int64_t vocab_size = 0;
};

class StepMetadata {
 public:
  // Device and pinned host room for steps within `limits` over a KV cache of `block_size`.
  static absl::StatusOr<std::unique_ptr<StepMetadata>> Create(const StepLimits& limits, int block_size,
                                                              DeviceArena& arena);
  ~StepMetadata();

  int block_size() const { return block_size_; }
  int max_blocks_per_seq() const { return max_blocks_per_seq_; }

  // Checks the chunks against the limits and writes their metadata to the host copy (once the
  // last upload has read it). `previous_samples`: token ids may be PreviousStepSample(row).
  absl::StatusOr<StepPlan> Plan(absl::Span<const SequenceChunk> chunks, bool previous_samples = false);
  // A step of some rows of one prompt chunk starting at position 0 (a sequence-parallel rank's
  // shard): row i is the token at chunk position positions[i], writing its K/V to the slot the
  // chunk's block table gives it; the rows of the chunk's last num_logits positions give logits,
  // in position order. Attention metadata (block tables, context lengths) is not written: the
  // rank's ring attention has its own.
  absl::StatusOr<StepPlan> PlanRows(const SequenceChunk& chunk, absl::Span<const int64_t> positions);
  // Reorders a planned one-sequence step's rows: row i takes the token that was row order[i]
  // (its id, position and slot); the logits rows follow their tokens, in their own order. For
  // sequence-parallel prefill, whose rows go rank-major (parallel/ring_schedule.h).
  void ReorderRows(const StepPlan& plan, absl::Span<const int64_t> order);
  // Pads a decode step to `batch` sequences (its graph's bucket) with rows that write nothing.
  void PadForGraph(StepPlan& plan, int batch);
  // Pads a verification step to `batch` sequences and `tokens` rows (its graph's buckets).
  void PadTreeStepForGraph(StepPlan& plan, int batch, int tokens);
  // A step of `batch` padding sequences only (decode, or draft trees of `tree_tokens` rows when
  // > 0): what graph warm-up captures; it writes and reads nothing.
  StepPlan PaddingOnly(int batch, int tree_tokens);
  // Copies what `plan` uses (and the sampling rows with their grammar masks, when given) to the
  // device on `stream`. At most max_num_seqs rows have masks. with_bitmasks false: the masks'
  // contents follow later, through UploadBitmasks with the same rows.
  void Upload(const StepPlan& plan, absl::Span<const DeviceSamplingRow> sampling, cudaStream_t stream,
              bool with_bitmasks = true);
  void UploadBitmasks(absl::Span<const DeviceSamplingRow> sampling, cudaStream_t stream);
  // After Upload, for a plan with previous samples: the placeholders become the tokens the step
  // before sampled (still in sampled_tokens()), on the device.
  void ResolvePreviousSamples(const StepPlan& plan, cudaStream_t stream);

  // The device arrays.
  const int32_t* tokens() const { return device() + layout_.tokens; }
  const int32_t* positions() const { return device() + layout_.positions; }
  const int32_t* slots() const { return device() + layout_.slots; }
  const int32_t* q_start() const { return device() + layout_.q_start; }
  const int32_t* context_lens() const { return device() + layout_.context_lens; }
  const int32_t* logit_rows() const { return device() + layout_.logit_rows; }
  const int32_t* block_tables() const { return device() + layout_.block_tables; }
  const uint64_t* tree_masks() const { return reinterpret_cast<const uint64_t*>(device() + layout_.tree_masks); }
  const float* temperature() const { return reinterpret_cast<const float*>(device() + layout_.temperature); }
  const int32_t* top_k() const { return device() + layout_.top_k; }
  const float* top_p() const { return reinterpret_cast<const float*>(device() + layout_.top_p); }
  const float* min_p() const { return reinterpret_cast<const float*>(device() + layout_.min_p); }
  const uint64_t* seeds() const { return reinterpret_cast<const uint64_t*>(device() + layout_.seeds); }
  const uint64_t* offsets() const { return reinterpret_cast<const uint64_t*>(device() + layout_.offsets); }
  const int32_t* bitmask_index() const { return device() + layout_.bitmask_index; }
  // [max_num_seqs, bitmask_words()]: the step's grammar masks, in the order of their rows.
  const uint32_t* token_bitmasks() const { return bitmasks_device_.as<uint32_t>(); }
  int bitmask_words() const { return bitmask_words_; }
  int32_t* sampled_tokens() const { return device() + layout_.sampled_tokens; }
  float* sampled_logprobs() const { return reinterpret_cast<float*>(device() + layout_.sampled_logprobs); }

 private:
  StepMetadata(const StepLimits& limits, int block_size, int max_blocks_per_seq);
  int32_t* device() const { return device_.as<int32_t>(); }
  int32_t* host() const { return host_.as<int32_t>(); }
  // The pinned host copy may be rewritten only after the copies of the last Upload have read it
  // (with async scheduling the next step is planned while those may still wait on the stream).
  void WaitForLastUpload();

  StepLimits limits_;
  int block_size_;
  int max_blocks_per_seq_;
  StepMetadataLayout layout_;
  DeviceAllocation device_;
  PinnedBuffer host_;
  int bitmask_words_;
  DeviceAllocation bitmasks_device_;
  PinnedBuffer bitmasks_host_;
  cudaEvent_t uploaded_ = nullptr;  // recorded after each Upload's copies
};

}  // namespace duet::cuda

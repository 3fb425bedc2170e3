// The model-executor seam: runs one forward step of a batch of sequences over the paged KV
// cache. The CPU implementation is llama_cpu.h; the CUDA backend implements the same interface.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "engine/kv/block_manager.h"
#include "engine/kv/kv_cache.h"
#include "model/model_config.h"

namespace duet {

struct SequenceChunk;

// Called after each layer's K/V for the whole step have been written (host executors) or enqueued
// on the cache's device_stream() (device executors: work enqueued there next, or a copy that
// waits for it, sees them), so a prefill worker can ship that layer's blocks while later layers
// compute.
using LayerDoneCallback = std::function<void(int64_t layer, absl::Span<const SequenceChunk> chunks)>;
// Called by ForwardSample once the step's model work is on the device and before its sampling
// is: the caller fills the rows' grammar masks (DeviceSamplingRow::allowed_tokens, already
// sized) while the device computes.
using FillMasksCallback = std::function<void()>;

// One sequence's share of a step: `tokens` are new tokens at positions
// [start_position, start_position + tokens.size()); their K/V are written into the cache and
// they attend to every earlier position of the sequence already in the cache.
struct SequenceChunk {
  absl::Span<const int32_t> tokens;
  int64_t start_position = 0;
  absl::Span<const int32_t> block_table;
  SequenceId sequence_id = 0;
  // Logits are produced for the last `num_logits` tokens of the chunk (0: none, e.g. a prefill
  // chunk that does not end the prompt).
  int32_t num_logits = 1;
  // Speculative verification: the chunk is a draft TREE rather than a run of tokens. When not
  // empty (one entry per token), tree_parents[j] is the index in this chunk of token j's parent
  // (0 <= parent < j), or -1 for token 0 alone, the root, which continues the sequence. Token j
  // takes position start_position + depth(j), attends to positions [0, start_position) plus its
  // ancestors and itself only, and its K/V go to slot start_position + j (see MoveKvSlots).
  absl::Span<const int32_t> tree_parents;
};

// Moves one token's K/V within a sequence, in every layer: slot `from` to slot `to` (positions
// in the sequence, mapped through its block table).
struct KvSlotMove {
  int64_t from = 0;
  int64_t to = 0;
};

// Sampling parameters of one logits row for executors that sample on their device. Only what
// needs no host-side state: penalties, logit bias and top-N logprobs stay on the host sampler.
struct DeviceSamplingRow {
  float temperature = 0.0f;  // <= 0: greedy
  int32_t top_k = 0;         // <= 0: off
  float top_p = 1.0f;
  float min_p = 0.0f;
  uint64_t seed = 0;         // with `offset`, keys the draw: same (seed, offset), same token
  uint64_t offset = 0;
  // A grammar's token bitmask (bit t % 32 of word t / 32 set: token t allowed), read during the
  // call only (after FillMasksCallback, when one is given); empty: every token. A mask that
  // allows nothing gives an unspecified token.
  absl::Span<const uint32_t> allowed_tokens;
};

struct DeviceSample {
  int32_t token = 0;
  float logprob = 0.0f;  // log-softmax of the raw logits at `token`
};

// Async scheduling: a chunk's token id that the host does not know yet, the token that the step
// launched before this one samples in its logits row `row` (resolved on the device).
constexpr int32_t PreviousStepSample(int32_t row) { return -1 - row; }
constexpr bool IsPreviousStepSample(int32_t token) { return token < 0; }
constexpr int32_t PreviousStepSampleRow(int32_t token) { return -1 - token; }

// A self-speculation draft runs at least one layer and leaves at least one out.
inline absl::Status CheckLayerPrefix(const ModelConfig& config, int64_t num_layers) {
  if (num_layers >= 1 && num_layers < config.num_layers) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("self-speculation needs 1 to ", config.num_layers - 1, " layers of this ",
                                                 config.num_layers, "-layer model, got ", num_layers));
}

class ModelExecutor {
 public:
  virtual ~ModelExecutor() = default;
  virtual const ModelConfig& config() const = 0;

  // KV-cache storage in the memory and element type this executor computes with.
  virtual KvDtype kv_dtype() const = 0;
  // ResourceExhausted when the memory it lives in cannot hold it.
  virtual absl::StatusOr<std::unique_ptr<KvCache>> CreateKvCache(int64_t num_blocks, int64_t block_size) = 0;
  // Bytes the KV cache may take on the executor's device when the process may use
  // `memory_fraction` of it; nullopt for host executors (EngineConfig::kv_cache_bytes applies).
  virtual std::optional<int64_t> DeviceKvBudgetBytes(double memory_fraction) const { return std::nullopt; }

  // Runs the step. `logits` receives [sum(num_logits), vocab_size] float32 rows, in chunk order.
  virtual absl::Status Forward(absl::Span<const SequenceChunk> chunks, KvCache& cache,
                               std::vector<float>& logits,
                               const LayerDoneCallback& on_layer_done = nullptr) = 0;

  // Runs the step and samples one token per logits row on the device (rows.size() must equal
  // the step's logits rows), so only token ids cross to the host.
  virtual bool CanSampleOnDevice() const { return false; }
  virtual absl::Status ForwardSample(absl::Span<const SequenceChunk> chunks, KvCache& cache,
                                     absl::Span<const DeviceSamplingRow> rows, std::vector<DeviceSample>& samples,
                                     const LayerDoneCallback& on_layer_done = nullptr,
                                     const FillMasksCallback& fill_masks = nullptr) {
    return absl::UnimplementedError("this executor samples on the host");
  }

  // Async scheduling (vLLM's --async-scheduling, SGLang's overlap scheduler): the engine launches
  // step n + 1 before step n's tokens reach the host, so the device does not wait while the host
  // applies them and schedules (an executor that can samples on its device). LaunchSample is
  // ForwardSample without the wait (no layer callback, no grammar masks); its chunks' token ids
  // may be PreviousStepSample(row). CollectSamples waits
  // for the oldest launched step not yet collected and gives its samples; at most two launched
  // steps wait to be collected. A step run any other way (Forward, ForwardSample) first needs every
  // launched step collected.
  virtual bool CanLaunchAhead() const { return false; }
  virtual absl::Status LaunchSample(absl::Span<const SequenceChunk> chunks, KvCache& cache,
                                    absl::Span<const DeviceSamplingRow> rows) {
    return absl::UnimplementedError("this executor cannot launch a step ahead");
  }
  virtual absl::Status CollectSamples(std::vector<DeviceSample>& samples) {
    return absl::UnimplementedError("this executor cannot launch a step ahead");
  }
  // Late scheduling (EngineConfig::late_scheduling): blocks until the newest launched step has run
  // half its layers (at once when none is launched, or for an executor that cannot tell). Errors
  // are not reported here: CollectSamples reports the device's.
  virtual void WaitForLaunchedStepMidpoint() {}
  // Whether the oldest launched step not yet collected has finished on the device; right after a
  // launch, true means the device may have waited for it.
  virtual bool OldestLaunchedStepDone() { return false; }

  // Speculative decoding. The engine speculates only with executors that honour
  // SequenceChunk::tree_parents and can compact the accepted path's K/V.
  virtual bool SupportsTreeAttention() const { return false; }
  // Applies `moves` in order (callers order them so no move reads a slot already overwritten).
  virtual absl::Status MoveKvSlots(KvCache& cache, absl::Span<const int32_t> block_table,
                                   absl::Span<const KvSlotMove> moves) {
    return absl::UnimplementedError("this executor cannot move KV slots");
  }
  // Prepares for verification steps of up to `max_draft_tokens` drafts per sequence (e.g. captures
  // their CUDA graphs), so serving does not pay for it on first use.
  virtual absl::Status WarmUpVerification(KvCache& cache, int32_t max_draft_tokens) { return absl::OkStatus(); }
  // How many one-time setups (e.g. CUDA graph captures) steps have paid so far: a step during
  // which it grew says nothing about what such a step costs.
  virtual int64_t num_one_time_setups() const { return 0; }
  // Self-speculation: an executor that runs only the first `num_layers` layers, then the final
  // norm and LM head. It shares this executor's weights and KV cache (reading and writing only
  // those layers' K/V) and must not outlive it.
  virtual absl::StatusOr<std::unique_ptr<ModelExecutor>> LayerPrefix(int64_t num_layers) {
    return absl::UnimplementedError("this executor has no layer-prefix draft");
  }
};

}  // namespace duet

// The model-executor seam: runs one forward step of a batch of sequences over the paged KV
// cache. The CPU implementation is llama_cpu.h; the CUDA backend implements the same interface.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/block_manager.h"
#include "engine/model_config.h"

namespace duet {

class KvCache;
struct SequenceChunk;

// Called after each layer's K/V for the whole step are in the cache, so a prefill worker can
// ship that layer's blocks while later layers compute.
using LayerDoneCallback = std::function<void(int64_t layer, absl::Span<const SequenceChunk> chunks)>;

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
};

class ModelExecutor {
 public:
  virtual ~ModelExecutor() = default;
  virtual const ModelConfig& config() const = 0;
  // Runs the step. `logits` receives [sum(num_logits), vocab_size] float32 rows, in chunk order.
  virtual absl::Status Forward(absl::Span<const SequenceChunk> chunks, KvCache& cache,
                               std::vector<float>& logits,
                               const LayerDoneCallback& on_layer_done = nullptr) = 0;
};

}  // namespace duet

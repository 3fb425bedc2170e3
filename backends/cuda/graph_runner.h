// The CUDA-graph cache of decode and verification steps: one graph per (padded batch, padded
// tree tokens, samples on device, layers), captured the first time a step of that shape runs and
// replayed after, so a step costs one launch instead of one per kernel.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <tuple>

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "engine/kv/kv_cache.h"

namespace duet::cuda {

// Decode graphs are captured for these padded batch sizes (vLLM's buckets): 1, 2, 4, then
// multiples of 8.
int GraphBatchSize(int num_seqs);
// Verification graphs are captured for these padded token counts: multiples of 8 up to 16, then
// four buckets per power of two.
int TreeGraphTokens(int num_tokens);

struct GraphKey {
  int batch;        // padded sequences
  int tree_tokens;  // padded rows of a verification step; 0 for decode
  bool sample;      // samples on the device (else leaves logits)
  int num_layers;
  auto operator<=>(const GraphKey&) const = default;
};

class GraphRunner {
 public:
  explicit GraphRunner(cudaStream_t stream) : stream_(stream) {}
  ~GraphRunner() { Clear(); }
  GraphRunner(const GraphRunner&) = delete;
  GraphRunner& operator=(const GraphRunner&) = delete;

  // Replays the graph of `key` on the stream. The first time, `enqueue` (which puts the step's
  // work on the stream) runs once eagerly — kernels that configure themselves on first use
  // (shared-memory limits) and cuBLAS's heuristics do so outside the capture — and once under
  // capture. Graphs hold the KV cache's pointers: a step on another cache drops them all.
  absl::Status Launch(const GraphKey& key, const KvCache& cache, const std::function<void()>& enqueue);
  int64_t num_captures() const { return num_captures_; }

 private:
  void Clear();

  cudaStream_t stream_;
  std::map<GraphKey, cudaGraphExec_t> graphs_;
  const KvCache* cache_ = nullptr;  // the cache the graphs were captured with
  int64_t num_captures_ = 0;
};

}  // namespace duet::cuda

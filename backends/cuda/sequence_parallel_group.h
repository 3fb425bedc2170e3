// A sequence-parallel prefill group whose N ranks are executors of their own, one per device
// (devices may repeat: N ranks on one GPU run the same code for checking), all driven from the
// calling thread with stream-ordered work, so every rank's GPU runs its shard concurrently.
//
// Rank 0 is the LlamaCuda the engine holds. A prompt's rows are sharded zigzag
// (parallel/zigzag.h); per layer every rank:
//   1. normalizes its rows, projects Q/K/V, applies RoPE and writes its K/V twice: into rank 0's
//      paged KV cache (peer writes: the cache the engine and the KV transfer see holds the whole
//      prompt) and into its own ring block (RankRingAttention);
//   2. runs N ring steps: attention over the block in hand while the transport brings the next
//      (double-buffered; parallel/ring_schedule.h says which calls each step makes), the partial
//      results merged by log-sum-exp in fp32;
//   3. projects the attention output and runs the MLP on its rows.
// The layer hook (LayerDoneCallback: the prefill worker ships the layer's KV from it) runs once
// per layer on rank 0, ordered after every rank's K/V write of the layer. Rank 0 holds the
// prompt's last chunk (chunk 2N-1), so it alone computes logits and samples; the other ranks skip
// the last layer's output projection and MLP.
//
// Ordering across ranks uses CUDA events only: a ring step's copy waits for its source block
// (written, or received the step before) and for its destination's last readers (the rank's
// attention two steps back and the next rank's copy out of it); a layer's K/V write waits for the
// next rank to have read the previous layer's block.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "backends/cuda/device_kv_cache.h"
#include "backends/cuda/ring_attention.h"
#include "backends/cuda/ring_transport.h"
#include "backends/cuda/step_metadata.h"
#include "engine/model_executor.h"

namespace duet {
class LlamaCuda;
}

namespace duet::cuda {

class SequenceParallelGroup {
 public:
  // The group of `leader` (rank 0, on devices[0]) and one further rank per other device, passing
  // ring blocks over `transport` (ring_transport.h: "peer" or "nccl").
  static absl::StatusOr<std::unique_ptr<SequenceParallelGroup>> Create(LlamaCuda& leader,
                                                                       const std::vector<int>& devices,
                                                                       int64_t min_tokens,
                                                                       const std::string& transport);
  ~SequenceParallelGroup();
  SequenceParallelGroup(const SequenceParallelGroup&) = delete;
  SequenceParallelGroup& operator=(const SequenceParallelGroup&) = delete;

  int size() const { return int(ranks_.size()); }
  const std::vector<int>& devices() const { return devices_; }
  const RingTransport& transport() const { return *transport_; }
  // Whether the group prefills this step: one prompt chunk from position 0 of at least
  // min_tokens (and 2N) tokens, no draft tree, its logits rows within the last zigzag chunk.
  bool Takes(absl::Span<const SequenceChunk> chunks) const;
  // With measuring on, Prefill times how long each rank's compute stream stalls waiting for a
  // ring block (events around each wait): the communication not hidden behind attention.
  void set_measure_exposed(bool on) { measure_exposed_ = on; }
  struct Exposed {
    double max_rank_ms = 0;   // the most any rank stalled over the whole prefill
    double mean_rank_ms = 0;  // the ranks' mean
    size_t step_bytes = 0;    // bytes one rank receives per ring step (K and V)
  };
  // Of the last Prefill with measuring on.
  const Exposed& last_exposed() const { return exposed_; }
  // The step over every layer (the arguments as LlamaCuda::RunLayers'); either logits or samples
  // is null.
  absl::Status Prefill(absl::Span<const SequenceChunk> chunks, DeviceKvCache& cache,
                       absl::Span<const DeviceSamplingRow> sampling, const LayerDoneCallback& on_layer_done,
                       std::vector<float>* logits, std::vector<DeviceSample>* samples,
                       const FillMasksCallback& fill_masks);

 private:
  SequenceParallelGroup(LlamaCuda& leader, std::vector<int> devices, int64_t min_tokens);
  absl::Status Init(const std::string& transport);
  // Plans and uploads every rank's rows and ring calls.
  absl::Status Prepare(const SequenceChunk& chunk, int block_size, absl::Span<const DeviceSamplingRow> sampling,
                       bool with_bitmasks);
  // One layer on every rank.
  absl::Status EnqueueLayer(int layer, DeviceKvCache& cache, const LayerDoneCallback& on_layer_done,
                            absl::Span<const SequenceChunk> chunks);
  absl::Status EnqueueRing(int layer);
  // Waits for every rank but 0 and checks its errors.
  absl::Status SynchronizeRanks();

  LlamaCuda& leader_;
  const std::vector<int> devices_;
  const int64_t min_tokens_;
  std::vector<std::unique_ptr<LlamaCuda>> owned_;  // ranks 1..N-1
  std::vector<LlamaCuda*> ranks_;                  // [N], ranks_[0] = &leader_
  std::vector<std::unique_ptr<RankRingAttention>> rings_;
  std::unique_ptr<RingTransport> transport_;
  std::vector<int> rows_;  // rows of each rank in the prepared step
  StepPlan leader_plan_;   // rank 0's
  // Events per rank (on its device): its layer's K/V written; its ring done (the attention
  // output written: every read of its blocks and of blocks it received is over); per step k,
  // its block of step k received and its attention of step k done.
  std::vector<cudaEvent_t> written_, ring_done_;
  std::vector<std::vector<cudaEvent_t>> received_, attended_;  // [step][rank]
  // Timing events around every wait for a block, per rank: (before, after) pairs.
  bool measure_exposed_ = false;
  std::vector<std::vector<std::pair<cudaEvent_t, cudaEvent_t>>> stall_events_;  // [rank]
  size_t stalls_used_ = 0;  // pairs used per rank in this prefill
  Exposed exposed_;
  void RecordStall(int rank, cudaStream_t stream, cudaEvent_t wait_for);
  void CollectExposed();
};

}  // namespace duet::cuda

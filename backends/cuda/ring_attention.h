// Ring attention of a sequence-parallel prefill whose ranks are virtual: every rank on this
// executor's one device, each with its own K/V block buffer, the ring's sends as device-to-device
// copies on a communication stream. It runs the same schedule (parallel/ring_schedule.h), kernels
// and log-sum-exp merge a multi-GPU group runs, so one GPU checks the numerics and measures the
// per-rank compute that multi-GPU projections start from.
//
// Buffers (P pages of kBlockSize rows per rank, rank r's pages [r * P, (r + 1) * P)):
//   send      [size * P, num_kv_heads, kBlockSize, head_dim] bf16, K and V: each rank's own rows
//   recv[2]   the same: the block each rank holds at a step, double-buffered so the copy of step
//             k + 1 overlaps the attention of step k
//   state     [max_tokens, num_q_heads, head_dim] fp32 and its log-sum-exp [max_tokens, num_q_heads]
// Step k's recv is send rotated by k ranks (rank r holds rank (r - k) mod size's block): two
// contiguous copies per pool.
#pragma once

#include <memory>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backends/cuda/device_memory.h"
#include "kernels/attention/paged_kv.h"
#include "parallel/ring_schedule.h"

namespace duet::cuda {

// CUDA events around each step of one Attend call (for benchmarks): attention on the compute
// stream, the copy that brought the step's block on the communication stream (step 0 has none).
struct RingStepEvents {
  std::vector<cudaEvent_t> attention_begin, attention_end, copy_begin, copy_end;
  explicit RingStepEvents(int steps);
  ~RingStepEvents();
  RingStepEvents(const RingStepEvents&) = delete;
  RingStepEvents& operator=(const RingStepEvents&) = delete;
  // Milliseconds of each step's attention and copy, once the events completed.
  std::vector<float> AttentionMs() const;
  std::vector<float> CopyMs() const;
};

class VirtualRingAttention {
 public:
  static constexpr int kBlockSize = 64;

  static absl::StatusOr<std::unique_ptr<VirtualRingAttention>> Create(int size, int max_tokens, int num_q_heads,
                                                                      int num_kv_heads, int head_dim,
                                                                      DeviceArena& arena, cudaStream_t compute);
  ~VirtualRingAttention();

  int size() const { return size_; }
  // Uploads the schedule's per-step calls and every row's slot in the send buffer on the compute
  // stream (once per forward; every layer runs the same schedule).
  absl::Status Prepare(const parallel::RingAttentionSchedule& schedule);
  // Where a layer's K/V rows go before Attend (RoPE's KV write with send_slots()).
  kernels::PagedKvView send_view() const;
  const int32_t* send_slots() const { return send_slots_.as<int32_t>(); }
  // Causal attention of the prepared rows' queries q [num_tokens, num_q_heads, head_dim] over the
  // K/V in the send buffer, into out (same shape, bf16), on the compute stream.
  void Attend(const __nv_bfloat16* q, float scale, __nv_bfloat16* out, RingStepEvents* events = nullptr);
  // Bytes of one rank's K/V block (what a ring step passes per rank).
  int64_t block_bytes() const { return 2 * pool_rank_elems_ * int64_t(sizeof(__nv_bfloat16)); }

 private:
  VirtualRingAttention(int size, int max_tokens, int num_q_heads, int num_kv_heads, int head_dim,
                       cudaStream_t compute);
  // Offsets (int32 units) of step k's arrays in the step metadata.
  struct StepArrays {
    size_t q_start, q_rows, context_lens, kv_lens, block_tables;
    int num_calls, max_q_len;
  };
  kernels::PagedKvView View(__nv_bfloat16* k, __nv_bfloat16* v) const;
  void CopyStep(int step);

  int size_, max_tokens_, num_q_heads_, num_kv_heads_, head_dim_;
  int pages_per_rank_;
  int64_t pool_rank_elems_;  // one rank's elements in one pool
  int num_tokens_ = 0;
  cudaStream_t compute_;
  cudaStream_t comm_ = nullptr;
  cudaEvent_t send_ready_ = nullptr;
  cudaEvent_t copy_done_[2] = {nullptr, nullptr};
  cudaEvent_t attention_done_[2] = {nullptr, nullptr};
  DeviceAllocation send_k_, send_v_, recv_k_[2], recv_v_[2];
  DeviceAllocation state_, state_lse_, send_slots_, metadata_;
  PinnedBuffer host_;
  std::vector<StepArrays> steps_;
};

}  // namespace duet::cuda

// Ring attention of sequence-parallel prefill on the GPU, in two forms:
//   - VirtualRingAttention: the ranks are virtual, every rank on this executor's one device, each with its own K/V block buffer, the ring's sends as device-to-device
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
//   - RankRingAttention: one rank of a group whose ranks are executors of their own
//     (backends/cuda/sequence_parallel_group.h), each rank's buffers on its own device; the group
//     moves the blocks between ranks (backends/cuda/ring_transport.h).
#pragma once

#include <array>
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

// Offsets (int32 units) of one ring step's arrays in a ring's step metadata.
struct RingStepArrays {
  size_t q_start, q_rows, context_lens, kv_lens, block_tables;
  int num_calls, max_q_len;
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
  std::vector<RingStepArrays> steps_;
};

// One rank's part of a group's ring attention, on the rank's device. Buffers (P pages of
// kBlockSize rows, P for the rank's most rows):
//   send      [P, num_kv_heads, kBlockSize, head_dim] bf16, K and V: this rank's own rows
//   recv[2]   the same: the block held at steps 1, 2, ... (double-buffered: step k in recv[k % 2])
//   state     [max_rows, num_q_heads, head_dim] fp32 and its log-sum-exp [max_rows, num_q_heads]
// Every step's block is a whole number of pages from page 0: a step passes block_bytes() per pool.
class RankRingAttention {
 public:
  static constexpr int kBlockSize = VirtualRingAttention::kBlockSize;

  // Rank `rank` of `size`; max_rows: the most rows this rank holds in one prefill.
  static absl::StatusOr<std::unique_ptr<RankRingAttention>> Create(int rank, int size, int max_rows, int num_q_heads,
                                                                  int num_kv_heads, int head_dim, DeviceArena& arena,
                                                                  cudaStream_t compute);
  int rank() const { return rank_; }
  // Uploads this rank's calls of every step and its rows' slots in the send buffer, on the
  // compute stream, and waits for the upload (once per forward).
  absl::Status Prepare(const parallel::RingAttentionSchedule& schedule);
  kernels::PagedKvView send_view() const { return View(send_k_, send_v_); }
  const int32_t* send_slots() const { return send_slots_.as<int32_t>(); }
  // The K and V of the block this rank attends to at `step` (its own at step 0).
  std::array<void*, 2> held(int step) const;
  // Where the block of `step` >= 1 arrives.
  std::array<void*, 2> recv(int step) const;
  // Bytes of one pool (K or V) of the blocks the prepared schedule passes: the pages of its
  // largest rank.
  size_t block_bytes() const { return block_bytes_; }
  // This rank's attention of `step` over held(step), its queries q [rows, num_q_heads, head_dim]
  // (its own rows, local order), merged into the state, on the compute stream.
  void AttendStep(int step, const __nv_bfloat16* q, float scale);
  // The merged state as the layer's attention output out [rows, num_q_heads, head_dim] bf16.
  void WriteOutput(__nv_bfloat16* out);

 private:
  RankRingAttention(int rank, int size, int max_rows, int num_q_heads, int num_kv_heads, int head_dim,
                    cudaStream_t compute);
  kernels::PagedKvView View(const DeviceAllocation& k, const DeviceAllocation& v) const;

  int rank_, size_, max_rows_, num_q_heads_, num_kv_heads_, head_dim_, pages_;
  int num_rows_ = 0;
  size_t block_bytes_ = 0;
  cudaStream_t compute_;
  DeviceAllocation send_k_, send_v_, recv_k_[2], recv_v_[2];
  DeviceAllocation state_, state_lse_, send_slots_, metadata_;
  PinnedBuffer host_;
  std::vector<RingStepArrays> steps_;
};

}  // namespace duet::cuda

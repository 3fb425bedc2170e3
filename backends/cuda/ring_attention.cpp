#include "backends/cuda/ring_attention.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/status_macros.h"
#include "kernels/attention/prefill_attention.h"

namespace duet::cuda {

RingStepEvents::RingStepEvents(int steps) {
  for (auto* list : {&attention_begin, &attention_end, &copy_begin, &copy_end}) {
    list->resize(size_t(steps));
    for (cudaEvent_t& e : *list) DUET_CHECK_CUDA(cudaEventCreate(&e));
  }
}

RingStepEvents::~RingStepEvents() {
  for (auto* list : {&attention_begin, &attention_end, &copy_begin, &copy_end}) {
    for (cudaEvent_t e : *list) cudaEventDestroy(e);
  }
}

namespace {

std::vector<float> Elapsed(const std::vector<cudaEvent_t>& begin, const std::vector<cudaEvent_t>& end, size_t first) {
  std::vector<float> ms(begin.size(), 0.f);
  for (size_t i = first; i < begin.size(); ++i) DUET_CHECK_CUDA(cudaEventElapsedTime(&ms[i], begin[i], end[i]));
  return ms;
}

// Writes one step's calls into `host` from int32 offset `at` (advanced past them): query rows
// relative to first_row; the held block's pages from page_base(call) on.
template <typename PageBase>
RingStepArrays WriteStepArrays(const std::vector<parallel::RingAttentionCall>& calls, int64_t first_row, int pages,
                               PageBase page_base, int32_t* host, size_t& at) {
  RingStepArrays a{};
  a.num_calls = int(calls.size());
  const size_t n = calls.size();
  a.q_start = at;
  a.q_rows = a.q_start + n + 1;
  a.context_lens = a.q_rows + n;
  a.kv_lens = a.context_lens + n;
  a.block_tables = a.kv_lens + n;
  at = a.block_tables + n * size_t(pages);
  host[a.q_start] = 0;
  for (size_t i = 0; i < n; ++i) {
    const parallel::RingAttentionCall& c = calls[i];
    host[a.q_start + i + 1] = host[a.q_start + i] + int32_t(c.q_len);
    host[a.q_rows + i] = int32_t(c.q_row - first_row);
    host[a.context_lens + i] = int32_t(c.context_len);
    host[a.kv_lens + i] = int32_t(c.kv_len);
    for (int p = 0; p < pages; ++p) host[a.block_tables + i * size_t(pages) + size_t(p)] = page_base(c) + p;
    a.max_q_len = std::max(a.max_q_len, int(c.q_len));
  }
  return a;
}

// The prefill-attention call of one ring step: its arrays in `meta`, the block in `kv`, merged
// into the state after step 0.
kernels::PrefillAttentionParams StepParams(const RingStepArrays& a, const int32_t* meta, const kernels::PagedKvView& kv,
                                           int step, float* state, float* lse, int num_q_tokens, int num_q_heads,
                                           int pages, const __nv_bfloat16* q, float scale) {
  kernels::PrefillAttentionParams p{};
  p.q = q;
  p.kv = kv;
  p.block_tables = meta + a.block_tables;
  p.q_start = meta + a.q_start;
  p.q_rows = meta + a.q_rows;
  p.context_lens = meta + a.context_lens;
  p.kv_lens = meta + a.kv_lens;
  p.state_out = state;
  p.state_lse = lse;
  p.merge_state = step > 0;
  p.num_seqs = a.num_calls;
  p.num_q_tokens = num_q_tokens;
  p.max_q_len = a.max_q_len;
  p.num_q_heads = num_q_heads;
  p.max_blocks_per_seq = pages;
  p.scale = scale;
  return p;
}

}  // namespace

std::vector<float> RingStepEvents::AttentionMs() const { return Elapsed(attention_begin, attention_end, 0); }
std::vector<float> RingStepEvents::CopyMs() const { return Elapsed(copy_begin, copy_end, 1); }

VirtualRingAttention::VirtualRingAttention(int size, int max_tokens, int num_q_heads, int num_kv_heads, int head_dim,
                                           cudaStream_t compute)
    : size_(size),
      max_tokens_(max_tokens),
      num_q_heads_(num_q_heads),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      // A rank holds at most 2 * ceil(T / 2N) rows (parallel/zigzag.h).
      pages_per_rank_((2 * ((max_tokens + 2 * size - 1) / (2 * size)) + kBlockSize - 1) / kBlockSize),
      pool_rank_elems_(int64_t(pages_per_rank_) * num_kv_heads * kBlockSize * head_dim),
      compute_(compute) {}

VirtualRingAttention::~VirtualRingAttention() {
  for (cudaEvent_t e : {send_ready_, copy_done_[0], copy_done_[1], attention_done_[0], attention_done_[1]}) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  if (comm_ != nullptr) cudaStreamDestroy(comm_);
}

absl::StatusOr<std::unique_ptr<VirtualRingAttention>> VirtualRingAttention::Create(int size, int max_tokens,
                                                                                   int num_q_heads, int num_kv_heads,
                                                                                   int head_dim, DeviceArena& arena,
                                                                                   cudaStream_t compute) {
  DUET_CHECK(size >= 1 && max_tokens >= 2 * size);
  std::unique_ptr<VirtualRingAttention> ring(
      new VirtualRingAttention(size, max_tokens, num_q_heads, num_kv_heads, head_dim, compute));
  const size_t pool_bytes = size_t(size) * size_t(ring->pool_rank_elems_) * sizeof(__nv_bfloat16);
  DUET_ASSIGN_OR_RETURN(ring->send_k_, arena.Allocate(pool_bytes, "ring attention send K"));
  DUET_ASSIGN_OR_RETURN(ring->send_v_, arena.Allocate(pool_bytes, "ring attention send V"));
  for (int b = 0; b < 2; ++b) {
    DUET_ASSIGN_OR_RETURN(ring->recv_k_[b], arena.Allocate(pool_bytes, "ring attention receive K"));
    DUET_ASSIGN_OR_RETURN(ring->recv_v_[b], arena.Allocate(pool_bytes, "ring attention receive V"));
  }
  const size_t rows = size_t(max_tokens) * size_t(num_q_heads);
  DUET_ASSIGN_OR_RETURN(ring->state_, arena.Allocate(rows * size_t(head_dim) * 4, "ring attention state"));
  DUET_ASSIGN_OR_RETURN(ring->state_lse_, arena.Allocate(rows * 4, "ring attention log-sum-exp"));
  DUET_ASSIGN_OR_RETURN(ring->send_slots_, arena.Allocate(size_t(max_tokens) * 4, "ring attention slots"));
  // Per step at most 2 * size calls: q_start (+1), q_rows, context_lens, kv_lens, block tables.
  const size_t per_step = size_t(2 * size) * (4 + size_t(ring->pages_per_rank_)) + 1 + 16;
  DUET_ASSIGN_OR_RETURN(ring->metadata_, arena.Allocate(size_t(size) * per_step * 4, "ring attention metadata"));
  DUET_RETURN_IF_ERROR(ring->host_.Resize(std::max(size_t(size) * per_step, size_t(max_tokens)) * 4));
  DUET_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&ring->comm_, cudaStreamNonBlocking), "ring stream"));
  for (cudaEvent_t* e : {&ring->send_ready_, &ring->copy_done_[0], &ring->copy_done_[1], &ring->attention_done_[0],
                         &ring->attention_done_[1]}) {
    DUET_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "ring event"));
  }
  return ring;
}

kernels::PagedKvView VirtualRingAttention::View(__nv_bfloat16* k, __nv_bfloat16* v) const {
  return kernels::PagedKvView{k, v, num_kv_heads_, kBlockSize, head_dim_};
}

kernels::PagedKvView VirtualRingAttention::send_view() const {
  return View(send_k_.as<__nv_bfloat16>(), send_v_.as<__nv_bfloat16>());
}

absl::Status VirtualRingAttention::Prepare(const parallel::RingAttentionSchedule& schedule) {
  if (schedule.size != size_ || schedule.num_tokens > max_tokens_) {
    return absl::InternalError(absl::StrCat("ring schedule of ", schedule.num_tokens, " tokens over ", schedule.size,
                                            " ranks does not fit this ring (", max_tokens_, " tokens, ", size_,
                                            " ranks)"));
  }
  num_tokens_ = int(schedule.num_tokens);
  // The slots first (the forward's RoPE write needs them), then the steps' arrays, in one buffer
  // the compute stream copies from (the step ends with a synchronization, so it is free again).
  int32_t* host = host_.as<int32_t>();
  for (int rank = 0; rank < size_; ++rank) {
    for (int64_t row = schedule.rank_rows[rank]; row < schedule.rank_rows[rank + 1]; ++row) {
      host[row] = int32_t(int64_t(rank) * pages_per_rank_ * kBlockSize + (row - schedule.rank_rows[rank]));
    }
  }
  DUET_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(send_slots_.get(), host, size_t(num_tokens_) * 4,
                                                  cudaMemcpyHostToDevice, compute_),
                                  "ring slots upload"));
  DUET_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(compute_), "ring slots upload"));
  steps_.clear();
  size_t at = 0;
  const int pages = pages_per_rank_;
  // The block a rank holds sits in that rank's pages of the step's buffer.
  auto page_base = [pages](const parallel::RingAttentionCall& c) { return c.rank * pages; };
  for (const std::vector<parallel::RingAttentionCall>& calls : schedule.steps) {
    steps_.push_back(WriteStepArrays(calls, 0, pages, page_base, host, at));
  }
  DUET_CHECK(at * 4 <= metadata_.bytes());
  DUET_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(metadata_.get(), host, at * 4, cudaMemcpyHostToDevice, compute_), "ring upload"));
  return CudaStatus(cudaStreamSynchronize(compute_), "ring upload");
}

void VirtualRingAttention::CopyStep(int step) {
  // recv[r] = send[(r - step) mod size]: ranks [step, size) from [0, size - step), ranks
  // [0, step) from [size - step, size).
  const int b = step % 2;
  const size_t rank_bytes = size_t(pool_rank_elems_) * sizeof(__nv_bfloat16);
  const DeviceAllocation* pairs[2][2] = {{&send_k_, &recv_k_[b]}, {&send_v_, &recv_v_[b]}};
  for (const auto& pair : pairs) {
    auto* src = pair[0]->as<char>();
    auto* dst = pair[1]->as<char>();
    DUET_CHECK_CUDA(cudaMemcpyAsync(dst + size_t(step) * rank_bytes, src, size_t(size_ - step) * rank_bytes,
                                    cudaMemcpyDeviceToDevice, comm_));
    DUET_CHECK_CUDA(cudaMemcpyAsync(dst, src + size_t(size_ - step) * rank_bytes, size_t(step) * rank_bytes,
                                    cudaMemcpyDeviceToDevice, comm_));
  }
}

void VirtualRingAttention::Attend(const __nv_bfloat16* q, float scale, __nv_bfloat16* out, RingStepEvents* events) {
  DUET_CHECK(!steps_.empty());
  DUET_CHECK_CUDA(cudaEventRecord(send_ready_, compute_));
  DUET_CHECK_CUDA(cudaStreamWaitEvent(comm_, send_ready_));
  auto issue_copy = [&](int step) {
    // The buffer's previous reader was step - 2.
    if (step >= 3) DUET_CHECK_CUDA(cudaStreamWaitEvent(comm_, attention_done_[step % 2]));
    if (events) DUET_CHECK_CUDA(cudaEventRecord(events->copy_begin[step], comm_));
    CopyStep(step);
    if (events) DUET_CHECK_CUDA(cudaEventRecord(events->copy_end[step], comm_));
    DUET_CHECK_CUDA(cudaEventRecord(copy_done_[step % 2], comm_));
  };
  if (size_ > 1) issue_copy(1);
  const int32_t* meta = metadata_.as<int32_t>();
  for (int step = 0; step < size_; ++step) {
    if (step >= 1) {
      DUET_CHECK_CUDA(cudaStreamWaitEvent(compute_, copy_done_[step % 2]));
      // The next copy overwrites the buffer step - 1 read: issued once that step is done.
      if (step + 1 < size_) issue_copy(step + 1);
    }
    const kernels::PagedKvView kv =
        step == 0 ? send_view() : View(recv_k_[step % 2].as<__nv_bfloat16>(), recv_v_[step % 2].as<__nv_bfloat16>());
    const kernels::PrefillAttentionParams p =
        StepParams(steps_[size_t(step)], meta, kv, step, state_.as<float>(), state_lse_.as<float>(), num_tokens_,
                   num_q_heads_, pages_per_rank_, q, scale);
    if (events) DUET_CHECK_CUDA(cudaEventRecord(events->attention_begin[step], compute_));
    kernels::PrefillAttention(p, compute_);
    if (events) DUET_CHECK_CUDA(cudaEventRecord(events->attention_end[step], compute_));
    DUET_CHECK_CUDA(cudaEventRecord(attention_done_[step % 2], compute_));
  }
  kernels::AttentionStateToBf16(state_.as<float>(), int64_t(num_tokens_) * num_q_heads_ * head_dim_, out, compute_);
}

RankRingAttention::RankRingAttention(int rank, int size, int max_rows, int num_q_heads, int num_kv_heads, int head_dim,
                                     cudaStream_t compute)
    : rank_(rank),
      size_(size),
      max_rows_(max_rows),
      num_q_heads_(num_q_heads),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      pages_((max_rows + kBlockSize - 1) / kBlockSize),
      compute_(compute) {}

absl::StatusOr<std::unique_ptr<RankRingAttention>> RankRingAttention::Create(int rank, int size, int max_rows,
                                                                             int num_q_heads,
                                                                             int num_kv_heads, int head_dim,
                                                                             DeviceArena& arena, cudaStream_t compute) {
  DUET_CHECK(rank >= 0 && rank < size && max_rows >= 1);
  std::unique_ptr<RankRingAttention> ring(
      new RankRingAttention(rank, size, max_rows, num_q_heads, num_kv_heads, head_dim, compute));
  const size_t pool_bytes = size_t(ring->pages_) * size_t(num_kv_heads) * kBlockSize * size_t(head_dim) *
                            sizeof(__nv_bfloat16);
  DUET_ASSIGN_OR_RETURN(ring->send_k_, arena.Allocate(pool_bytes, "ring attention send K"));
  DUET_ASSIGN_OR_RETURN(ring->send_v_, arena.Allocate(pool_bytes, "ring attention send V"));
  for (int b = 0; b < 2; ++b) {
    DUET_ASSIGN_OR_RETURN(ring->recv_k_[b], arena.Allocate(pool_bytes, "ring attention receive K"));
    DUET_ASSIGN_OR_RETURN(ring->recv_v_[b], arena.Allocate(pool_bytes, "ring attention receive V"));
  }
  const size_t rows = size_t(max_rows) * size_t(num_q_heads);
  DUET_ASSIGN_OR_RETURN(ring->state_, arena.Allocate(rows * size_t(head_dim) * 4, "ring attention state"));
  DUET_ASSIGN_OR_RETURN(ring->state_lse_, arena.Allocate(rows * 4, "ring attention log-sum-exp"));
  DUET_ASSIGN_OR_RETURN(ring->send_slots_, arena.Allocate(size_t(max_rows) * 4, "ring attention slots"));
  // The slots and, per step, at most two calls of this rank (parallel/ring_schedule.h).
  const size_t ints = size_t(max_rows) + size_t(size) * (2 * (4 + size_t(ring->pages_)) + 1);
  DUET_ASSIGN_OR_RETURN(ring->metadata_, arena.Allocate(ints * 4, "ring attention metadata"));
  DUET_RETURN_IF_ERROR(ring->host_.Resize(ints * 4));
  return ring;
}

kernels::PagedKvView RankRingAttention::View(const DeviceAllocation& k, const DeviceAllocation& v) const {
  return kernels::PagedKvView{k.as<__nv_bfloat16>(), v.as<__nv_bfloat16>(), num_kv_heads_, kBlockSize, head_dim_};
}

std::array<void*, 2> RankRingAttention::held(int step) const {
  if (step == 0) return {send_k_.get(), send_v_.get()};
  return recv(step);
}

std::array<void*, 2> RankRingAttention::recv(int step) const {
  DUET_CHECK(step >= 1);
  return {recv_k_[step % 2].get(), recv_v_[step % 2].get()};
}

absl::Status RankRingAttention::Prepare(const parallel::RingAttentionSchedule& schedule) {
  const int64_t first_row = schedule.rank_rows[size_t(rank_)];
  num_rows_ = int(schedule.rank_rows[size_t(rank_) + 1] - first_row);
  int64_t most_rows = 0;
  for (int r = 0; r < schedule.size; ++r) {
    most_rows = std::max(most_rows, schedule.rank_rows[size_t(r) + 1] - schedule.rank_rows[size_t(r)]);
  }
  if (rank_ >= schedule.size || schedule.size > size_ || most_rows > max_rows_) {
    return absl::InternalError(absl::StrCat("ring schedule of ", schedule.num_tokens, " tokens over ", schedule.size,
                                            " ranks does not fit rank ", rank_, "'s ring (", max_rows_, " rows)"));
  }
  // Only the pages the largest rank fills travel (every rank's block has that many).
  const int pages = int((most_rows + kBlockSize - 1) / kBlockSize);
  block_bytes_ = size_t(pages) * size_t(num_kv_heads_) * kBlockSize * size_t(head_dim_) * sizeof(__nv_bfloat16);
  // Slots, then each step's arrays of this rank's calls, in one pinned buffer.
  size_t ints = size_t(num_rows_);
  std::vector<std::vector<parallel::RingAttentionCall>> mine(schedule.steps.size());
  for (size_t k = 0; k < schedule.steps.size(); ++k) {
    for (const parallel::RingAttentionCall& c : schedule.steps[k]) {
      if (c.rank == rank_) mine[k].push_back(c);
    }
    ints += mine[k].size() * (4 + size_t(pages)) + 1;
  }
  if (ints * 4 > metadata_.bytes()) return absl::InternalError("ring schedule has more calls than planned");
  int32_t* host = host_.as<int32_t>();
  for (int i = 0; i < num_rows_; ++i) host[i] = i;  // local row i sits in slot i of the send buffer
  size_t at = size_t(num_rows_);
  steps_.clear();
  auto page_base = [](const parallel::RingAttentionCall&) { return 0; };
  for (const std::vector<parallel::RingAttentionCall>& calls : mine) {
    steps_.push_back(WriteStepArrays(calls, first_row, pages, page_base, host, at));
  }
  DUET_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(send_slots_.get(), host, size_t(num_rows_) * 4, cudaMemcpyHostToDevice, compute_), "ring slots"));
  DUET_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(metadata_.get(), host, at * 4, cudaMemcpyHostToDevice, compute_),
                                  "ring upload"));
  return CudaStatus(cudaStreamSynchronize(compute_), "ring upload");
}

void RankRingAttention::AttendStep(int step, const __nv_bfloat16* q, float scale) {
  const RingStepArrays& a = steps_[size_t(step)];
  if (a.num_calls == 0) return;
  const std::array<void*, 2> block = held(step);
  const kernels::PagedKvView kv{static_cast<__nv_bfloat16*>(block[0]), static_cast<__nv_bfloat16*>(block[1]),
                                num_kv_heads_, kBlockSize, head_dim_};
  const int pages = int(block_bytes_ / (size_t(num_kv_heads_) * kBlockSize * size_t(head_dim_) * 2));
  kernels::PrefillAttention(StepParams(a, metadata_.as<int32_t>(), kv, step, state_.as<float>(),
                                       state_lse_.as<float>(), num_rows_, num_q_heads_, pages, q, scale),
                            compute_);
}

void RankRingAttention::WriteOutput(__nv_bfloat16* out) {
  kernels::AttentionStateToBf16(state_.as<float>(), int64_t(num_rows_) * num_q_heads_ * head_dim_, out, compute_);
}

}  // namespace duet::cuda

// What the benchmarks that time the paged decode attention share (attention_bench,
// bench/gpu/overlap_bench): a layer's random bf16 cache in which every sequence owns a shuffled,
// non-contiguous set of blocks, as after a while of serving, and the launch of a batch at one
// context length with its plan and workspace.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/attention/paged_attention.h"
#include "kernels/cuda_check.h"
#include "kernels/elementwise/random_fill.h"

namespace duet::kernels::bench {

class RandomPagedDecode {
 public:
  // Room for `max_batch` sequences of `max_context` tokens: K and V [max_batch * max_context /
  // block_size, num_kv_heads, block_size, head_dim], q and out [max_batch, num_q_heads, head_dim].
  RandomPagedDecode(int max_batch, int max_context, int num_q_heads, int num_kv_heads, int head_dim, int block_size)
      : max_batch_(max_batch), blocks_per_seq_((max_context + block_size - 1) / block_size) {
    const size_t num_blocks = size_t(max_batch) * size_t(blocks_per_seq_);
    const size_t cache_elems = num_blocks * size_t(num_kv_heads) * size_t(block_size) * size_t(head_dim);
    const size_t token_elems = size_t(max_batch) * size_t(num_q_heads) * size_t(head_dim);
    DUET_CUDA_CHECK(cudaMalloc(&k_, cache_elems * sizeof(__nv_bfloat16)));
    DUET_CUDA_CHECK(cudaMalloc(&v_, cache_elems * sizeof(__nv_bfloat16)));
    DUET_CUDA_CHECK(cudaMalloc(&q_, token_elems * sizeof(__nv_bfloat16)));
    DUET_CUDA_CHECK(cudaMalloc(&out_, token_elems * sizeof(__nv_bfloat16)));
    FillRandomBf16(k_, cache_elems, 1, 1.f, nullptr);
    FillRandomBf16(v_, cache_elems, 2, 1.f, nullptr);
    FillRandomBf16(q_, token_elems, 3, 1.f, nullptr);
    std::vector<int32_t> ids(num_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937_64(7));
    DUET_CUDA_CHECK(cudaMalloc(&tables_, ids.size() * sizeof(int32_t)));
    DUET_CUDA_CHECK(cudaMemcpy(tables_, ids.data(), ids.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    DUET_CUDA_CHECK(cudaMalloc(&lens_, size_t(max_batch) * sizeof(int32_t)));
    params_.q = q_;
    params_.kv = {k_, v_, num_kv_heads, block_size, head_dim};
    params_.block_tables = tables_;
    params_.context_lens = lens_;
    params_.out = out_;
    params_.num_q_heads = num_q_heads;
    params_.max_blocks_per_seq = blocks_per_seq_;
    params_.scale = 1.f / std::sqrt(float(head_dim));
  }
  ~RandomPagedDecode() {
    FreeWorkspace();
    for (void* p : {(void*)k_, (void*)v_, (void*)q_, (void*)out_, (void*)tables_, (void*)lens_}) cudaFree(p);
  }
  RandomPagedDecode(const RandomPagedDecode&) = delete;
  RandomPagedDecode& operator=(const RandomPagedDecode&) = delete;

  // `batch` sequences (<= max_batch) of `context` tokens each, planned for `planned_context`
  // (>= context: a CUDA graph plans for its largest context) on `num_sms` SMs.
  void Prepare(int batch, int context, int planned_context, int num_sms) {
    DUET_KERNEL_CHECK(batch <= max_batch_ && context <= planned_context);
    const std::vector<int32_t> lens(size_t(batch), context);
    DUET_CUDA_CHECK(cudaMemcpy(lens_, lens.data(), lens.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    FreeWorkspace();
    plan_ = PlanPagedDecodeAttention(batch, params_.num_q_heads, params_.kv.num_kv_heads, params_.kv.head_dim,
                                     planned_context, num_sms);
    if (plan_.workspace_bytes > 0) DUET_CUDA_CHECK(cudaMalloc(&params_.workspace, plan_.workspace_bytes));
    if (plan_.num_split_counters > 0) {
      const size_t bytes = size_t(plan_.num_split_counters) * sizeof(int32_t);
      DUET_CUDA_CHECK(cudaMalloc(&params_.split_counters, bytes));
      DUET_CUDA_CHECK(cudaMemset(params_.split_counters, 0, bytes));
    }
    params_.num_seqs = batch;
    context_ = context;
  }
  void Launch(cudaStream_t stream) const { PagedDecodeAttention(params_, plan_, stream); }

  const PagedDecodeAttentionPlan& plan() const { return plan_; }
  // The K and V bytes one launch reads.
  double KvBytes() const {
    return 2.0 * params_.num_seqs * context_ * params_.kv.num_kv_heads * params_.kv.head_dim * sizeof(__nv_bfloat16);
  }

 private:
  void FreeWorkspace() {
    if (params_.workspace != nullptr) cudaFree(params_.workspace);
    if (params_.split_counters != nullptr) cudaFree(params_.split_counters);
    params_.workspace = nullptr;
    params_.split_counters = nullptr;
  }

  const int max_batch_, blocks_per_seq_;
  __nv_bfloat16 *k_ = nullptr, *v_ = nullptr, *q_ = nullptr, *out_ = nullptr;
  int32_t *tables_ = nullptr, *lens_ = nullptr;
  PagedDecodeAttentionParams params_{};
  PagedDecodeAttentionPlan plan_{};
  int context_ = 0;
};

}  // namespace duet::kernels::bench

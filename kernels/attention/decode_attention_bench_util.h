// What the benchmarks that time the paged decode attention share (attention_bench,
// bench/gpu/overlap_bench): a layer's random bf16 cache in which every sequence owns a shuffled,
// non-contiguous set of blocks, as after a while of serving, and the launch of a batch at one
// context length with its plan and workspace.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/attention/paged_attention.h"
#include "kernels/cuda_check.h"
#include "kernels/device_buffer.h"
#include "kernels/elementwise/random_fill.h"

namespace duet::kernels::bench {

class RandomPagedDecode {
 public:
  // Room for `max_batch` sequences of `max_context` tokens: K and V [max_batch * max_context /
  // block_size, num_kv_heads, block_size, head_dim], q and out [max_batch, num_q_heads, head_dim].
  RandomPagedDecode(int max_batch, int max_context, int num_q_heads, int num_kv_heads, int head_dim, int block_size)
      : max_batch_(max_batch),
        blocks_per_seq_((max_context + block_size - 1) / block_size),
        k_(CacheElems(max_batch, blocks_per_seq_, num_kv_heads, block_size, head_dim)),
        v_(k_.size()),
        q_(size_t(max_batch) * size_t(num_q_heads) * size_t(head_dim)),
        out_(q_.size()),
        tables_(ShuffledBlockIds(size_t(max_batch) * size_t(blocks_per_seq_))),
        lens_(size_t(max_batch)) {
    FillRandomBf16(k_.get(), k_.size(), 1, 1.f, nullptr);
    FillRandomBf16(v_.get(), v_.size(), 2, 1.f, nullptr);
    FillRandomBf16(q_.get(), q_.size(), 3, 1.f, nullptr);
    params_.q = q_.get();
    params_.kv = {k_.get(), v_.get(), num_kv_heads, block_size, head_dim};
    params_.block_tables = tables_.get();
    params_.context_lens = lens_.get();
    params_.out = out_.get();
    params_.num_q_heads = num_q_heads;
    params_.max_blocks_per_seq = blocks_per_seq_;
    params_.scale = 1.f / std::sqrt(float(head_dim));
  }

  // `batch` sequences (<= max_batch) of `context` tokens each, planned for `planned_context`
  // (>= context: a CUDA graph plans for its largest context) on `num_sms` SMs.
  void Prepare(int batch, int context, int planned_context, int num_sms) {
    DUET_KERNEL_CHECK(batch <= max_batch_ && context <= planned_context);
    lens_.Upload(std::vector<int32_t>(size_t(max_batch_), context));
    plan_ = PlanPagedDecodeAttention(batch, params_.num_q_heads, params_.kv.num_kv_heads, params_.kv.head_dim,
                                     planned_context, num_sms);
    // A plan that does not split the contexts needs neither.
    workspace_ = plan_.workspace_bytes > 0
                     ? std::make_unique<DeviceBuffer<float>>(plan_.workspace_bytes / sizeof(float))
                     : nullptr;
    split_counters_ = plan_.num_split_counters > 0 ? std::make_unique<DeviceBuffer<int32_t>>(
                                                         std::vector<int32_t>(plan_.num_split_counters, 0))
                                                   : nullptr;
    params_.workspace = workspace_ != nullptr ? workspace_->get() : nullptr;
    params_.split_counters = split_counters_ != nullptr ? split_counters_->get() : nullptr;
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
  static size_t CacheElems(int max_batch, int blocks_per_seq, int num_kv_heads, int block_size, int head_dim) {
    return size_t(max_batch) * size_t(blocks_per_seq) * size_t(num_kv_heads) * size_t(block_size) * size_t(head_dim);
  }
  // Every block of the cache once, in a random order: sequence i owns the i-th run of them.
  static std::vector<int32_t> ShuffledBlockIds(size_t num_blocks) {
    std::vector<int32_t> ids(num_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937_64(7));
    return ids;
  }

  const int max_batch_, blocks_per_seq_;
  DeviceBuffer<__nv_bfloat16> k_, v_, q_, out_;
  DeviceBuffer<int32_t> tables_, lens_;
  std::unique_ptr<DeviceBuffer<float>> workspace_;
  std::unique_ptr<DeviceBuffer<int32_t>> split_counters_;
  PagedDecodeAttentionParams params_{};
  PagedDecodeAttentionPlan plan_{};
  int context_ = 0;
};

}  // namespace duet::kernels::bench

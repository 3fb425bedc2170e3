// One CTA of 1024 threads per row; no sort of the vocabulary, no atomics, no host synchronization.
//
//   1. One pass over the logits: max, sum exp(logit - max) (for the logprob) and argmax.
//      Greedy rows stop here.
//   2. Rows with only temperature / min_p: one sampling pass (below) over the whole row.
//   3. Rows with top_k / top_p: a pass builds a histogram of the scaled distance from the max,
//      d = (max - logit) / temperature, in log-spaced buckets (each thread counts into its own
//      shared-memory column), plus the count and mass of the min_p survivors. The buckets tell how
//      far down the ranking the top_k / top_p boundary can lie (top_p uses a lower bound of each
//      bucket's mass). If the tokens above that bucket fit in shared memory (<= 16384) they are
//      compacted there, bitonic-sorted by (logit desc, id asc), and min_p / top_k / top_p become
//      prefix lengths over the sorted candidates; the draw is a binary search in their prefix sums.
//      Otherwise the boundaries are found by bisection over the logits' order-preserving 32-bit keys
//      (one block-wide count/mass reduction per step) and the row is sampled with a threshold.
//   Sampling pass: each thread sums the weights of its surviving tokens, a block scan gives every
//   thread its interval of [0, total), and the thread whose interval holds u * total walks its
//   tokens again to find the one.
#include "kernels/sampling/sampling.h"

#include <atomic>
#include <cfloat>

#include <curand_kernel.h>

#include "kernels/cuda_check.h"
#include "kernels/elementwise/elementwise_common.cuh"
#include "kernels/launch.cuh"

namespace duet::kernels {
namespace {

using namespace elementwise_detail;

constexpr int kThreads = 1024;
// Buckets of d: [2^e, 2^(e+1)) of (d + 1) split in 8, for d + 1 < 64; the last one also takes all d >= 59.
constexpr int kBuckets = 48;
constexpr uint32_t kBucketBase = 0x3F8;  // float bits >> 20 of 1.0f
constexpr int kCandidateCapacity = 16384;
constexpr size_t kDynamicSmemBytes = kCandidateCapacity * sizeof(uint64_t);
static_assert(kBuckets * kThreads * sizeof(uint16_t) <= kDynamicSmemBytes, "histogram columns must fit");
// Slack on the lower bound of the bucket masses, for float rounding of the sums it is compared with.
constexpr float kMassBoundSlack = 1e-3f;

// The scaled distance from the max, its weight exp(-d) and its bucket, computed by the same
// non-contractible operations in every pass so that all passes agree bit for bit.
__device__ __forceinline__ float Distance(float logit, float max_logit, float inv_temperature) {
  return __fmul_rn(__fsub_rn(max_logit, logit), inv_temperature);
}
__device__ __forceinline__ float WeightOf(float distance) { return __expf(-distance); }
__device__ __forceinline__ int BucketOf(float distance) {
  const float x = __fadd_rn(distance, 1.f);
  if (!(x < 64.f)) return kBuckets - 1;  // also +inf and NaN
  return min(int((__float_as_uint(x) >> 20) - kBucketBase), kBuckets - 1);
}
// Every distance in bucket b (< kBuckets - 1) is below this.
__device__ __forceinline__ float BucketDistanceEnd(int b) {
  return __uint_as_float((kBucketBase + uint32_t(b) + 1) << 20) - 1.f;
}

// Order-preserving map of floats to unsigned integers (larger float, larger key).
__device__ __forceinline__ uint32_t AscendingKey(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float FromAscendingKey(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}
// A candidate as one integer whose ascending order is (logit descending, token id ascending).
__device__ __forceinline__ uint64_t PackCandidate(float logit, int token) {
  return (uint64_t(~AscendingKey(logit)) << 32) | uint32_t(token);
}
__device__ __forceinline__ float CandidateLogit(uint64_t c) { return FromAscendingKey(~uint32_t(c >> 32)); }
__device__ __forceinline__ int CandidateToken(uint64_t c) { return int(uint32_t(c)); }

// Calls f(logit, token) for this thread's tokens, always in the same order: 16-byte chunks
// threadIdx.x, threadIdx.x + blockDim.x, ... (kVec 4), or single tokens (kVec 1).
template <int kVec, typename F>
__device__ __forceinline__ void ForEachLogit(const float* __restrict__ row, int vocab, F&& f) {
  if constexpr (kVec == 4) {
    const float4* row4 = reinterpret_cast<const float4*>(row);
    const int chunks = vocab / 4;
#pragma unroll 4
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      const float4 v = __ldg(row4 + c);
      f(v.x, 4 * c);
      f(v.y, 4 * c + 1);
      f(v.z, 4 * c + 2);
      f(v.w, 4 * c + 3);
    }
  } else {
#pragma unroll 4
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) f(__ldg(row + i), i);
  }
}

__device__ __forceinline__ bool IsAllowed(const uint32_t* __restrict__ allowed, int token) {
  return (__ldg(allowed + (token >> 5)) >> (token & 31)) & 1u;
}
// ForEachLogit over the tokens `allowed` (a bitmask; nullptr: every token) lets through, in the same order.
template <int kVec, typename F>
__device__ __forceinline__ void ForEachAllowedLogit(const float* __restrict__ row, int vocab,
                                                    const uint32_t* __restrict__ allowed, F&& f) {
  ForEachLogit<kVec>(row, vocab, [&](float logit, int token) {
    if (allowed == nullptr || IsAllowed(allowed, token)) f(logit, token);
  });
}

// Running softmax statistics of raw logits: max, sum of exp(logit - max), first index of the max.
struct RowStats {
  float max;
  float sum;
  int argmax;
};
__device__ __forceinline__ RowStats Merge(const RowStats& a, const RowStats& b) {
  const float m = fmaxf(a.max, b.max);
  RowStats r;
  r.max = m;
  r.sum = a.sum * __expf(a.max - m) + b.sum * __expf(b.max - m);
  r.argmax = a.max > b.max ? a.argmax : (b.max > a.max ? b.argmax : min(a.argmax, b.argmax));
  return r;
}
__device__ __forceinline__ RowStats ShflXor(const RowStats& s, int mask) {
  return {__shfl_xor_sync(0xffffffffu, s.max, mask), __shfl_xor_sync(0xffffffffu, s.sum, mask),
          __shfl_xor_sync(0xffffffffu, s.argmax, mask)};
}
__device__ RowStats BlockMergeStats(RowStats s, RowStats* scratch) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) s = Merge(s, ShflXor(s, offset));
  if (lane == 0) scratch[warp] = s;
  __syncthreads();
  if (warp == 0) {  // kThreads / kWarpSize == kWarpSize: every lane has a warp's result
    s = scratch[lane];
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) s = Merge(s, ShflXor(s, offset));
    if (lane == 0) scratch[kWarpSize] = s;
  }
  __syncthreads();
  return scratch[kWarpSize];
}

// Sorts n (a power of two) keys ascending in shared memory.
__device__ void BitonicSort(uint64_t* keys, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int pair = threadIdx.x; pair < n / 2; pair += blockDim.x) {
        const int i = ((pair & ~(stride - 1)) << 1) | (pair & (stride - 1));
        const int j = i + stride;
        const uint64_t a = keys[i], b = keys[j];
        const bool ascending = (i & size) == 0;
        if ((a > b) == ascending) {
          keys[i] = b;
          keys[j] = a;
        }
      }
      __syncthreads();
    }
  }
}

// First index in [0, n) whose prefix sum (high half of the packed entry) satisfies pred; n if none.
template <typename Pred>
__device__ int FirstPrefix(const uint64_t* entries, int n, Pred pred) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (pred(__uint_as_float(uint32_t(entries[mid] >> 32)))) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

struct RowSettings {
  float inv_temperature;
  float min_p;  // in [0, 1]
  int top_k;    // 0: off
  float top_p;  // 1: off
};

template <int kVec>
__global__ void __launch_bounds__(kThreads, 1) SampleKernel(SamplingParams p) {
  extern __shared__ uint64_t dynamic_smem[];  // histogram columns, then the candidates
  __shared__ RowStats stats_scratch[kWarpSize + 1];
  __shared__ float float_scratch[kWarpSize + 1];
  __shared__ int int_scratch[kWarpSize + 1];
  __shared__ int bucket_count[kBuckets];
  __shared__ float uniform;
  __shared__ int cut_bucket, num_candidates;

  launch_detail::EnterDependentKernel();
  const int r = blockIdx.x, tid = threadIdx.x;
  const int vocab = p.vocab;
  const float* row = p.logits + int64_t(r) * vocab;
  const float temperature = p.temperature != nullptr ? p.temperature[r] : 0.f;
  const bool greedy = !(temperature > 0.f);
  if (!greedy && tid == 0) {
    curandStatePhilox4_32_10_t rng;
    curand_init(p.seeds != nullptr ? p.seeds[r] : 0, p.offsets != nullptr ? p.offsets[r] : 0, 0, &rng);
    uniform = float(curand(&rng) >> 8) * (1.f / 16777216.f);  // [0, 1), 24 bits
  }

  // A grammar's mask: the row is sampled among the tokens it allows only (the logprob stays that of
  // the raw logits, as on the host sampler).
  const int mask_index = p.bitmask_index != nullptr ? p.bitmask_index[r] : -1;
  const uint32_t* allowed = mask_index >= 0 ? p.token_bitmask + int64_t(mask_index) * p.bitmask_words : nullptr;

  // 1. Softmax statistics and argmax of the raw logits.
  auto row_stats = [&](const uint32_t* mask) {
    RowStats stats{-FLT_MAX, 0.f, INT_MAX};
    ForEachAllowedLogit<kVec>(row, vocab, mask, [&](float logit, int token) {
      if (logit > stats.max) {
        stats.sum = stats.sum * __expf(stats.max - logit) + 1.f;
        stats.max = logit;
        stats.argmax = token;
      } else {
        stats.sum += __expf(logit - stats.max);
      }
    });
    return BlockMergeStats(stats, stats_scratch);
  };
  const RowStats stats = row_stats(nullptr);
  const float log_normalizer = stats.max + __logf(stats.sum);
  // The largest allowed logit and its token: a second pass over a masked row.
  const RowStats allowed_stats = allowed != nullptr ? row_stats(allowed) : stats;
  const float max_logit = allowed_stats.max;
  auto finish = [&](int token) {  // called by exactly one thread
    p.tokens_out[r] = token;
    if (p.logprobs_out != nullptr) p.logprobs_out[r] = row[token] - log_normalizer;
  };
  // No allowed token with a finite logit (a mask that allows nothing): token 0, whatever the mode.
  if (greedy || allowed_stats.argmax == INT_MAX) {
    if (tid == 0) finish(allowed_stats.argmax == INT_MAX ? 0 : allowed_stats.argmax);
    return;
  }

  RowSettings s;
  s.inv_temperature = 1.f / temperature;
  s.min_p = p.min_p != nullptr ? fminf(fmaxf(p.min_p[r], 0.f), 1.f) : 0.f;
  s.top_k = p.top_k != nullptr && p.top_k[r] > 0 && p.top_k[r] < vocab ? p.top_k[r] : 0;
  s.top_p = p.top_p != nullptr ? fminf(fmaxf(p.top_p[r], FLT_MIN), 1.f) : 1.f;
  const bool use_top_k = s.top_k > 0, use_top_p = s.top_p < 1.f;

  // Draws one token among those with key >= min_key and weight >= min_p, each with probability
  // proportional to its weight (see the file comment).
  auto sample_with_threshold = [&](uint32_t min_key) {
    float partial = 0.f;
    ForEachAllowedLogit<kVec>(row, vocab, allowed, [&](float logit, int) {
      if (AscendingKey(logit) < min_key) return;
      const float w = WeightOf(Distance(logit, max_logit, s.inv_temperature));
      if (w >= s.min_p) partial += w;
    });
    float total;
    const float start = BlockExclusiveScan(partial, float_scratch, &total);
    const float target = uniform * total;
    const int owner = BlockMax(start <= target && partial > 0.f ? tid : -1, int_scratch);
    if (tid != owner) return;
    float cumulative = start;
    int chosen = -1, last = -1;
    ForEachAllowedLogit<kVec>(row, vocab, allowed, [&](float logit, int token) {
      if (chosen >= 0 || AscendingKey(logit) < min_key) return;
      const float w = WeightOf(Distance(logit, max_logit, s.inv_temperature));
      if (!(w >= s.min_p) || w == 0.f) return;
      last = token;
      cumulative += w;
      if (target < cumulative) chosen = token;
    });
    finish(chosen >= 0 ? chosen : last);  // `last`: the target fell past the sum by rounding
  };
  if (!use_top_k && !use_top_p) {
    sample_with_threshold(0);
    return;
  }

  // 3. Histogram of distances (thread-private columns) and the min_p survivors' count and mass.
  uint16_t* histogram = reinterpret_cast<uint16_t*>(dynamic_smem);  // [kBuckets][kThreads]
  for (int b = 0; b < kBuckets; ++b) histogram[b * kThreads + tid] = 0;
  int survivors = 0;
  float survivor_mass = 0.f;
  ForEachAllowedLogit<kVec>(row, vocab, allowed, [&](float logit, int) {
    const float d = Distance(logit, max_logit, s.inv_temperature);
    ++histogram[BucketOf(d) * kThreads + tid];
    const float w = WeightOf(d);
    if (w >= s.min_p) {
      ++survivors;
      survivor_mass += w;
    }
  });
  __syncthreads();
  const int lane = tid % kWarpSize, warp = tid / kWarpSize;
  for (int b = warp; b < kBuckets; b += kThreads / kWarpSize) {
    int count = 0;
    for (int t = lane; t < kThreads; t += kWarpSize) count += histogram[b * kThreads + t];
    count = WarpSum(count);
    if (lane == 0) bucket_count[b] = count;
  }
  survivors = BlockSum(survivors, int_scratch);
  survivor_mass = BlockSum(survivor_mass, float_scratch);
  if (tid == 0) {
    // The bucket holding the top_k-th token, or else the first bucket by which the mass surely reaches top_p.
    int cut = kBuckets - 1, cumulative = 0;
    if (use_top_k) {
      for (int b = 0; b < kBuckets; ++b) {
        cumulative += bucket_count[b];
        if (cumulative >= s.top_k) {
          cut = b;
          break;
        }
      }
    } else {
      const float target = s.top_p * survivor_mass;
      float mass_lower_bound = 0.f;
      for (int b = 0; b < kBuckets - 1; ++b) {
        mass_lower_bound += float(bucket_count[b]) * __expf(-BucketDistanceEnd(b));
        if (mass_lower_bound * (1.f - kMassBoundSlack) >= target) {
          cut = b;
          break;
        }
      }
    }
    int n = 0;
    for (int b = 0; b <= cut; ++b) n += bucket_count[b];
    cut_bucket = cut;
    num_candidates = n;
  }
  __syncthreads();
  const int cut = cut_bucket, n = num_candidates;

  if (n <= kCandidateCapacity) {
    // Compact the tokens of buckets <= cut into shared memory (over the histogram, once every
    // thread has read its column: the scan synchronizes).
    int mine = 0;
    for (int b = 0; b <= cut; ++b) mine += histogram[b * kThreads + tid];
    int unused_total;
    int slot = BlockExclusiveScan(mine, int_scratch, &unused_total);
    uint64_t* candidates = dynamic_smem;
    ForEachAllowedLogit<kVec>(row, vocab, allowed, [&](float logit, int token) {
      if (BucketOf(Distance(logit, max_logit, s.inv_temperature)) <= cut && slot < kCandidateCapacity) {
        candidates[slot++] = PackCandidate(logit, token);
      }
    });
    int padded = 1;
    while (padded < n) padded <<= 1;
    for (int i = n + tid; i < padded; i += kThreads) candidates[i] = ~uint64_t(0);
    __syncthreads();
    BitonicSort(candidates, padded);

    // min_p and top_k as a prefix of the sorted candidates; then prefix sums of the kept weights,
    // written in place as (sum bits << 32 | token).
    const int per_thread = (n + kThreads - 1) / kThreads;
    const int begin = min(tid * per_thread, n), end = min(begin + per_thread, n);
    int local_survivors = 0;
    for (int i = begin; i < end; ++i) {
      local_survivors += WeightOf(Distance(CandidateLogit(candidates[i]), max_logit, s.inv_temperature)) >= s.min_p;
    }
    const int min_p_survivors = BlockSum(local_survivors, int_scratch);
    const int keep = use_top_k ? min(s.top_k, min_p_survivors) : min_p_survivors;
    float local_mass = 0.f;
    for (int i = begin; i < min(end, keep); ++i) {
      local_mass += WeightOf(Distance(CandidateLogit(candidates[i]), max_logit, s.inv_temperature));
    }
    float kept_mass;
    float prefix = BlockExclusiveScan(local_mass, float_scratch, &kept_mass);
    for (int i = begin; i < end; ++i) {
      const uint64_t c = candidates[i];
      if (i < keep) prefix += WeightOf(Distance(CandidateLogit(c), max_logit, s.inv_temperature));
      candidates[i] = (uint64_t(__float_as_uint(prefix)) << 32) | uint32_t(CandidateToken(c));
    }
    __syncthreads();
    if (tid == 0) {
      int kept = keep;
      if (use_top_p) {
        const float target = s.top_p * (use_top_k ? kept_mass : survivor_mass);
        kept = min(FirstPrefix(candidates, keep, [&](float sum) { return sum >= target; }) + 1, keep);
      }
      const float total = __uint_as_float(uint32_t(candidates[kept - 1] >> 32));
      const float target = uniform * total;
      const int i = min(FirstPrefix(candidates, kept, [&](float sum) { return sum > target; }), kept - 1);
      finish(CandidateToken(candidates[i]));
    }
    return;
  }

  // Too many candidates: thresholds on the logit key by bisection. count_mass(t) gives the count
  // and mass of min_p survivors with key >= t.
  auto count_mass = [&](uint32_t min_key, int* count, float* mass) {
    int c = 0;
    float m = 0.f;
    ForEachAllowedLogit<kVec>(row, vocab, allowed, [&](float logit, int) {
      if (AscendingKey(logit) < min_key) return;
      const float w = WeightOf(Distance(logit, max_logit, s.inv_temperature));
      if (w >= s.min_p) {
        ++c;
        m += w;
      }
    });
    *count = BlockSum(c, int_scratch);
    *mass = BlockSum(m, float_scratch);
  };
  const uint64_t key_end = uint64_t(AscendingKey(max_logit)) + 1;  // nothing at or above
  uint32_t min_key = 0;
  float kept_mass = survivor_mass;
  if (use_top_k && s.top_k < survivors) {
    // Largest key with at least top_k survivors at or above it.
    uint64_t lo = 0, hi = key_end;
    while (hi - lo > 1) {
      const uint64_t mid = lo + (hi - lo) / 2;
      int count;
      float mass;
      count_mass(uint32_t(mid), &count, &mass);
      if (count >= s.top_k) {
        lo = mid;
        kept_mass = mass;
      } else {
        hi = mid;
      }
    }
    min_key = uint32_t(lo);
  }
  if (use_top_p) {
    // Largest key whose survivors at or above it carry at least top_p of the kept mass.
    const float target = s.top_p * kept_mass;
    uint64_t lo = min_key, hi = key_end;
    while (hi - lo > 1) {
      const uint64_t mid = lo + (hi - lo) / 2;
      int count;
      float mass;
      count_mass(uint32_t(mid), &count, &mass);
      if (mass >= target) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    min_key = uint32_t(lo);
  }
  sample_with_threshold(min_key);
}

// Opts the kernel into more than 48 KiB of dynamic shared memory, once per device (the
// attribute belongs to the device's context), so that the first launch on each device is the
// only one that makes this call: do it before capturing graphs.
template <int kVec>
void AllowLargeSharedMemory() {
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> done[kMaxDevices];
  int device = 0;
  DUET_CUDA_CHECK(cudaGetDevice(&device));
  if (device < kMaxDevices && done[device].load(std::memory_order_acquire)) return;
  DUET_CUDA_CHECK(cudaFuncSetAttribute(SampleKernel<kVec>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(kDynamicSmemBytes)));
  if (device < kMaxDevices) done[device].store(true, std::memory_order_release);
}

template <int kVec>
void Launch(const SamplingParams& p, cudaStream_t stream) {
  AllowLargeSharedMemory<kVec>();
  launch_detail::LaunchKernel(SampleKernel<kVec>, dim3(p.rows), dim3(kThreads), kDynamicSmemBytes, stream, p);
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void SampleTokens(const SamplingParams& p, cudaStream_t stream) {
  DUET_KERNEL_CHECK(p.rows >= 0 && p.vocab > 0);
  // Histogram columns count at most ceil(vocab / kThreads) (+3) tokens each in 16 bits.
  DUET_KERNEL_CHECK(p.vocab <= 60000 * kThreads);
  DUET_KERNEL_CHECK(p.logits != nullptr && p.tokens_out != nullptr);
  DUET_KERNEL_CHECK(p.bitmask_index == nullptr ||
                    (p.token_bitmask != nullptr && int64_t(p.bitmask_words) * 32 >= p.vocab));
  if (p.rows == 0) return;
  if (p.vocab % 4 == 0 && IsAligned(p.logits, 16)) {
    Launch<4>(p, stream);
  } else {
    Launch<1>(p, stream);
  }
}

}  // namespace duet::kernels

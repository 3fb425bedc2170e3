#include "kernels/copy/range_copy.h"

#include <algorithm>

#include "kernels/launch.cuh"

namespace duet::kernels {
namespace {

using launch_detail::LaunchKernel;

constexpr int kThreads = 256;
constexpr uint64_t kTileBytes = 8 * 1024;  // per CTA: 2 16-byte words per thread (many CTAs for a few MiB)
static_assert(kTileBytes % (kThreads * 16) == 0);
constexpr size_t kMaxBuffers = 128;        // 64 layers' K and V
constexpr size_t kMaxRanges = 512;

template <int kBuffers, int kRanges>
struct Params {
  BufferPair buffers[kBuffers];
  ByteRange ranges[kRanges];
};

// grid: x = 8 KiB tile of the range, y = range, z = buffer. A dependent launch
// (kernels/launch.cuh): a layer's copy gets resident while the kernel that wrote the layer
// finishes, and the next layer's first kernel while the copy does, instead of each launch waiting
// for the one before to drain (a layer of a few MiB moves in about the time a launch takes to
// ramp up and drain: docs/BENCHMARKS.md, "KV transfer").
template <typename Word, int kBuffers, int kRanges>
__global__ void CopyRangesKernel(const __grid_constant__ Params<kBuffers, kRanges> p) {
  launch_detail::EnterDependentKernel();
  const ByteRange r = p.ranges[blockIdx.y];
  const uint64_t start = uint64_t(blockIdx.x) * kTileBytes;
  if (start >= r.bytes) return;
  const uint64_t words = min(kTileBytes, r.bytes - start) / sizeof(Word);
  const Word* __restrict__ src = reinterpret_cast<const Word*>(p.buffers[blockIdx.z].src + r.src_offset + start);
  Word* __restrict__ dst = reinterpret_cast<Word*>(p.buffers[blockIdx.z].dst + r.dst_offset + start);
  // Every load of the tile issued before the first store: one trip to memory, not one per word
  // (a layer's copy of a few MiB is that latency, twice, more than its bandwidth).
  constexpr int kWordsPerThread = int(kTileBytes / (kThreads * sizeof(Word)));
  Word tile[kWordsPerThread];
#pragma unroll
  for (int k = 0; k < kWordsPerThread; ++k) {
    const uint64_t i = threadIdx.x + uint64_t(k) * kThreads;
    if (i < words) tile[k] = src[i];
  }
#pragma unroll
  for (int k = 0; k < kWordsPerThread; ++k) {
    const uint64_t i = threadIdx.x + uint64_t(k) * kThreads;
    if (i < words) dst[i] = tile[k];
  }
}

template <int kBuffers, int kRanges>
void Launch(const BufferPair* buffers, size_t num_buffers, const ByteRange* ranges, size_t num_ranges,
            cudaStream_t stream) {
  Params<kBuffers, kRanges> p;
  uint64_t longest = 0, bits = 0;
  for (size_t b = 0; b < num_buffers; ++b) {
    p.buffers[b] = buffers[b];
    bits |= reinterpret_cast<uintptr_t>(buffers[b].src) | reinterpret_cast<uintptr_t>(buffers[b].dst);
  }
  for (size_t i = 0; i < num_ranges; ++i) {
    p.ranges[i] = ranges[i];
    longest = std::max(longest, ranges[i].bytes);
    bits |= ranges[i].src_offset | ranges[i].dst_offset | ranges[i].bytes;
  }
  const dim3 grid(unsigned((longest + kTileBytes - 1) / kTileBytes), unsigned(num_ranges), unsigned(num_buffers));
  if ((bits & 15) == 0) {
    LaunchKernel(CopyRangesKernel<uint4, kBuffers, kRanges>, grid, dim3(kThreads), 0, stream, p);
  } else {
    LaunchKernel(CopyRangesKernel<unsigned char, kBuffers, kRanges>, grid, dim3(kThreads), 0, stream, p);
  }
}

// One launch of at most kMaxBuffers buffers and kMaxRanges ranges, its parameters sized to them.
template <int kBuffers>
void LaunchForRanges(const BufferPair* buffers, size_t num_buffers, const ByteRange* ranges, size_t num_ranges,
                     cudaStream_t stream) {
  if (num_ranges <= 8) return Launch<kBuffers, 8>(buffers, num_buffers, ranges, num_ranges, stream);
  if (num_ranges <= 64) return Launch<kBuffers, 64>(buffers, num_buffers, ranges, num_ranges, stream);
  Launch<kBuffers, kMaxRanges>(buffers, num_buffers, ranges, num_ranges, stream);
}

}  // namespace

void CopyRanges(const BufferPair* buffers, size_t num_buffers, const ByteRange* ranges, size_t num_ranges,
                cudaStream_t stream) {
  for (size_t b = 0; b < num_buffers; b += kMaxBuffers) {
    const size_t some_buffers = std::min(num_buffers - b, kMaxBuffers);
    for (size_t r = 0; r < num_ranges; r += kMaxRanges) {
      const size_t some_ranges = std::min(num_ranges - r, kMaxRanges);
      if (some_buffers <= 2) {
        LaunchForRanges<2>(buffers + b, some_buffers, ranges + r, some_ranges, stream);
      } else {
        LaunchForRanges<kMaxBuffers>(buffers + b, some_buffers, ranges + r, some_ranges, stream);
      }
    }
  }
}

}  // namespace duet::kernels

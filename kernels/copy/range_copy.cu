#include "kernels/copy/range_copy.h"

#include <algorithm>

#include "kernels/launch.cuh"

namespace duet::kernels {
namespace {

using launch_detail::LaunchKernel;

constexpr int kThreads = 256;
constexpr uint64_t kTileBytes = 8 * 1024;  // per CTA: 2 16-byte words per thread (many CTAs for a few MiB)

template <int kCapacity>
struct Params {
  const char* src[2];
  char* dst[2];
  ByteRange ranges[kCapacity];
};

// grid: x = 8 KiB tile of the range, y = range, z = buffer (K, V). A dependent launch
// (kernels/launch.cuh): a layer's copy gets resident while the kernel that wrote the layer
// finishes, and the next layer's first kernel while the copy does, instead of each launch waiting
// for the one before to drain (a layer of a few MiB moves in about the time a launch takes to
// ramp up and drain: docs/BENCHMARKS.md, "KV copies as dependent launches").
template <typename Word, int kCapacity>
__global__ void CopyRangesKernel(const __grid_constant__ Params<kCapacity> p) {
  launch_detail::EnterDependentKernel();
  const ByteRange r = p.ranges[blockIdx.y];
  const uint64_t start = uint64_t(blockIdx.x) * kTileBytes;
  if (start >= r.bytes) return;
  const uint64_t words = min(kTileBytes, r.bytes - start) / sizeof(Word);
  const Word* src = reinterpret_cast<const Word*>(p.src[blockIdx.z] + r.src_offset + start);
  Word* dst = reinterpret_cast<Word*>(p.dst[blockIdx.z] + r.dst_offset + start);
#pragma unroll 2
  for (uint64_t i = threadIdx.x; i < words; i += kThreads) dst[i] = src[i];
}

template <int kCapacity>
void Launch(const char* const src[2], char* const dst[2], const ByteRange* ranges, size_t num_ranges, cudaStream_t stream) {
  Params<kCapacity> p;
  uint64_t longest = 0, bits = 0;
  for (int b = 0; b < 2; ++b) {
    p.src[b] = src[b];
    p.dst[b] = dst[b];
    bits |= reinterpret_cast<uintptr_t>(src[b]) | reinterpret_cast<uintptr_t>(dst[b]);
  }
  for (size_t i = 0; i < num_ranges; ++i) {
    p.ranges[i] = ranges[i];
    longest = std::max(longest, ranges[i].bytes);
    bits |= ranges[i].src_offset | ranges[i].dst_offset | ranges[i].bytes;
  }
  const dim3 grid(unsigned((longest + kTileBytes - 1) / kTileBytes), unsigned(num_ranges), 2);
  if ((bits & 15) == 0) {
    LaunchKernel(CopyRangesKernel<uint4, kCapacity>, grid, dim3(kThreads), 0, stream, p);
  } else {
    LaunchKernel(CopyRangesKernel<unsigned char, kCapacity>, grid, dim3(kThreads), 0, stream, p);
  }
}

}  // namespace

void CopyRanges(const char* const src[2], char* const dst[2], const ByteRange* ranges, size_t num_ranges,
                cudaStream_t stream) {
  for (size_t first = 0; first < num_ranges;) {
    const size_t n = std::min<size_t>(num_ranges - first, 512);
    if (n <= 8) {
      Launch<8>(src, dst, ranges + first, n, stream);
    } else if (n <= 64) {
      Launch<64>(src, dst, ranges + first, n, stream);
    } else {
      Launch<512>(src, dst, ranges + first, n, stream);
    }
    first += n;
  }
}

}  // namespace duet::kernels

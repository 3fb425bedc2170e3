#include "bench/gpu/read_bandwidth.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "bench/sample_stats.h"

namespace duet::bench {
namespace {

// Grid-stride streaming read: each thread keeps kLoads independent 16-byte loads in flight
// (consecutive threads read consecutive 16-byte words, so every warp load is coalesced) and folds
// them into one word. Each warp stores its fold, so the compiler must keep every load.
template <int kLoads>
__global__ void StreamRead(const uint4* __restrict__ data, size_t num_words, uint32_t* __restrict__ warp_folds) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t fold = 0;
  for (; i + (kLoads - 1) * stride < num_words; i += kLoads * stride) {
    uint4 v[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) v[u] = data[i + u * stride];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) fold ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < num_words; i += stride) {
    const uint4 v = data[i];
    fold ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  for (int offset = 16; offset > 0; offset /= 2) fold ^= __shfl_xor_sync(0xffffffffu, fold, offset);
  const size_t warp = (size_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (threadIdx.x % 32 == 0) warp_folds[warp] = fold;
}

struct Shape {
  int threads_per_block, blocks_per_sm, loads_in_flight;
};

template <int kLoads>
cudaError_t Launch(const Shape& shape, int num_sms, const uint4* data, size_t num_words, uint32_t* folds) {
  StreamRead<kLoads><<<shape.blocks_per_sm * num_sms, shape.threads_per_block>>>(data, num_words, folds);
  return cudaGetLastError();
}

cudaError_t LaunchShape(const Shape& shape, int num_sms, const uint4* data, size_t num_words, uint32_t* folds) {
  return shape.loads_in_flight == 8 ? Launch<8>(shape, num_sms, data, num_words, folds)
                                    : Launch<4>(shape, num_sms, data, num_words, folds);
}

// Warm-up launches, then `repeats` launches each between two events; bytes per second.
cudaError_t TimeShape(const Shape& shape, int num_sms, const uint4* data, size_t num_words, uint32_t* folds,
                      int repeats, ReadBandwidthSample& sample) {
  cudaEvent_t start = nullptr, stop = nullptr;
  cudaError_t err = cudaEventCreate(&start);
  if (err == cudaSuccess) err = cudaEventCreate(&stop);
  std::vector<double> rates;
  const double bytes = double(num_words) * sizeof(uint4);
  for (int rep = -3; rep < repeats && err == cudaSuccess; ++rep) {
    err = cudaEventRecord(start);
    if (err == cudaSuccess) err = LaunchShape(shape, num_sms, data, num_words, folds);
    if (err == cudaSuccess) err = cudaEventRecord(stop);
    if (err == cudaSuccess) err = cudaEventSynchronize(stop);
    float ms = 0;
    if (err == cudaSuccess) err = cudaEventElapsedTime(&ms, start, stop);
    if (err == cudaSuccess && rep >= 0) rates.push_back(bytes / (double(ms) * 1e-3));
  }
  if (start != nullptr) cudaEventDestroy(start);
  if (stop != nullptr) cudaEventDestroy(stop);
  if (err != cudaSuccess) return err;
  const SampleStats stats = Summarize(rates);
  sample = ReadBandwidthSample{shape.threads_per_block, shape.blocks_per_sm, shape.loads_in_flight, stats.median,
                               stats.min, stats.max};
  return cudaSuccess;
}

}  // namespace

ReadBandwidth MeasureReadBandwidth(size_t buffer_bytes, int repeats) {
  ReadBandwidth result;
  result.buffer_bytes = buffer_bytes / sizeof(uint4) * sizeof(uint4);
  result.repeats = std::max(repeats, 1);
  int device = 0, num_sms = 0;
  result.error = cudaGetDevice(&device);
  if (result.error == cudaSuccess) result.error = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
  // A few shapes around full occupancy; the fastest median is the ceiling.
  const Shape shapes[] = {{512, 4, 4}, {256, 8, 4}, {512, 2, 8}, {1024, 2, 4}};
  size_t max_warps = 0;
  for (const Shape& s : shapes) max_warps = std::max(max_warps, size_t(s.threads_per_block / 32) * s.blocks_per_sm * num_sms);
  void* data = nullptr;
  void* folds = nullptr;
  if (result.error == cudaSuccess) result.error = cudaMalloc(&data, result.buffer_bytes);
  if (result.error == cudaSuccess) result.error = cudaMalloc(&folds, max_warps * sizeof(uint32_t));
  if (result.error == cudaSuccess) result.error = cudaMemset(data, 0x5a, result.buffer_bytes);
  for (const Shape& shape : shapes) {
    if (result.error != cudaSuccess) break;
    ReadBandwidthSample sample;
    result.error = TimeShape(shape, num_sms, static_cast<const uint4*>(data), result.buffer_bytes / sizeof(uint4),
                             static_cast<uint32_t*>(folds), result.repeats, sample);
    if (result.error != cudaSuccess) break;
    result.shapes.push_back(sample);
    result.bytes_per_s = std::max(result.bytes_per_s, sample.median_bytes_per_s);
  }
  cudaFree(data);
  cudaFree(folds);
  return result;
}

std::string ReadBandwidth::Describe() const {
  std::string text;
  char line[160];
  for (const ReadBandwidthSample& s : shapes) {
    std::snprintf(line, sizeof(line),
                  "  streaming read, %4d threads x %d blocks/SM x %d loads of 16 B: median %.0f GB/s (%.0f-%.0f)%s\n",
                  s.threads_per_block, s.blocks_per_sm, s.loads_in_flight, s.median_bytes_per_s / 1e9,
                  s.min_bytes_per_s / 1e9, s.max_bytes_per_s / 1e9,
                  s.median_bytes_per_s == bytes_per_s ? "  <- ceiling" : "");
    text += line;
  }
  return text;
}

}  // namespace duet::bench

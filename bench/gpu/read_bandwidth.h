// The device-memory read ceiling: a streaming-read kernel over a buffer many times the L2, the
// figure a decode step's floor divides its bytes by (a step reads weights and KV; it writes
// almost nothing). A device-to-device copy counts read + write traffic, which is not the same
// ceiling: reads alone run faster.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include <cuda_runtime.h>

namespace duet::bench {

// One launch shape of the streaming-read kernel and its bytes read per second over the repeats.
struct ReadBandwidthSample {
  int threads_per_block = 0;
  int blocks_per_sm = 0;
  int loads_in_flight = 0;  // independent 16-byte loads per thread per loop iteration
  double median_bytes_per_s = 0;
  double min_bytes_per_s = 0;
  double max_bytes_per_s = 0;
};

struct ReadBandwidth {
  size_t buffer_bytes = 0;
  int repeats = 0;
  std::vector<ReadBandwidthSample> shapes;  // every launch shape tried
  double bytes_per_s = 0;                   // the highest median among them: the ceiling
  cudaError_t error = cudaSuccess;          // not cudaSuccess: the figures are missing
  std::string Describe() const;             // one line per shape, the ceiling marked
};

// Reads `buffer_bytes` of device memory (rounded down to 16 bytes) per timed launch on the
// current device, after warm-up launches, `repeats` timed launches per shape; the medians over
// the repeats. The buffer is filled with non-zero bytes first.
ReadBandwidth MeasureReadBandwidth(size_t buffer_bytes = size_t(4) << 30, int repeats = 20);

}  // namespace duet::bench

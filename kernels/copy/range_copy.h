// Copies a list of byte ranges between pairs of device buffers: the K and V pools of one or more
// layers into another cache's (kvtransfer's CUDA IPC path, where the destinations are another
// process's pools opened with cudaIpcOpenMemHandle). The batched copy-engine call moves such lists
// of 32-128 KiB ranges at ~35 GB/s on an H200; this kernel at the device's copy rate.
#pragma once

#include <cstdint>
#include <cstddef>

#include <cuda_runtime.h>

namespace duet::kernels {

// One buffer to copy from and the buffer its ranges go to (a layer's K or V pool and the peer's).
struct BufferPair {
  const char* src = nullptr;
  char* dst = nullptr;
};

struct ByteRange {
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t bytes = 0;
};

// Copies every range from b.src + src_offset to b.dst + dst_offset for every buffer pair b (a
// layer's K and V, or those of several layers), stream-ordered. The
// buffers and ranges travel in the kernel's parameters: one launch for up to 128 buffers and 512
// ranges (sized to the lists, so a short list launches as cheaply as any kernel), more launches
// beyond. 16-byte accesses when every base, offset and size is a multiple of 16, else byte by
// byte. Destinations must not overlap.
void CopyRanges(const BufferPair* buffers, size_t num_buffers, const ByteRange* ranges, size_t num_ranges,
                cudaStream_t stream);

}  // namespace duet::kernels

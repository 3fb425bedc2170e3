// Copies a list of byte ranges between two pairs of device buffers: a layer's K and V pools into
// another cache's (kvtransfer's CUDA IPC path, where the destination is another process's pool
// opened with cudaIpcOpenMemHandle). The batched copy-engine call moves such lists of 32-128 KiB
// ranges at ~35 GB/s on an H200; this kernel at the device's copy rate.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace duet::kernels {

struct ByteRange {
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t bytes = 0;
};

// Copies every range from src[b] + src_offset to dst[b] + dst_offset for both buffers b (K and
// V), stream-ordered. The ranges travel in the kernel's parameters (launches of at most 512
// ranges, sized to the list so a short list launches as cheaply as any kernel); 16-byte accesses
// when every base, offset and size is a multiple of 16, else byte by byte. Destinations must
// not overlap.
void CopyRanges(const char* const src[2], char* const dst[2], const ByteRange* ranges, size_t num_ranges,
                cudaStream_t stream);

}  // namespace duet::kernels

// The CUDA backend's KV cache: per layer a K and a V pool of bf16 in device memory, laid out
// [num_blocks, num_kv_heads, block_size, head_dim] like every KV cache in Duet.
#pragma once

#include <mutex>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "absl/status/statusor.h"
#include "backends/cuda/device_memory.h"
#include "engine/kv/kv_cache.h"
#include "kernels/attention/kv_slot_move.h"
#include "kernels/attention/paged_kv.h"

namespace duet::cuda {

class DeviceKvCache : public KvCache {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceKvCache>> Create(KvCacheShape shape, DeviceArena& arena,
                                                               cudaStream_t stream);

  MemorySpace memory_space() const override { return MemorySpace::kDevice; }
  void* device_stream() const override { return stream_; }
  void* key_pool(int64_t layer) override { return keys(layer); }
  void* value_pool(int64_t layer) override { return values(layer); }
  ~DeviceKvCache() override;

  // Stream-ordered on the executor's stream, so it lands before the next step's kernels.
  void CopyBlocks(const std::vector<BlockCopy>& copies) override;
  // Page-locked, so the copies below run at full PCIe/C2C speed and UCX can register it.
  absl::StatusOr<HostMemory> AllocateHostStaging(size_t bytes) override;
  // On a copy stream of their own (callable from any thread, one at a time), so a staging copy
  // from the host does not wait for the step in flight: the caller guarantees no step uses those
  // blocks. A copy to the host waits for the work already on the executor's stream.
  // Runs of consecutive blocks become one copy; all of them go in one batched call.
  absl::Status CopyBlocksToHost(int64_t first_layer, int64_t num_layers, absl::Span<const BlockCopy> copies,
                                const HostKvBlocks& host) override;
  absl::Status CopyBlocksFromHost(int64_t first_layer, int64_t num_layers, absl::Span<const BlockCopy> copies,
                                  const HostKvBlocks& host) override;
  // On the same copy stream, behind the executor's stream and ahead of its later work (events
  // both ways): the caller does not wait, the next step does, on the GPU.
  absl::Status EnqueueHostCopies(absl::Span<const BlockCopy> to_host, absl::Span<const BlockCopy> from_host,
                                 const HostKvBlocks& host) override;
  absl::Status WaitForHostCopies() override;

  // Speculative decoding: one token's K/V moves from slot `from` to slot `to` (block id *
  // block_size + offset) in every layer. Moves are queued and applied in order on the
  // executor's stream, up to kernels::kMaxKvSlotMoves per launch, before anything else uses the
  // cache: FlushSlotMoves (the executor calls it before each step), a block copy or a staging
  // copy. Callers order moves so that none reads a slot an earlier one wrote.
  void QueueSlotMove(int32_t from, int32_t to);
  void FlushSlotMoves();

  __nv_bfloat16* keys(int64_t layer) { return pool_.as<__nv_bfloat16>() + (2 * layer) * layer_elems_; }
  __nv_bfloat16* values(int64_t layer) { return pool_.as<__nv_bfloat16>() + (2 * layer + 1) * layer_elems_; }
  // The layer's pools as the kernels address them.
  kernels::PagedKvView Layer(int64_t layer) {
    return {keys(layer), values(layer), int(shape().num_kv_heads), int(shape().block_size), int(shape().head_dim)};
  }

 private:
  DeviceKvCache(const KvCacheShape& shape, DeviceAllocation pool, cudaStream_t stream, cudaStream_t copy_stream,
                cudaEvent_t produced, cudaEvent_t copied);
  // One batched copy's arrays.
  struct CopyList {
    std::vector<void*> dsts;
    std::vector<const void*> srcs;
    std::vector<size_t> sizes;
  };
  void AppendHostCopies(int64_t first_layer, int64_t num_layers, absl::Span<const BlockCopy> copies,
                        const HostKvBlocks& host, bool to_host, CopyList& list);
  cudaError_t EnqueueOnCopyStream(CopyList& list);  // copy_mu_ held
  absl::Status CopyWithHost(int64_t first_layer, int64_t num_layers, absl::Span<const BlockCopy> copies,
                            const HostKvBlocks& host, bool to_host);

  DeviceAllocation pool_;  // [num_layers][K, V][num_blocks * block_elems] bf16
  int64_t layer_elems_;
  cudaStream_t stream_;
  std::mutex copy_mu_;       // one staging copy at a time on copy_stream_
  cudaStream_t copy_stream_;  // owned
  cudaEvent_t produced_;      // owned: orders copies after the executor's stream
  cudaEvent_t copied_;        // owned: orders the executor's stream after host-tier copies
  kernels::KvSlotMoveParams pending_moves_{};  // num_moves queued, not yet launched
};

}  // namespace duet::cuda

#include "backends/cuda/device_kv_cache.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace duet::cuda {

absl::StatusOr<std::unique_ptr<DeviceKvCache>> DeviceKvCache::Create(KvCacheShape shape, DeviceArena& arena,
                                                                     cudaStream_t stream) {
  shape.dtype = KvDtype::kBFloat16;
  const size_t bytes = size_t(shape.num_blocks) * size_t(shape.bytes_per_block());
  DUET_ASSIGN_OR_RETURN(DeviceAllocation pool, arena.Allocate(bytes, "KV cache"));
  // Zeroed so a block never read before being written holds finite values; waited for, since
  // staging copies run on a stream of their own that does not wait for `stream`.
  DUET_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(pool.get(), 0, bytes, stream), "KV cache memset"));
  DUET_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream), "KV cache memset"));
  cudaStream_t copy_stream = nullptr;
  DUET_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&copy_stream, cudaStreamNonBlocking), "KV copy stream"));
  cudaEvent_t produced = nullptr, copied = nullptr;
  absl::Status s = CudaStatus(cudaEventCreateWithFlags(&produced, cudaEventDisableTiming), "KV copy event");
  if (s.ok()) s = CudaStatus(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming), "KV copy event");
  if (!s.ok()) {
    if (produced != nullptr) cudaEventDestroy(produced);
    cudaStreamDestroy(copy_stream);
    return s;
  }
  return std::unique_ptr<DeviceKvCache>(
      new DeviceKvCache(shape, std::move(pool), stream, copy_stream, produced, copied));
}

DeviceKvCache::DeviceKvCache(const KvCacheShape& shape, DeviceAllocation pool, cudaStream_t stream,
                             cudaStream_t copy_stream, cudaEvent_t produced, cudaEvent_t copied)
    : KvCache(shape),
      pool_(std::move(pool)),
      layer_elems_(shape.num_blocks * shape.block_elems()),
      stream_(stream),
      copy_stream_(copy_stream),
      produced_(produced),
      copied_(copied) {
  pending_moves_.first_layer = Layer(0);
  pending_moves_.layer_stride = 2 * layer_elems_;  // pools alternate K, V per layer
  pending_moves_.num_layers = int(shape.num_layers);
}

void DeviceKvCache::QueueSlotMove(int32_t from, int32_t to) {
  if (pending_moves_.num_moves == kernels::kMaxKvSlotMoves) FlushSlotMoves();
  pending_moves_.from[pending_moves_.num_moves] = from;
  pending_moves_.to[pending_moves_.num_moves] = to;
  ++pending_moves_.num_moves;
}

void DeviceKvCache::FlushSlotMoves() {
  if (pending_moves_.num_moves == 0) return;
  kernels::MoveKvSlots(pending_moves_, stream_);
  pending_moves_.num_moves = 0;
}

DeviceKvCache::~DeviceKvCache() {
  cudaEventDestroy(produced_);
  cudaEventDestroy(copied_);
  cudaStreamDestroy(copy_stream_);
}

void DeviceKvCache::CopyBlocks(const std::vector<BlockCopy>& copies) {
  FlushSlotMoves();
  const size_t block_bytes = size_t(shape().block_elems()) * sizeof(__nv_bfloat16);
  const int64_t n = shape().block_elems();
  for (int64_t layer = 0; layer < shape().num_layers; ++layer) {
    for (const BlockCopy& c : copies) {
      DUET_CHECK_CUDA(cudaMemcpyAsync(keys(layer) + c.dst * n, keys(layer) + c.src * n, block_bytes,
                                      cudaMemcpyDeviceToDevice, stream_));
      DUET_CHECK_CUDA(cudaMemcpyAsync(values(layer) + c.dst * n, values(layer) + c.src * n, block_bytes,
                                      cudaMemcpyDeviceToDevice, stream_));
    }
  }
}

absl::StatusOr<HostMemory> DeviceKvCache::AllocateHostStaging(size_t bytes) {
  void* p = nullptr;
  if (absl::Status s = CudaStatus(cudaHostAlloc(&p, bytes, cudaHostAllocPortable), "pinned KV staging");
      !s.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot pin ", bytes, " host bytes for KV staging: ", s.message()));
  }
  return HostMemory(p, [](void* q) { cudaFreeHost(q); });
}

absl::Status DeviceKvCache::CopyBlocksToHost(int64_t first_layer, int64_t num_layers,
                                             absl::Span<const BlockCopy> copies, const HostKvBlocks& host) {
  return CopyWithHost(first_layer, num_layers, copies, host, /*to_host=*/true);
}

absl::Status DeviceKvCache::CopyBlocksFromHost(int64_t first_layer, int64_t num_layers,
                                               absl::Span<const BlockCopy> copies, const HostKvBlocks& host) {
  return CopyWithHost(first_layer, num_layers, copies, host, /*to_host=*/false);
}

void DeviceKvCache::AppendHostCopies(int64_t first_layer, int64_t num_layers, absl::Span<const BlockCopy> copies,
                                     const HostKvBlocks& host, bool to_host, CopyList& list) {
  const size_t block_bytes = size_t(shape().block_elems()) * sizeof(__nv_bfloat16);
  // Runs where both sides' block ids advance together are one contiguous copy.
  struct Run {
    int32_t src, dst, length;
  };
  std::vector<Run> runs;
  for (const BlockCopy& c : copies) {
    if (!runs.empty() && runs.back().src + runs.back().length == c.src && runs.back().dst + runs.back().length == c.dst) {
      ++runs.back().length;
    } else {
      runs.push_back({c.src, c.dst, 1});
    }
  }
  for (int64_t layer = first_layer; layer < first_layer + num_layers; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      char* device = reinterpret_cast<char*>(kv == 0 ? keys(layer) : values(layer));
      char* staged = static_cast<char*>(kv == 0 ? host.keys[layer] : host.values[layer]);
      for (const Run& r : runs) {
        list.srcs.push_back((to_host ? device : staged) + size_t(r.src) * block_bytes);
        list.dsts.push_back((to_host ? staged : device) + size_t(r.dst) * block_bytes);
        list.sizes.push_back(size_t(r.length) * block_bytes);
      }
    }
  }
}

cudaError_t DeviceKvCache::EnqueueOnCopyStream(CopyList& list) {
  if (list.sizes.empty()) return cudaSuccess;
  cudaMemcpyAttributes attrs{};
  attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attrs.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attrs_index = 0;
  cudaError_t err = cudaMemcpyBatchAsync(list.dsts.data(), list.srcs.data(), list.sizes.data(), list.sizes.size(),
                                         &attrs, &attrs_index, 1, copy_stream_);
  if (err != cudaSuccess) {
    // Older drivers lack batched copies: one call per run.
    cudaGetLastError();
    for (size_t i = 0; i < list.sizes.size(); ++i) {
      err = cudaMemcpyAsync(list.dsts[i], list.srcs[i], list.sizes[i], cudaMemcpyDefault, copy_stream_);
      if (err != cudaSuccess) break;
    }
  }
  return err;
}

absl::Status DeviceKvCache::CopyWithHost(int64_t first_layer, int64_t num_layers, absl::Span<const BlockCopy> copies,
                                         const HostKvBlocks& host, bool to_host) {
  DUET_RETURN_IF_ERROR(CheckHostCopies(first_layer, num_layers, copies, host, to_host));
  if (pending_moves_.num_moves > 0) {  // the copy stream must see them
    FlushSlotMoves();
    DUET_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "KV slot moves"));
  }
  CopyList list;
  AppendHostCopies(first_layer, num_layers, copies, host, to_host, list);
  if (list.sizes.empty()) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(copy_mu_);
  if (to_host) {
    // The blocks may have been written by work still queued on the executor's stream (the
    // prefill's layer hook runs as soon as the layer is enqueued): copy after it.
    DUET_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(produced_, stream_), "KV copy event"));
    DUET_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(copy_stream_, produced_), "KV copy event"));
  }
  cudaError_t err = EnqueueOnCopyStream(list);
  if (err == cudaSuccess) err = cudaStreamSynchronize(copy_stream_);
  return CudaStatus(err, to_host ? "KV staging copy to host" : "KV staging copy from host");
}

absl::Status DeviceKvCache::EnqueueHostCopies(absl::Span<const BlockCopy> to_host, absl::Span<const BlockCopy> from_host,
                                              const HostKvBlocks& host) {
  const int64_t num_layers = shape().num_layers;
  DUET_RETURN_IF_ERROR(CheckHostCopies(0, num_layers, to_host, host, /*to_host=*/true));
  DUET_RETURN_IF_ERROR(CheckHostCopies(0, num_layers, from_host, host, /*to_host=*/false));
  CopyList list;
  AppendHostCopies(0, num_layers, to_host, host, /*to_host=*/true, list);
  AppendHostCopies(0, num_layers, from_host, host, /*to_host=*/false, list);
  if (list.sizes.empty()) return absl::OkStatus();
  FlushSlotMoves();  // ahead of `produced_` below, so the copies see them
  std::lock_guard<std::mutex> lock(copy_mu_);
  // After everything already on the executor's stream, and ahead of everything enqueued there
  // later: the host never waits.
  DUET_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(produced_, stream_), "KV copy event"));
  DUET_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(copy_stream_, produced_), "KV copy event"));
  DUET_RETURN_IF_ERROR(CudaStatus(EnqueueOnCopyStream(list), "KV host-tier copies"));
  DUET_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(copied_, copy_stream_), "KV copy event"));
  return CudaStatus(cudaStreamWaitEvent(stream_, copied_), "KV copy event");
}

absl::Status DeviceKvCache::WaitForHostCopies() {
  std::lock_guard<std::mutex> lock(copy_mu_);
  return CudaStatus(cudaStreamSynchronize(copy_stream_), "KV host-tier copies");
}

}  // namespace duet::cuda

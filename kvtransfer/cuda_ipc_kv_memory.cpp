// CUDA IPC implementation of DeviceKvMemory (device_kv_memory.h).
//
// Export blob (little-endian): magic, version, exporter pid, the device's UUID, then per
// allocation that holds a pool its IPC handle and raw base address (used as is when the opener is
// the exporting process itself: CUDA refuses to open its own handles), then per pool (K and V of
// each layer) the allocation index and the pool's offset in it.
#include <cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <set>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/copy/range_copy.h"
#include "kvtransfer/byte_io.h"
#include "kvtransfer/device_kv_memory.h"

namespace duet::kvtransfer {
namespace {

constexpr uint32_t kExportMagic = 0x50494b44;  // "DKIP"
constexpr uint8_t kExportVersion = 1;

absl::Status CudaError(cudaError_t err, std::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrFormat("%s: %s", what, cudaGetErrorString(err)));
}

// cuMemGetAddressRange through the runtime's entry point, so nothing links libcuda (absent on
// machines without a driver, where the CPU tests still run these binaries).
absl::StatusOr<uintptr_t> AllocationBase(void* pointer) {
  using GetRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static GetRange get_range = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return GetRange{nullptr};
    }
    return reinterpret_cast<GetRange>(fn);
  }();
  if (get_range == nullptr) return absl::UnavailableError("the CUDA driver has no cuMemGetAddressRange");
  CUdeviceptr base = 0;
  size_t bytes = 0;
  if (get_range(&base, &bytes, reinterpret_cast<CUdeviceptr>(pointer)) != CUDA_SUCCESS) {
    return absl::InvalidArgumentError("a KV pool is not in device memory allocated with cudaMalloc");
  }
  return uintptr_t(base);
}

struct PoolPlace {
  uint32_t allocation = 0;
  uint64_t offset = 0;
};

struct ParsedExport {
  uint64_t pid = 0;
  cudaUUID_t uuid{};
  std::vector<cudaIpcMemHandle_t> handles;
  std::vector<uint64_t> raw_bases;
  KvLayout layout;
  uint32_t num_blocks = 0;
  std::vector<PoolPlace> pools;  // [2 * layer]: K, [2 * layer + 1]: V
};

absl::StatusOr<ParsedExport> ParseExport(std::string_view blob) {
  ByteReader reader(blob, "CUDA IPC KV export");
  DUET_ASSIGN_OR_RETURN(uint32_t magic, reader.Get<uint32_t>());
  DUET_ASSIGN_OR_RETURN(uint8_t version, reader.Get<uint8_t>());
  if (magic != kExportMagic || version != kExportVersion) {
    return absl::InvalidArgumentError("not a CUDA IPC KV export of a supported version");
  }
  ParsedExport e;
  DUET_ASSIGN_OR_RETURN(e.pid, reader.Get<uint64_t>());
  DUET_ASSIGN_OR_RETURN(e.uuid, reader.Get<cudaUUID_t>());
  DUET_ASSIGN_OR_RETURN(std::string_view layout, reader.GetBytes());
  DUET_ASSIGN_OR_RETURN(e.layout, KvLayout::Deserialize(layout));
  DUET_ASSIGN_OR_RETURN(e.num_blocks, reader.Get<uint32_t>());
  DUET_ASSIGN_OR_RETURN(uint32_t num_allocations, reader.Get<uint32_t>());
  if (num_allocations == 0 || num_allocations > 2 * e.layout.num_layers) {
    return absl::InvalidArgumentError("CUDA IPC KV export: bad allocation count");
  }
  for (uint32_t i = 0; i < num_allocations; ++i) {
    DUET_ASSIGN_OR_RETURN(cudaIpcMemHandle_t handle, reader.Get<cudaIpcMemHandle_t>());
    DUET_ASSIGN_OR_RETURN(uint64_t raw, reader.Get<uint64_t>());
    e.handles.push_back(handle);
    e.raw_bases.push_back(raw);
  }
  for (uint32_t i = 0; i < 2 * e.layout.num_layers; ++i) {
    PoolPlace place;
    DUET_ASSIGN_OR_RETURN(place.allocation, reader.Get<uint32_t>());
    DUET_ASSIGN_OR_RETURN(place.offset, reader.Get<uint64_t>());
    if (place.allocation >= num_allocations) {
      return absl::InvalidArgumentError("CUDA IPC KV export: a pool names an unknown allocation");
    }
    e.pools.push_back(place);
  }
  if (!reader.AtEnd()) return absl::InvalidArgumentError("CUDA IPC KV export has trailing bytes");
  return e;
}

class CudaIpcKvPeer final : public DeviceKvPeer {
 public:
  CudaIpcKvPeer(int device, const DeviceKvPools& local, KvLayout layout, uint32_t num_blocks,
                std::vector<void*> opened, std::vector<char*> key_pools, std::vector<char*> value_pools)
      : device_(device), local_(local), layout_(layout), num_blocks_(num_blocks), opened_(std::move(opened)),
        key_pools_(std::move(key_pools)), value_pools_(std::move(value_pools)) {}
  // Unmaps once the copies enqueued into the mappings have run.
  ~CudaIpcKvPeer() override {
    cudaSetDevice(device_);
    for (cudaStream_t stream : streams_) cudaStreamSynchronize(stream);
    for (void* p : opened_) cudaIpcCloseMemHandle(p);
  }

  const KvLayout& layout() const override { return layout_; }
  uint32_t num_blocks() const override { return num_blocks_; }

  absl::Status EnqueueLayerCopies(uint32_t first_layer, uint32_t num_layers, std::span<const CopyRange> plan,
                                  void* stream) override {
    if (num_layers == 0 || first_layer >= layout_.num_layers || num_layers > layout_.num_layers - first_layer) {
      return absl::InvalidArgumentError("KV copy names a layer out of range");
    }
    cudaSetDevice(device_);
    const auto s = static_cast<cudaStream_t>(stream);
    std::lock_guard<std::mutex> lock(mu_);
    streams_.insert(s);
    // Every layer's K and V in one launch (CopyRange and ByteRange are the same three offsets).
    static_assert(sizeof(CopyRange) == sizeof(kernels::ByteRange));
    ranges_.resize(plan.size());
    for (size_t i = 0; i < plan.size(); ++i) ranges_[i] = {plan[i].src_offset, plan[i].dst_offset, plan[i].bytes};
    buffers_.clear();
    for (uint32_t layer = first_layer; layer < first_layer + num_layers; ++layer) {
      buffers_.push_back({static_cast<const char*>(local_.key_pools[layer]), key_pools_[layer]});
      buffers_.push_back({static_cast<const char*>(local_.value_pools[layer]), value_pools_[layer]});
    }
    kernels::CopyRanges(buffers_.data(), buffers_.size(), ranges_.data(), ranges_.size(), s);
    return CudaError(cudaGetLastError(), "KV device-to-device copy");
  }

 private:
  const int device_;
  const DeviceKvPools& local_;
  const KvLayout layout_;
  const uint32_t num_blocks_;
  std::vector<void*> opened_;  // IPC mappings to close
  std::vector<char*> key_pools_, value_pools_;
  std::mutex mu_;
  std::set<cudaStream_t> streams_ ABSL_GUARDED_BY(mu_);  // every stream a copy was enqueued on
  std::vector<kernels::ByteRange> ranges_ ABSL_GUARDED_BY(mu_);
  std::vector<kernels::BufferPair> buffers_ ABSL_GUARDED_BY(mu_);
};

class CudaIpcKvMemory final : public DeviceKvMemory {
 public:
  CudaIpcKvMemory(DeviceKvPools pools, int device) : pools_(std::move(pools)), device_(device) {}
  ~CudaIpcKvMemory() override {
    if (own_stream_ != nullptr) cudaStreamDestroy(own_stream_);
    if (notify_stream_ != nullptr) cudaStreamDestroy(notify_stream_);
  }

  const DeviceKvPools& pools() const override { return pools_; }

  absl::StatusOr<std::string> Export() const override {
    cudaSetDevice(device_);
    cudaDeviceProp prop{};
    DUET_RETURN_IF_ERROR(CudaError(cudaGetDeviceProperties(&prop, device_), "cudaGetDeviceProperties"));
    std::vector<uintptr_t> bases;
    std::vector<PoolPlace> places;
    for (uint32_t layer = 0; layer < pools_.layout.num_layers; ++layer) {
      for (void* pool : {pools_.key_pools[layer], pools_.value_pools[layer]}) {
        DUET_ASSIGN_OR_RETURN(uintptr_t base, AllocationBase(pool));
        size_t index = 0;
        while (index < bases.size() && bases[index] != base) ++index;
        if (index == bases.size()) bases.push_back(base);
        places.push_back({uint32_t(index), uint64_t(reinterpret_cast<uintptr_t>(pool) - base)});
      }
    }
    ByteWriter writer;
    writer.Put<uint32_t>(kExportMagic);
    writer.Put<uint8_t>(kExportVersion);
    writer.Put<uint64_t>(uint64_t(getpid()));
    writer.Put<cudaUUID_t>(prop.uuid);
    writer.PutBytes(pools_.layout.Serialize());
    writer.Put<uint32_t>(pools_.num_blocks);
    writer.Put<uint32_t>(uint32_t(bases.size()));
    for (uintptr_t base : bases) {
      cudaIpcMemHandle_t handle{};
      DUET_RETURN_IF_ERROR(CudaError(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base)),
                                     "cudaIpcGetMemHandle of a KV pool"));
      writer.Put<cudaIpcMemHandle_t>(handle);
      writer.Put<uint64_t>(uint64_t(base));
    }
    for (const PoolPlace& place : places) {
      writer.Put<uint32_t>(place.allocation);
      writer.Put<uint64_t>(place.offset);
    }
    return std::move(writer).Take();
  }

  absl::StatusOr<std::unique_ptr<DeviceKvPeer>> Open(std::string_view blob) override {
    DUET_ASSIGN_OR_RETURN(ParsedExport e, ParseExport(blob));
    DUET_RETURN_IF_ERROR(CheckCompatible(pools_.layout, e.layout).status());
    cudaSetDevice(device_);
    DUET_RETURN_IF_ERROR(CheckReachable(e.uuid));
    std::vector<void*> opened;
    std::vector<char*> bases;
    const bool same_process = e.pid == uint64_t(getpid());
    for (size_t i = 0; i < e.handles.size(); ++i) {
      if (same_process) {
        bases.push_back(reinterpret_cast<char*>(e.raw_bases[i]));
        continue;
      }
      void* mapped = nullptr;
      cudaError_t err = cudaIpcOpenMemHandle(&mapped, e.handles[i], cudaIpcMemLazyEnablePeerAccess);
      if (err != cudaSuccess) {
        cudaGetLastError();
        for (void* p : opened) cudaIpcCloseMemHandle(p);
        return absl::FailedPreconditionError(
            absl::StrFormat("cannot open the KV receiver's CUDA IPC handle: %s", cudaGetErrorString(err)));
      }
      opened.push_back(mapped);
      bases.push_back(static_cast<char*>(mapped));
    }
    std::vector<char*> keys, values;
    for (uint32_t layer = 0; layer < e.layout.num_layers; ++layer) {
      const PoolPlace& k = e.pools[2 * layer];
      const PoolPlace& v = e.pools[2 * layer + 1];
      keys.push_back(bases[k.allocation] + k.offset);
      values.push_back(bases[v.allocation] + v.offset);
    }
    return std::unique_ptr<DeviceKvPeer>(new CudaIpcKvPeer(device_, pools_, e.layout, e.num_blocks, std::move(opened),
                                                           std::move(keys), std::move(values)));
  }

  absl::StatusOr<uint64_t> HashLayer(bool key_pool, uint32_t layer, std::span<const uint32_t> block_ids,
                                     uint32_t num_tokens, void* stream) override {
    if (layer >= pools_.layout.num_layers) return absl::InvalidArgumentError("layer out of range");
    cudaSetDevice(device_);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (s == nullptr) {
      std::lock_guard<std::mutex> lock(stream_mu_);
      if (own_stream_ == nullptr) {
        DUET_RETURN_IF_ERROR(CudaError(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking), "stream"));
      }
      s = own_stream_;
    }
    // Block block_ids[i] lands in host block i; the hash walks the same tokens.
    const size_t block_bytes = pools_.layout.BlockBytes();
    std::vector<uint8_t> host(block_ids.size() * block_bytes);
    const char* pool = static_cast<const char*>(key_pool ? pools_.key_pools[layer] : pools_.value_pools[layer]);
    for (size_t i = 0; i < block_ids.size(); ++i) {
      DUET_RETURN_IF_ERROR(CudaError(cudaMemcpyAsync(host.data() + i * block_bytes, pool + block_ids[i] * block_bytes,
                                                     block_bytes, cudaMemcpyDeviceToHost, s),
                                     "KV checksum copy"));
    }
    DUET_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(s), "KV checksum copy"));
    std::vector<uint32_t> ids(block_ids.size());
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = uint32_t(i);
    return HashLayerTokens(pools_.layout, host.data(), ids, num_tokens);
  }

  // The callback waits on a stream of its own behind an event, so the producer's stream never
  // stalls on the host call.
  absl::Status NotifyWhenDone(void* stream, std::function<void(absl::Status)> fn) override {
    cudaSetDevice(device_);
    std::lock_guard<std::mutex> lock(stream_mu_);
    if (notify_stream_ == nullptr) {
      DUET_RETURN_IF_ERROR(
          CudaError(cudaStreamCreateWithFlags(&notify_stream_, cudaStreamNonBlocking), "KV notify stream"));
    }
    cudaEvent_t passed = nullptr;
    DUET_RETURN_IF_ERROR(CudaError(cudaEventCreateWithFlags(&passed, cudaEventDisableTiming), "KV copy event"));
    cudaError_t err = cudaEventRecord(passed, static_cast<cudaStream_t>(stream));
    if (err == cudaSuccess) err = cudaStreamWaitEvent(notify_stream_, passed);
    cudaEventDestroy(passed);  // released once the wait has happened
    DUET_RETURN_IF_ERROR(CudaError(err, "KV copy event"));
    auto* owned = new std::function<void(absl::Status)>(std::move(fn));
    err = cudaStreamAddCallback(
        notify_stream_,
        [](cudaStream_t, cudaError_t status, void* data) {
          std::unique_ptr<std::function<void(absl::Status)>> f(static_cast<std::function<void(absl::Status)>*>(data));
          (*f)(CudaError(status, "the stream carrying KV copies failed"));
        },
        owned, 0);
    if (err != cudaSuccess) {
      delete owned;
      return CudaError(err, "cudaStreamAddCallback");
    }
    return absl::OkStatus();
  }

 private:
  // The exporter's GPU must be this one, or one this GPU can reach (peer access).
  absl::Status CheckReachable(const cudaUUID_t& uuid) const {
    int count = 0;
    DUET_RETURN_IF_ERROR(CudaError(cudaGetDeviceCount(&count), "cudaGetDeviceCount"));
    for (int d = 0; d < count; ++d) {
      cudaDeviceProp prop{};
      if (cudaGetDeviceProperties(&prop, d) != cudaSuccess) continue;
      if (std::memcmp(&prop.uuid, &uuid, sizeof(uuid)) != 0) continue;
      if (d == device_) return absl::OkStatus();
      int can = 0;
      cudaDeviceCanAccessPeer(&can, device_, d);
      if (can) return absl::OkStatus();
      return absl::FailedPreconditionError(
          absl::StrFormat("the KV receiver's GPU %d has no peer access from GPU %d", d, device_));
    }
    return absl::FailedPreconditionError("the KV receiver's GPU is not visible to this process");
  }

  const DeviceKvPools pools_;
  const int device_;
  std::mutex stream_mu_;
  cudaStream_t own_stream_ = nullptr;     // HashLayer's when given none
  cudaStream_t notify_stream_ = nullptr;  // NotifyWhenDone's callbacks
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceKvMemory>> CreateDeviceKvMemory(DeviceKvPools pools) {
  if (pools.key_pools.size() != pools.layout.num_layers || pools.value_pools.size() != pools.layout.num_layers) {
    return absl::InvalidArgumentError("device KV pools need a K and a V pool per layer");
  }
  DUET_RETURN_IF_ERROR(pools.layout.Validate());
  int device = 0;
  DUET_RETURN_IF_ERROR(CudaError(cudaGetDevice(&device), "cudaGetDevice"));
  return std::unique_ptr<DeviceKvMemory>(new CudaIpcKvMemory(std::move(pools), device));
}

}  // namespace duet::kvtransfer

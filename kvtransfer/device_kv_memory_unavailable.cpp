// Builds without CUDA: no device pools, so no device-memory path (transfers use host pools).
#include "kvtransfer/device_kv_memory.h"

namespace duet::kvtransfer {

absl::StatusOr<std::unique_ptr<DeviceKvMemory>> CreateDeviceKvMemory(DeviceKvPools) {
  return absl::UnimplementedError("this build has no CUDA: KV pools in device memory are not supported");
}

}  // namespace duet::kvtransfer

#include "kvtransfer/kv_transport.h"

#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace duet::kvtransfer {

std::string_view TransferPathName(TransferPath path) {
  switch (path) {
    case TransferPath::kUcxNetwork:
      return "ucx_net";
    case TransferPath::kUcxSharedMemory:
      return "ucx_shm";
    case TransferPath::kCudaIpc:
      return "cuda_ipc";
  }
  return "unknown";
}

absl::Status KvPoolMemory::Validate() const {
  DUET_RETURN_IF_ERROR(layout.Validate());
  if (num_blocks == 0) return absl::InvalidArgumentError("KV pool has no blocks");
  if (key_pools.size() != layout.num_layers || value_pools.size() != layout.num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "KV pool memory lists %d K and %d V pools for %u layers", key_pools.size(),
        value_pools.size(), layout.num_layers));
  }
  for (uint32_t layer = 0; layer < layout.num_layers; ++layer) {
    if (key_pools[layer] == nullptr || value_pools[layer] == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat("KV pool of layer %u is null", layer));
    }
  }
  return absl::OkStatus();
}

}  // namespace duet::kvtransfer

// The device-memory data path: a process's KV pools in GPU memory, exported to and opened by
// another process on the same host through CUDA IPC, so a prefill worker writes straight into a
// decode worker's cache blocks (kv_transport.h, TransferPath::kCudaIpc).
//
// Why direct CUDA IPC and not UCX built with CUDA: UCX 1.13 (Debian's) offers a peer failure
// handler only over tcp, so endpoints that detect dead peers never select its cuda_ipc lanes;
// and a UCX put must find its source ready, which costs the producer a host synchronisation per
// layer. Here the copies are enqueued on the stream that produces the layer, right behind it:
// no host wait, the engine's later kernels are ordered after the copies (the prefill engine may
// reuse its blocks at once), and the notices still travel over UCX once the stream has passed.
//
// Pools keep the engine layout: per layer a K and a V pool [num_blocks, num_kv_heads,
// block_size, head_dim]. Implemented by cuda_ipc_kv_memory.cpp in CUDA builds; elsewhere
// CreateDeviceKvMemory reports UNIMPLEMENTED.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvtransfer/kv_layout.h"
#include "kvtransfer/layer_copy_plan.h"

namespace duet::kvtransfer {

struct DeviceKvPools {
  KvLayout layout;
  uint32_t num_blocks = 0;
  std::vector<void*> key_pools;    // [layout.num_layers] device pointers
  std::vector<void*> value_pools;  // [layout.num_layers]

  size_t PoolBytes() const { return size_t{num_blocks} * layout.BlockBytes(); }
};

// A receiver's device pools opened in the sender's process.
class DeviceKvPeer {
 public:
  virtual ~DeviceKvPeer() = default;
  virtual const KvLayout& layout() const = 0;
  virtual uint32_t num_blocks() const = 0;
  // Enqueues on `stream` (a cudaStream_t) the copies of the K and V pools of layers
  // [first_layer, first_layer + num_layers) from the local pools into the peer's, `plan` (from
  // PlanLayerCopy) applied to each: one launch for them all. Stream-ordered: after the work
  // already on `stream`, before what comes later.
  virtual absl::Status EnqueueLayerCopies(uint32_t first_layer, uint32_t num_layers, std::span<const CopyRange> plan,
                                          void* stream) = 0;
};

class DeviceKvMemory {
 public:
  virtual ~DeviceKvMemory() = default;
  virtual const DeviceKvPools& pools() const = 0;
  // The blob a receiver publishes (inside its descriptor) for senders on this host: IPC handles
  // of the allocations holding the pools, and where each pool sits in them.
  virtual absl::StatusOr<std::string> Export() const = 0;
  // Opens another process's Export() blob. FAILED_PRECONDITION when it cannot be reached from
  // here (another GPU without peer access, an IPC handle the driver refuses).
  virtual absl::StatusOr<std::unique_ptr<DeviceKvPeer>> Open(std::string_view blob) = 0;
  // HashLayerTokens of a local pool, for checksum verification only: waits for `stream` (null:
  // a stream of its own) and copies the layer's blocks to the host first.
  virtual absl::StatusOr<uint64_t> HashLayer(bool key_pool, uint32_t layer, std::span<const uint32_t> block_ids,
                                             uint32_t num_tokens, void* stream) = 0;
  // Runs `fn` once the work enqueued on `stream` so far has completed (or failed: then with the
  // error). `fn` runs on a CUDA driver thread and must not call CUDA.
  virtual absl::Status NotifyWhenDone(void* stream, std::function<void(absl::Status)> fn) = 0;
};

// CUDA builds: takes the current device's pools. Other builds: UNIMPLEMENTED.
absl::StatusOr<std::unique_ptr<DeviceKvMemory>> CreateDeviceKvMemory(DeviceKvPools pools);

}  // namespace duet::kvtransfer

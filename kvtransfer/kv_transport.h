// KV-cache block transfer between a prefill worker (sender) and a decode worker (receiver).
//
// Protocol (the control plane carries the opaque blobs; this library never opens sockets):
//   1. The decode worker creates a KvReceiver over its K/V pools. It registers the pools and
//      publishes descriptor(): an opaque blob with its transport address, the pools' remote
//      keys and base addresses, the pool size and the KvLayout.
//   2. When the router assigns a request, the decode worker allocates destination blocks and calls
//      Expect(): that grants a lease on those blocks (they stay reserved until the lease ends).
//      It tells the prefill worker, through the control plane, the request id and block ids.
//   3. The prefill worker's KvSender connects to the descriptor once per decode worker
//      (Connect(); the layouts are checked there), then, as each layer is produced, calls
//      SendLayer(): the layer's K and V bytes are written straight into the destination blocks
//      (one-sided RMA put; runs of consecutive blocks become one put), flushed to remote
//      completion, then announced by a small completion notice carrying request id, layer, token
//      count and optional 64-bit checksums of K and V.
//   4. Finish() announces the end of the request once every SendLayer of it has completed (or
//      reports the first failure and aborts the request at the receiver). The receiver completes
//      the request when it has the notice for every layer and the finish notice: the lease is
//      committed (the blocks now belong to the decode worker's request) and on_request_done
//      reports OK.
//   5. Any other end releases the lease exactly once through on_blocks_released, and
//      on_request_done reports why: the lease deadline passed (sender dead or stuck; every
//      received layer renews it), Cancel() on the receiver (at once, or once the sender has
//      stopped writing: CancelRelease), Abort() from the sender, a checksum mismatch or a
//      malformed notice.
// Failures on the sender side: each operation has a timeout; a peer whose endpoint reports an
// error or times out is marked failed, its pending operations complete with an error status
// (UNAVAILABLE / DEADLINE_EXCEEDED), and later operations to it fail at once until the control
// plane connects again. Keep the sender's timeout below the receiver's lease ttl so a slow sender
// gives up before the receiver reuses the blocks it may still be writing.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvtransfer/kv_layout.h"
#include "kvtransfer/lease_table.h"

namespace duet::kvtransfer {

// Where a transfer's bytes travel. Chosen by the sender per receiver when it connects:
//   kCudaIpc: both sides' pools in GPU memory on one host (device_kv_memory.h): the sender copies
//             straight into the receiver's cache blocks; notices go over UCX shared memory.
//   kUcxSharedMemory: host pools on one host, UCX shared-memory transports (posix/sysv, cma).
//   kUcxNetwork: host pools across hosts, UCX network transports (tcp here) with UCX's peer
//             failure detection.
// On the two one-host paths a dead peer is found by the operation timeout, the lease and the
// router's health checks rather than by the transport.
enum class TransferPath : uint8_t { kUcxNetwork = 1, kUcxSharedMemory = 2, kCudaIpc = 3 };
// "ucx_net", "ucx_shm", "cuda_ipc": the `path` label of the transfer metrics.
std::string_view TransferPathName(TransferPath path);

// Where a receiver's transfer landed: its host pools, or (kCudaIpc) its device pools.
enum class MemoryKind : uint8_t { kHost = 1, kDevice = 2 };

// One side's host KV pools: per layer a K and a V pool of num_blocks * layout.BlockBytes() bytes.
// The memory is owned by the caller and must outlive the sender/receiver. Device pools, if any,
// come beside them (DeviceKvMemory in the transport's options).
struct KvPoolMemory {
  KvLayout layout;
  uint32_t num_blocks = 0;
  std::vector<void*> key_pools;    // [layout.num_layers]
  std::vector<void*> value_pools;  // [layout.num_layers]

  size_t PoolBytes() const { return size_t{num_blocks} * layout.BlockBytes(); }
  absl::Status Validate() const;
};

// ---- Receiver (decode worker) ----

struct ExpectedRequest {
  uint64_t request_id = 0;
  uint32_t num_tokens = 0;               // tokens the sender will write
  std::vector<uint32_t> dst_block_ids;   // host pools: exactly ceil(num_tokens / block_size) ids
  // Device pools (a receiver with DeviceKvMemory): where a kCudaIpc sender writes instead.
  // Empty: the request can land only in the host pools; with these, dst_block_ids may be empty
  // (then it can land only in the device pools).
  std::vector<uint32_t> device_block_ids;
  absl::Duration lease_ttl = absl::Seconds(30);
  bool verify_checksums = false;         // then every layer notice must carry checksums
};

// Callbacks run on the receiver's progress thread (Cancel's on the caller's thread). They must
// not block for long and must not destroy the receiver.
struct ReceiverCallbacks {
  std::function<void(uint64_t request_id, uint32_t layer)> on_layer_received;  // optional
  // Exactly once per expected request: OK when complete (`landed`: the pools the bytes are in),
  // else why it ended.
  std::function<void(uint64_t request_id, const absl::Status& status, MemoryKind landed)> on_request_done;
  // Exactly once per lease that ends without completing; required.
  LeaseTable::ReleaseCallback on_blocks_released;
};

class KvReceiver {
 public:
  virtual ~KvReceiver() = default;
  // Opaque blob for KvSender::Connect.
  virtual const std::string& descriptor() const = 0;
  // Grants the lease for a request's destination blocks and starts accepting its layers.
  virtual absl::Status Expect(ExpectedRequest request) = 0;
  // How Cancel hands a transferring request's blocks back.
  enum class CancelRelease : uint8_t {
    // At once: only when no sender can write into them (none was given them, or it is gone).
    kNow,
    // The sender may still be writing (its one-sided puts cannot be stopped from here): the
    // request will not complete, and its lease ends (blocks released, on_request_done CANCELLED)
    // when the sender's finish or abort notice arrives, sent once its puts have landed, or when
    // the lease expires, whichever comes first. A later Cancel kNow still ends it at once.
    kAfterSender,
  };
  // Ends the request (see CancelRelease). False if it had ended.
  virtual bool Cancel(uint64_t request_id, CancelRelease release) = 0;
  virtual size_t active_leases() const = 0;
};

// ---- Sender (prefill worker) ----

using PeerId = uint64_t;

// Layers [layer, layer + num_layers) of a request: one layer as a forward pass produces it, or
// several that are ready together (a target that came late, a kept prompt), which kCudaIpc
// copies in one launch.
struct LayerSend {
  uint64_t request_id = 0;
  uint32_t layer = 0;
  uint32_t num_layers = 1;
  uint32_t num_tokens = 0;
  // Host paths: ids in both sides' host pools. kCudaIpc: ids in the sender's device pools and
  // the receiver's device_block_ids.
  std::vector<uint32_t> src_block_ids;  // ceil(num_tokens / sender block_size) ids
  std::vector<uint32_t> dst_block_ids;  // ceil(num_tokens / receiver block_size) ids
  bool with_checksums = false;
  // kCudaIpc: the cudaStream_t that produced the layers. The copies are enqueued on it at once,
  // behind that work and ahead of anything later (so the producer may reuse its blocks); the
  // layers' notices go out once Finish sees the stream pass them.
  void* device_stream = nullptr;
};

class KvSender {
 public:
  virtual ~KvSender() = default;
  // Connects to a receiver descriptor. Fails on a malformed descriptor or incompatible layout.
  virtual absl::StatusOr<PeerId> Connect(std::string_view receiver_descriptor) = 0;
  // Closes the endpoint; pending operations to the peer complete with CANCELLED.
  virtual void Disconnect(PeerId peer) = 0;
  // The path chosen for the peer at Connect.
  virtual TransferPath path(PeerId peer) const = 0;
  // Writes the layers' K and V blocks; the future resolves once the data is remotely complete
  // and every layer's notice is sent, or with the first error (invalid ids, peer failure,
  // timeout).
  virtual std::future<absl::Status> SendLayer(PeerId peer, LayerSend send) = 0;
  // Resolves after every earlier SendLayer of the request has resolved: OK once the finish
  // notice is sent, else the first failure (the receiver is then told to abort the request).
  virtual std::future<absl::Status> Finish(PeerId peer, uint64_t request_id) = 0;
  // The same, reporting to `done` instead of a future, so the caller never waits. `done` runs on
  // the sender's progress thread: it must not block, nor call Connect or Disconnect.
  using Completion = std::function<void(const absl::Status&)>;
  virtual void Finish(PeerId peer, uint64_t request_id, Completion done) = 0;
  // Tells the receiver to release the request's blocks, once the request's layers in flight have
  // landed (the receiver frees the blocks at this notice).
  virtual std::future<absl::Status> Abort(PeerId peer, uint64_t request_id) = 0;
  // Operations and per-request records not yet completed (0 when idle: nothing leaks).
  virtual size_t pending_operations() const = 0;
};

}  // namespace duet::kvtransfer

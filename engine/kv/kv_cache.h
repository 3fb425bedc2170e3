// KV-cache storage. The executor that computes with the cache also allocates it (host memory
// for the CPU backend, device memory for CUDA); BlockManager decides which blocks a sequence
// owns, and this class only holds the bytes.
//
// Per layer, separate K and V pools, each laid out [num_blocks, num_kv_heads, block_size, head_dim]
// of `dtype`, so one head's keys in a block are contiguous. Token t of a sequence lives in block
// table[t / block_size] at slot t % block_size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "engine/kv/block_manager.h"

namespace duet {

enum class KvDtype { kFloat32, kBFloat16 };
enum class MemorySpace { kHost, kDevice };

inline int64_t KvDtypeBytes(KvDtype dtype) { return dtype == KvDtype::kFloat32 ? 4 : 2; }

struct KvCacheShape {
  int64_t num_layers = 0;
  int64_t num_blocks = 0;
  int64_t num_kv_heads = 0;
  int64_t block_size = 0;
  int64_t head_dim = 0;
  KvDtype dtype = KvDtype::kFloat32;

  int64_t block_elems() const { return num_kv_heads * block_size * head_dim; }
  // Bytes of K plus V for one block across all layers.
  int64_t bytes_per_block() const { return 2 * num_layers * block_elems() * KvDtypeBytes(dtype); }
};

// Host memory with its own release function (page-locked memory for device caches).
using HostMemory = std::unique_ptr<void, void (*)(void*)>;

// Host-resident pools with a cache's block layout and dtype, for staging some of its blocks:
// per layer a K and a V pool [num_blocks, num_kv_heads, block_size, head_dim].
struct HostKvBlocks {
  std::vector<void*> keys;    // [num_layers]
  std::vector<void*> values;  // [num_layers]
};

// The pools of `num_blocks` blocks of `shape` in one host allocation at `base`, laid out
// [num_layers][K, V][num_blocks * block bytes].
HostKvBlocks LayOutHostKvBlocks(const KvCacheShape& shape, int64_t num_blocks, void* base);

class KvCache {
 public:
  virtual ~KvCache() = default;

  const KvCacheShape& shape() const { return shape_; }
  virtual MemorySpace memory_space() const = 0;
  // A device cache: the stream (cudaStream_t) that orders every step's work on it; a layer's K/V
  // are complete for work enqueued there after the layer hook ran. Null for host caches.
  virtual void* device_stream() const { return nullptr; }
  // Base address of one layer's K or V pool ([num_blocks, num_kv_heads, block_size, head_dim]
  // elements of shape().dtype), in memory_space().
  virtual void* key_pool(int64_t layer) = 0;
  virtual void* value_pool(int64_t layer) = 0;
  // Copies whole blocks in every layer (copy-on-write).
  virtual void CopyBlocks(const std::vector<BlockCopy>& copies) = 0;

  // Host memory this cache copies to and from fastest (page-locked for a device cache); plain
  // 64-byte-aligned host memory unless overridden.
  virtual absl::StatusOr<HostMemory> AllocateHostStaging(size_t bytes);
  // Copies whole blocks of layers [first_layer, first_layer + num_layers) between this cache and
  // `host`: ToHost reads cache block copies[i].src into host block copies[i].dst, FromHost the
  // reverse (host .src into cache .dst). Returns once the bytes are in place; the caller keeps
  // the steps that use those blocks out of the way.
  virtual absl::Status CopyBlocksToHost(int64_t first_layer, int64_t num_layers, absl::Span<const BlockCopy> copies,
                                        const HostKvBlocks& host) = 0;
  virtual absl::Status CopyBlocksFromHost(int64_t first_layer, int64_t num_layers, absl::Span<const BlockCopy> copies,
                                          const HostKvBlocks& host) = 0;
  // The host tier's copies, every layer: `to_host` (cache .src into host .dst) first, then
  // `from_host` (host .src into cache .dst), ordered after the work already issued on the cache
  // and before the work issued after this call, without waiting for them (a device cache orders
  // them on the GPU; this default copies at once). Copies into the same host memory must all go
  // through here, which keeps them in order; WaitForHostCopies returns once they are done.
  virtual absl::Status EnqueueHostCopies(absl::Span<const BlockCopy> to_host, absl::Span<const BlockCopy> from_host,
                                         const HostKvBlocks& host);
  virtual absl::Status WaitForHostCopies() { return absl::OkStatus(); }

  // Element offset of (block, head, slot) within a layer's K or V pool.
  int64_t Offset(int64_t block, int64_t head, int64_t slot) const {
    return ((block * shape_.num_kv_heads + head) * shape_.block_size + slot) * shape_.head_dim;
  }

 protected:
  explicit KvCache(const KvCacheShape& shape) : shape_(shape) {}

  // For the host copies: the layers exist, `host` has pools for every layer, and every block id
  // is inside its pool (the cache's side is bounded by num_blocks; the host side by the caller).
  absl::Status CheckHostCopies(int64_t first_layer, int64_t num_layers, absl::Span<const BlockCopy> copies,
                               const HostKvBlocks& host, bool to_host) const;

 private:
  KvCacheShape shape_;
};

// float32 pools in host memory (the CPU backend). The pools start zeroed without being written:
// the kernel hands out zero pages as blocks are first used, so a large cache costs nothing to
// create (writing a GiB of zeros took seconds of every worker's start-up) and the process's
// resident memory grows with the blocks in use.
class HostKvCache : public KvCache {
 public:
  // ResourceExhausted when the host has no room for the pools.
  static absl::StatusOr<std::unique_ptr<HostKvCache>> Create(KvCacheShape shape);

  MemorySpace memory_space() const override { return MemorySpace::kHost; }
  void* key_pool(int64_t layer) override { return keys(layer); }
  void* value_pool(int64_t layer) override { return values(layer); }
  void CopyBlocks(const std::vector<BlockCopy>& copies) override;
  absl::Status CopyBlocksToHost(int64_t first_layer, int64_t num_layers, absl::Span<const BlockCopy> copies,
                                const HostKvBlocks& host) override;
  absl::Status CopyBlocksFromHost(int64_t first_layer, int64_t num_layers, absl::Span<const BlockCopy> copies,
                                  const HostKvBlocks& host) override;

  float* keys(int64_t layer) { return keys_[size_t(layer)].get(); }
  float* values(int64_t layer) { return values_[size_t(layer)].get(); }

 private:
  struct FreePool {
    void operator()(float* pool) const { std::free(pool); }
  };
  using Pool = std::unique_ptr<float[], FreePool>;

  explicit HostKvCache(KvCacheShape shape) : KvCache(shape) {}
  absl::Status CopyWithHost(int64_t first_layer, int64_t num_layers, absl::Span<const BlockCopy> copies,
                            const HostKvBlocks& host, bool to_host);

  std::vector<Pool> keys_;    // [num_layers][num_blocks * block_elems]
  std::vector<Pool> values_;  // same
};

}  // namespace duet

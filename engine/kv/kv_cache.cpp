#include "engine/kv/kv_cache.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace duet {

HostKvBlocks LayOutHostKvBlocks(const KvCacheShape& shape, int64_t num_blocks, void* base) {
  const size_t pool_bytes = size_t(num_blocks) * size_t(shape.block_elems() * KvDtypeBytes(shape.dtype));
  HostKvBlocks pools;
  for (int64_t layer = 0; layer < shape.num_layers; ++layer) {
    pools.keys.push_back(static_cast<char*>(base) + size_t(2 * layer) * pool_bytes);
    pools.values.push_back(static_cast<char*>(base) + size_t(2 * layer + 1) * pool_bytes);
  }
  return pools;
}
namespace {

KvCacheShape WithFloat32(KvCacheShape shape) {
  shape.dtype = KvDtype::kFloat32;
  return shape;
}

}  // namespace

absl::StatusOr<HostMemory> KvCache::AllocateHostStaging(size_t bytes) {
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) return absl::ResourceExhaustedError("cannot allocate host memory for KV staging");
  return HostMemory(p, [](void* q) { std::free(q); });
}

absl::Status KvCache::EnqueueHostCopies(absl::Span<const BlockCopy> to_host, absl::Span<const BlockCopy> from_host,
                                        const HostKvBlocks& host) {
  const int64_t num_layers = shape_.num_layers;
  if (!to_host.empty()) DUET_RETURN_IF_ERROR(CopyBlocksToHost(0, num_layers, to_host, host));
  if (!from_host.empty()) DUET_RETURN_IF_ERROR(CopyBlocksFromHost(0, num_layers, from_host, host));
  return absl::OkStatus();
}

absl::Status KvCache::CheckHostCopies(int64_t first_layer, int64_t num_layers, absl::Span<const BlockCopy> copies,
                                      const HostKvBlocks& host, bool to_host) const {
  if (first_layer < 0 || num_layers < 0 || first_layer + num_layers > shape_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layers [", first_layer, ", ", first_layer + num_layers,
                                                   ") are outside the cache's ", shape_.num_layers));
  }
  if (int64_t(host.keys.size()) != shape_.num_layers || int64_t(host.values.size()) != shape_.num_layers) {
    return absl::InvalidArgumentError("the host blocks need a K and a V pool for every layer");
  }
  for (const BlockCopy& c : copies) {
    const int32_t cache_block = to_host ? c.src : c.dst;
    if (cache_block < 0 || cache_block >= shape_.num_blocks || (to_host ? c.dst : c.src) < 0) {
      return absl::OutOfRangeError(absl::StrCat("block copy ", c.src, " -> ", c.dst, " is outside the pools"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<HostKvCache>> HostKvCache::Create(KvCacheShape shape) {
  std::unique_ptr<HostKvCache> cache(new HostKvCache(WithFloat32(shape)));
  const size_t layer_elems = static_cast<size_t>(shape.num_blocks * shape.block_elems());
  for (int64_t layer = 0; layer < shape.num_layers; ++layer) {
    // calloc of a large size maps fresh zero pages rather than writing zeros.
    for (std::vector<Pool>* pools : {&cache->keys_, &cache->values_}) {
      pools->emplace_back(static_cast<float*>(std::calloc(std::max<size_t>(layer_elems, 1), sizeof(float))));
      if (pools->back() == nullptr) {
        return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", layer_elems * sizeof(float),
                                                         " bytes of host memory for a KV pool"));
      }
    }
  }
  return cache;
}

void HostKvCache::CopyBlocks(const std::vector<BlockCopy>& copies) {
  const int64_t n = shape().block_elems();
  for (int64_t layer = 0; layer < shape().num_layers; ++layer) {
    for (const BlockCopy& c : copies) {
      std::copy_n(keys(layer) + c.src * n, n, keys(layer) + c.dst * n);
      std::copy_n(values(layer) + c.src * n, n, values(layer) + c.dst * n);
    }
  }
}

absl::Status HostKvCache::CopyBlocksToHost(int64_t first_layer, int64_t num_layers,
                                           absl::Span<const BlockCopy> copies, const HostKvBlocks& host) {
  return CopyWithHost(first_layer, num_layers, copies, host, /*to_host=*/true);
}

absl::Status HostKvCache::CopyBlocksFromHost(int64_t first_layer, int64_t num_layers,
                                             absl::Span<const BlockCopy> copies, const HostKvBlocks& host) {
  return CopyWithHost(first_layer, num_layers, copies, host, /*to_host=*/false);
}

absl::Status HostKvCache::CopyWithHost(int64_t first_layer, int64_t num_layers, absl::Span<const BlockCopy> copies,
                                       const HostKvBlocks& host, bool to_host) {
  if (absl::Status s = CheckHostCopies(first_layer, num_layers, copies, host, to_host); !s.ok()) return s;
  const int64_t n = shape().block_elems();
  for (int64_t layer = first_layer; layer < first_layer + num_layers; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      float* cache = kv == 0 ? keys(layer) : values(layer);
      float* staged = static_cast<float*>(kv == 0 ? host.keys[layer] : host.values[layer]);
      for (const BlockCopy& c : copies) {
        if (to_host) {
          std::copy_n(cache + c.src * n, n, staged + c.dst * n);
        } else {
          std::copy_n(staged + c.src * n, n, cache + c.dst * n);
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace duet

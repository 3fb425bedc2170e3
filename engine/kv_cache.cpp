#include "engine/kv_cache.h"

#include <algorithm>

namespace duet {
namespace {

KvCacheShape WithFloat32(KvCacheShape shape) {
  shape.dtype = KvDtype::kFloat32;
  return shape;
}

}  // namespace

HostKvCache::HostKvCache(KvCacheShape shape) : KvCache(WithFloat32(shape)) {
  const size_t layer_elems = static_cast<size_t>(shape.num_blocks * shape.block_elems());
  keys_.assign(shape.num_layers, std::vector<float>(layer_elems, 0.0f));
  values_.assign(shape.num_layers, std::vector<float>(layer_elems, 0.0f));
}

void HostKvCache::CopyBlocks(const std::vector<BlockCopy>& copies) {
  const int64_t n = shape().block_elems();
  for (int64_t layer = 0; layer < shape().num_layers; ++layer) {
    for (const BlockCopy& c : copies) {
      std::copy_n(keys_[layer].data() + c.src * n, n, keys_[layer].data() + c.dst * n);
      std::copy_n(values_[layer].data() + c.src * n, n, values_[layer].data() + c.dst * n);
    }
  }
}

}  // namespace duet

#include "router/prefix_aware_policy.h"

#include <tuple>
#include <utility>

namespace duet::router {

double PrefixAwarePolicy::CachedShare(const Worker& worker, const RequestInfo& request) const {
  if (request.block_hashes == nullptr) return 0;
  std::optional<v1::WorkerStats> stats = worker.stats();
  if (!stats.has_value() || stats->block_size() <= 0) return 0;
  const absl::Span<const BlockHash> chain = request.block_hashes->ForBlockSize(stats->block_size());
  if (chain.empty()) return 0;
  return double(index_->Match(&worker, chain)) / double(chain.size());
}

Worker* PrefixAwarePolicy::PickPrefill(const RequestInfo& request) {
  const PrefillPreference preference(*registry_, request);
  return PickMinKey(registry_->prefill_workers(), request, &prefill_rotation_, [&](const Worker& w) {
    return std::pair<int, double>{preference(w), Cost(w, request)};
  });
}

Worker* PrefixAwarePolicy::PickDecode(const RequestInfo& request) {
  const int64_t prompt_len = static_cast<int64_t>(request.prompt_token_ids.size());
  return PickMinKey(registry_->decode_workers(), request, &decode_rotation_, [&](const Worker& w) {
    int64_t free_blocks = 0;
    const int room = DecodeRoomPreference(w, prompt_len, &free_blocks);
    return std::tuple<int, double, int64_t>{room, Cost(w, request), -free_blocks};
  });
}

}  // namespace duet::router

#include "router/assignment_policy.h"

#include <algorithm>
#include <tuple>

namespace duet::router {

bool RequestInfo::IsExcluded(const Worker* worker) const {
  return std::find(excluded.begin(), excluded.end(), worker) != excluded.end();
}

PrefillPreference::PrefillPreference(const WorkerRegistry& registry, const RequestInfo& request) {
  int64_t sp_threshold = -1;
  for (const Worker* w : registry.prefill_workers()) {
    std::optional<v1::WorkerStats> stats = w->stats();
    if (!w->up() || !stats.has_value() || stats->sp_ranks() <= 1) continue;
    if (sp_threshold < 0 || stats->sp_min_tokens() < sp_threshold) sp_threshold = stats->sp_min_tokens();
  }
  long_prompt_ = sp_threshold >= 0 && int64_t(request.prompt_token_ids.size()) >= sp_threshold;
}

int PrefillPreference::operator()(const Worker& worker) const {
  std::optional<v1::WorkerStats> stats = worker.stats();
  const bool sequence_parallel = stats.has_value() && stats->sp_ranks() > 1;
  return sequence_parallel == long_prompt_ ? 0 : 1;
}

int DecodeRoomPreference(const Worker& worker, int64_t prompt_len, int64_t* free_blocks) {
  *free_blocks = 0;
  std::optional<v1::WorkerStats> stats = worker.stats();
  if (!stats.has_value()) return 0;
  *free_blocks = stats->num_free_kv_blocks();
  if (stats->block_size() <= 0) return 0;
  const int64_t needed = (prompt_len + stats->block_size() - 1) / stats->block_size();
  return *free_blocks >= needed ? 0 : 1;
}

Worker* LeastLoadedPolicy::PickPrefill(const RequestInfo& request) {
  const PrefillPreference preference(*registry_, request);
  return PickMinKey(registry_->prefill_workers(), request, &prefill_rotation_, [&preference](const Worker& w) {
    return std::pair<int, int>{preference(w), w.in_flight()};
  });
}

Worker* LeastLoadedPolicy::PickDecode(const RequestInfo& request) {
  const int64_t prompt_len = static_cast<int64_t>(request.prompt_token_ids.size());
  return PickMinKey(registry_->decode_workers(), request, &decode_rotation_, [prompt_len](const Worker& w) {
    // (cannot fit the prompt, in flight, -free blocks)
    int64_t free_blocks = 0;
    const int room = DecodeRoomPreference(w, prompt_len, &free_blocks);
    return std::tuple<int, int, int64_t>{room, w.in_flight(), -free_blocks};
  });
}

std::unique_ptr<AssignmentPolicy> MakeLeastLoadedPolicy(const WorkerRegistry* registry) {
  return std::make_unique<LeastLoadedPolicy>(registry);
}

}  // namespace duet::router

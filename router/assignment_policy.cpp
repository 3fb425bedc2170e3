#include "router/assignment_policy.h"

#include <algorithm>
#include <tuple>

namespace duet::router {

bool RequestInfo::IsExcluded(const Worker* worker) const {
  return std::find(excluded.begin(), excluded.end(), worker) != excluded.end();
}

namespace {

// Picks the worker with the smallest key, scanning from a rotating start so ties rotate.
template <typename KeyFn>
Worker* PickMin(const std::vector<Worker*>& workers, const RequestInfo& request,
                std::atomic<uint64_t>* rotation, KeyFn key) {
  const size_t n = workers.size();
  if (n == 0) return nullptr;
  const size_t start = rotation->fetch_add(1, std::memory_order_relaxed) % n;
  Worker* best = nullptr;
  decltype(key(nullptr)) best_key{};
  for (size_t i = 0; i < n; ++i) {
    Worker* worker = workers[(start + i) % n];
    if (!worker->up() || request.IsExcluded(worker)) continue;
    auto k = key(worker);
    if (best == nullptr || k < best_key) {
      best = worker;
      best_key = k;
    }
  }
  return best;
}

}  // namespace

Worker* LeastLoadedPolicy::PickPrefill(const RequestInfo& request) {
  // Long prompts (at least the shortest --sp-min-tokens of the sequence-parallel workers that are
  // up) go to sequence-parallel workers first, the others to the rest, so long prompts get the
  // ranks and short ones do not queue behind them; then fewest in flight.
  int64_t sp_threshold = -1;
  for (const auto& w : registry_->prefill_workers()) {
    std::optional<v1::WorkerStats> stats = w->stats();
    if (!w->up() || !stats.has_value() || stats->sp_ranks() <= 1) continue;
    if (sp_threshold < 0 || stats->sp_min_tokens() < sp_threshold) sp_threshold = stats->sp_min_tokens();
  }
  const bool long_prompt = sp_threshold >= 0 && int64_t(request.prompt_token_ids.size()) >= sp_threshold;
  return PickMin(registry_->prefill_workers(), request, &prefill_rotation_, [long_prompt](const Worker* w) {
    if (w == nullptr) return std::pair<int, int>{0, 0};
    std::optional<v1::WorkerStats> stats = w->stats();
    const bool sequence_parallel = stats.has_value() && stats->sp_ranks() > 1;
    return std::pair<int, int>{sequence_parallel == long_prompt ? 0 : 1, w->in_flight()};
  });
}

Worker* LeastLoadedPolicy::PickDecode(const RequestInfo& request) {
  const int64_t prompt_len = static_cast<int64_t>(request.prompt_token_ids.size());
  return PickMin(registry_->decode_workers(), request, &decode_rotation_, [prompt_len](const Worker* w) {
    // (cannot fit the prompt, in flight, -free blocks); unknown stats count as fitting, 0 free.
    if (w == nullptr) return std::tuple<int, int, int64_t>{0, 0, 0};
    int64_t free_blocks = 0;
    bool fits = true;
    if (std::optional<v1::WorkerStats> stats = w->stats()) {
      free_blocks = stats->num_free_kv_blocks();
      if (stats->block_size() > 0) {
        const int64_t needed = (prompt_len + stats->block_size() - 1) / stats->block_size();
        fits = free_blocks >= needed;
      }
    }
    return std::tuple<int, int, int64_t>{fits ? 0 : 1, w->in_flight(), -free_blocks};
  });
}

std::unique_ptr<AssignmentPolicy> MakeLeastLoadedPolicy(const WorkerRegistry* registry) {
  return std::make_unique<LeastLoadedPolicy>(registry);
}

}  // namespace duet::router

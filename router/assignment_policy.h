// Which prefill and decode worker serves a request. Policies see only workers that are up.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/types/span.h"
#include "router/prefix_index.h"
#include "router/worker_registry.h"

namespace duet::router {

// What a policy may look at to place a request.
struct RequestInfo {
  std::string_view request_id;
  absl::Span<const int32_t> prompt_token_ids;
  // The prompt's block hashes (its cache salt folded in), for a prefix-aware policy;
  // null: none (the policy then sees no cached prefix).
  BlockHashChain* block_hashes = nullptr;
  int32_t max_tokens = 0;
  // Workers already tried for this request (failed or full); a policy never returns them.
  std::vector<const Worker*> excluded;

  bool IsExcluded(const Worker* worker) const;
};

class AssignmentPolicy {
 public:
  virtual ~AssignmentPolicy() = default;
  // nullptr when no eligible worker is up. Thread-safe.
  virtual Worker* PickPrefill(const RequestInfo& request) = 0;
  virtual Worker* PickDecode(const RequestInfo& request) = 0;
};

// Fewest in-flight requests. Prefill: a prompt of at least the sequence-parallel workers'
// --sp-min-tokens prefers them, a shorter one the others (then fewest in flight). Decode: workers
// whose last reported free KV blocks cannot hold the prompt come last, then fewest in flight, then
// most free KV blocks. Remaining ties rotate, so an idle cluster still spreads sequential requests.
class LeastLoadedPolicy : public AssignmentPolicy {
 public:
  explicit LeastLoadedPolicy(const WorkerRegistry* registry) : registry_(registry) {}
  Worker* PickPrefill(const RequestInfo& request) override;
  Worker* PickDecode(const RequestInfo& request) override;

 private:
  const WorkerRegistry* registry_;
  std::atomic<uint64_t> prefill_rotation_{0};
  std::atomic<uint64_t> decode_rotation_{0};
};

std::unique_ptr<AssignmentPolicy> MakeLeastLoadedPolicy(const WorkerRegistry* registry);

// The rules every policy keeps, as the first key of its choice (0 preferred, 1 not).
//
// Prefill: a prompt of at least the shortest --sp-min-tokens of the sequence-parallel workers up
// is long and prefers them; a shorter one prefers the others (so long prompts get the ranks and
// short ones do not queue behind them).
class PrefillPreference {
 public:
  PrefillPreference(const WorkerRegistry& registry, const RequestInfo& request);
  int operator()(const Worker& worker) const;

 private:
  bool long_prompt_ = false;
};
// Decode: 1 when the worker's last reported free KV blocks cannot hold the prompt (unknown stats
// count as room); *free_blocks gets them (0 when unknown).
int DecodeRoomPreference(const Worker& worker, int64_t prompt_len, int64_t* free_blocks);

// The up, not excluded worker of `workers` with the smallest key(worker), scanning from a
// rotating start so that ties rotate; nullptr when there is none.
template <typename KeyFn>
Worker* PickMinKey(const std::vector<Worker*>& workers, const RequestInfo& request, std::atomic<uint64_t>* rotation,
                   KeyFn key) {
  const size_t n = workers.size();
  if (n == 0) return nullptr;
  const size_t start = rotation->fetch_add(1, std::memory_order_relaxed) % n;
  Worker* best = nullptr;
  decltype(key(*workers[0])) best_key{};
  for (size_t i = 0; i < n; ++i) {
    Worker* worker = workers[(start + i) % n];
    if (!worker->up() || request.IsExcluded(worker)) continue;
    auto k = key(*worker);
    if (best == nullptr || k < best_key) {
      best = worker;
      best_key = k;
    }
  }
  return best;
}

}  // namespace duet::router

// Prefix- and load-aware assignment (`--routing-policy prefix-aware`), after SGLang's cache-aware
// router and Dynamo's KV router: each eligible worker is scored by the prompt blocks the router's
// prefix index says it holds against its load, and the best score wins.
//
// The rules of LeastLoadedPolicy come first (prefill: sequence-parallel workers for long prompts,
// the others for short ones; decode: workers with room for the prompt's KV first). Among the
// workers they prefer, the cost of a worker is
//
//     in_flight − prefix_affinity × cached_share
//
// where in_flight is the requests the router has on it and cached_share the fraction of the
// prompt's full blocks the index predicts it has cached (its longest cached prefix). The lowest
// cost wins; then (decode) the most free KV blocks; then ties rotate. So a worker that holds the
// whole prompt is chosen over one with up to prefix_affinity fewer requests in flight — a cached
// prompt is worth that much queueing — and beyond that imbalance load wins; a hot prefix then
// spreads to a second worker and both cache it. Where no worker holds any of the prompt (or the
// affinity is 0) this is exactly LeastLoadedPolicy. One knob rather than SGLang's three
// thresholds: it trades cache affinity against load continuously instead of switching between
// two rules at an imbalance threshold.
#pragma once

#include <atomic>
#include <cstdint>

#include "router/assignment_policy.h"
#include "router/prefix_index.h"

namespace duet::router {

struct PrefixAwareOptions {
  // Requests in flight a whole cached prompt is worth (>= 0). 4: on the CPU cluster's
  // shared-prefix workload (docs/BENCHMARKS.md) 2 kept less of the prefixes on their worker (the
  // predicted hit rate 0.71 against 0.80 at 4) and 8 unbalanced the workers (63/37 of the prompt
  // tokens against 54/46 at 4) without more hits.
  double prefix_affinity = 4.0;
};

class PrefixAwarePolicy : public AssignmentPolicy {
 public:
  // `registry` and `index` outlive the policy.
  PrefixAwarePolicy(const WorkerRegistry* registry, const PrefixIndex* index, PrefixAwareOptions options = {})
      : registry_(registry), index_(index), options_(options) {}
  Worker* PickPrefill(const RequestInfo& request) override;
  Worker* PickDecode(const RequestInfo& request) override;

  // The share of the request's full prompt blocks (in `worker`'s block size) that the index says
  // `worker` holds as a prefix, in [0, 1]; 0 without block hashes or a known block size.
  double CachedShare(const Worker& worker, const RequestInfo& request) const;

 private:
  double Cost(const Worker& worker, const RequestInfo& request) const {
    return double(worker.in_flight()) - options_.prefix_affinity * CachedShare(worker, request);
  }

  const WorkerRegistry* const registry_;
  const PrefixIndex* const index_;
  const PrefixAwareOptions options_;
  std::atomic<uint64_t> prefill_rotation_{0};
  std::atomic<uint64_t> decode_rotation_{0};
};

}  // namespace duet::router

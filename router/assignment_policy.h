// Which prefill and decode worker serves a request. Policies see only workers that are up.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/types/span.h"
#include "router/worker_registry.h"

namespace duet::router {

// What a policy may look at to place a request. Prompt token ids are there for a
// prefix-cache-aware policy.
struct RequestInfo {
  std::string_view request_id;
  absl::Span<const int32_t> prompt_token_ids;
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

}  // namespace duet::router

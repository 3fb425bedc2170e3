#include "kvtransfer/lease_table.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "common/check.h"

namespace duet::kvtransfer {
namespace {

class RealClock final : public Clock {
 public:
  absl::Time Now() override { return absl::Now(); }
};

}  // namespace

Clock* Clock::Real() {
  static RealClock* clock = new RealClock();
  return clock;
}

std::string_view LeaseEndName(LeaseEnd reason) {
  switch (reason) {
    case LeaseEnd::kExpired:
      return "expired";
    case LeaseEnd::kCancelled:
      return "cancelled";
    case LeaseEnd::kAborted:
      return "aborted by sender";
    case LeaseEnd::kFailed:
      return "failed";
  }
  return "unknown";
}

LeaseTable::LeaseTable(Clock* clock, ReleaseCallback on_release)
    : clock_(clock), on_release_(std::move(on_release)) {
  DUET_CHECK(clock_ != nullptr);
  DUET_CHECK(on_release_ != nullptr);
}

absl::Status LeaseTable::Grant(uint64_t request_id, std::vector<uint32_t> block_ids,
                               absl::Duration ttl) {
  const absl::Time deadline = clock_->Now() + ttl;
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = leases_.try_emplace(request_id, Lease{std::move(block_ids), deadline});
  if (!inserted) {
    return absl::AlreadyExistsError(
        absl::StrFormat("request %u already holds a KV block lease", request_id));
  }
  return absl::OkStatus();
}

absl::Status LeaseTable::Renew(uint64_t request_id, absl::Duration ttl) {
  const absl::Time deadline = clock_->Now() + ttl;
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(request_id);
  if (it == leases_.end()) {
    return absl::NotFoundError(absl::StrFormat("request %u holds no KV block lease", request_id));
  }
  it->second.deadline = std::max(it->second.deadline, deadline);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint32_t>> LeaseTable::Commit(uint64_t request_id) {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(request_id);
  if (it == leases_.end()) {
    return absl::NotFoundError(
        absl::StrFormat("request %u holds no KV block lease (already ended)", request_id));
  }
  std::vector<uint32_t> blocks = std::move(it->second.block_ids);
  leases_.erase(it);
  return blocks;
}

bool LeaseTable::Release(uint64_t request_id, LeaseEnd reason) {
  ReleasedLease released{request_id, {}, reason};
  {
    absl::MutexLock lock(&mu_);
    auto it = leases_.find(request_id);
    if (it == leases_.end()) return false;
    released.block_ids = std::move(it->second.block_ids);
    leases_.erase(it);
  }
  on_release_(released);
  return true;
}

size_t LeaseTable::ExpireDue() {
  std::vector<ReleasedLease> expired;
  {
    const absl::Time now = clock_->Now();
    absl::MutexLock lock(&mu_);
    for (auto it = leases_.begin(); it != leases_.end();) {
      if (it->second.deadline <= now) {
        expired.push_back({it->first, std::move(it->second.block_ids), LeaseEnd::kExpired});
        leases_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  for (const ReleasedLease& lease : expired) on_release_(lease);
  return expired.size();
}

bool LeaseTable::Holds(uint64_t request_id) const {
  absl::MutexLock lock(&mu_);
  return leases_.contains(request_id);
}

size_t LeaseTable::size() const {
  absl::MutexLock lock(&mu_);
  return leases_.size();
}

absl::Time LeaseTable::NextDeadline() const {
  absl::MutexLock lock(&mu_);
  absl::Time next = absl::InfiniteFuture();
  for (const auto& [id, lease] : leases_) next = std::min(next, lease.deadline);
  return next;
}

}  // namespace duet::kvtransfer

// Leases on receiver blocks: while a transfer is in flight, the destination blocks of a request
// are reserved until a deadline. A lease ends exactly once, in one of two ways:
//   - Commit: the transfer completed; the blocks now belong to the caller (no release).
//   - Release: expired, cancelled, aborted by the sender or failed; the release callback hands the
//     blocks back for reuse. It runs exactly once per lease, outside the table's lock, so it may
//     call back into the table.
// Thread-safe. Time comes from an injectable Clock so tests can drive expiry.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace duet::kvtransfer {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() = 0;
  // The process-wide wall clock.
  static Clock* Real();
};

enum class LeaseEnd : uint8_t {
  kExpired,      // deadline passed before the transfer finished (e.g. the sender died)
  kCancelled,    // the receiver's owner cancelled the request
  kAborted,      // the sender aborted the request
  kFailed,       // the transfer failed (e.g. checksum mismatch)
};
std::string_view LeaseEndName(LeaseEnd reason);

struct ReleasedLease {
  uint64_t request_id = 0;
  std::vector<uint32_t> block_ids;
  LeaseEnd reason = LeaseEnd::kExpired;
};

class LeaseTable {
 public:
  using ReleaseCallback = std::function<void(const ReleasedLease&)>;

  LeaseTable(Clock* clock, ReleaseCallback on_release);
  LeaseTable(const LeaseTable&) = delete;
  LeaseTable& operator=(const LeaseTable&) = delete;

  // Reserves `block_ids` for `request_id` until `ttl` from now. AlreadyExists if the request
  // already holds a lease.
  absl::Status Grant(uint64_t request_id, std::vector<uint32_t> block_ids, absl::Duration ttl);
  // Pushes the deadline to `ttl` from now (never earlier). NotFound if the lease has ended.
  absl::Status Renew(uint64_t request_id, absl::Duration ttl);
  // Ends the lease successfully and returns its blocks; no release callback.
  absl::StatusOr<std::vector<uint32_t>> Commit(uint64_t request_id);
  // Ends the lease and runs the release callback. False if the lease had already ended.
  bool Release(uint64_t request_id, LeaseEnd reason);
  // Releases (reason kExpired) every lease whose deadline is not after now; returns how many.
  size_t ExpireDue();

  bool Holds(uint64_t request_id) const;
  size_t size() const;
  // Earliest deadline among live leases, or absl::InfiniteFuture().
  absl::Time NextDeadline() const;

 private:
  struct Lease {
    std::vector<uint32_t> block_ids;
    absl::Time deadline;
  };

  Clock* const clock_;
  const ReleaseCallback on_release_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Lease> leases_ ABSL_GUARDED_BY(mu_);
};

}  // namespace duet::kvtransfer

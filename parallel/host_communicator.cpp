#include "parallel/host_communicator.h"

#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/check.h"

namespace duet::parallel {
namespace {

// The state the ranks of one group share: a mailbox per rank for ring exchanges, one broadcast
// slot and one barrier, all under one mutex (a handful of ranks; the copies run outside it).
class HostGroup {
 public:
  explicit HostGroup(int size) : size_(size), mailboxes_(size) {}
  int size() const { return size_; }

  // Posts `rank`'s send buffer for its next exchange and returns that exchange's number.
  uint64_t PostSend(int rank, std::span<const std::byte> send) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    Mailbox& box = mailboxes_[rank];
    DUET_CHECK_MSG(!box.in_flight, "one ring exchange in flight per communicator");
    box.in_flight = true;
    box.send = send;
    return ++box.posted;
  }

  // Completes `rank`'s exchange `exchange`: waits for the previous rank's send of the same
  // exchange, copies it into `recv` and frees it, then waits until the next rank has copied this
  // rank's send.
  absl::Status CompleteExchange(int rank, uint64_t exchange, std::span<std::byte> recv)
      ABSL_LOCKS_EXCLUDED(mu_) {
    const int prev = (rank + size_ - 1) % size_;
    std::span<const std::byte> incoming;
    {
      absl::MutexLock lock(&mu_);
      auto posted = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return mailboxes_[prev].posted >= exchange;
      };
      mu_.Await(absl::Condition(&posted));
      // The previous rank cannot start its next exchange before this one frees its buffer.
      DUET_CHECK(mailboxes_[prev].posted == exchange);
      incoming = mailboxes_[prev].send;
    }
    // The previous rank leaves its send buffer alone until `consumed` reaches this exchange, so
    // it is read without the lock.
    absl::Status received = absl::OkStatus();
    if (incoming.size() != recv.size()) {
      received = absl::InvalidArgumentError(absl::StrFormat(
          "ring exchange %d: rank %d sent %d bytes, rank %d expects %d", exchange, prev,
          incoming.size(), rank, recv.size()));
    } else if (!recv.empty() && recv.data() != incoming.data()) {
      std::memcpy(recv.data(), incoming.data(), recv.size());
    }

    absl::MutexLock lock(&mu_);
    mailboxes_[prev].consumed = exchange;
    mailboxes_[prev].consumed_status = received;
    auto consumed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return mailboxes_[rank].consumed >= exchange;
    };
    mu_.Await(absl::Condition(&consumed));
    Mailbox& box = mailboxes_[rank];
    box.in_flight = false;
    box.send = {};
    return received.ok() ? box.consumed_status : received;
  }

  // Every rank arrives and leaves its buffer and root; the last to arrive checks that they
  // agree, then the other ranks copy the root's buffer and the root waits for their copies.
  absl::Status Broadcast(int rank, std::span<std::byte> data, int root) ABSL_LOCKS_EXCLUDED(mu_) {
    std::span<const std::byte> source;
    {
      absl::MutexLock lock(&mu_);
      mailboxes_[rank].broadcast_data = data;
      mailboxes_[rank].broadcast_root = root;
      const uint64_t generation = broadcast_generation_;
      if (++broadcast_arrived_ == size_) {
        broadcast_arrived_ = 0;
        broadcast_status_ = CheckBroadcastLocked();
        broadcast_source_ = broadcast_status_.ok() ? mailboxes_[root].broadcast_data
                                                   : std::span<const std::byte>();
        broadcast_copies_left_ = broadcast_status_.ok() ? size_ - 1 : 0;
        ++broadcast_generation_;
      } else {
        // A later broadcast cannot complete (and overwrite the fields read below) before this
        // rank has arrived at it.
        auto completed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return broadcast_generation_ != generation;
        };
        mu_.Await(absl::Condition(&completed));
      }
      if (!broadcast_status_.ok()) return broadcast_status_;
      if (rank == root) {
        auto copied = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return broadcast_copies_left_ == 0;
        };
        mu_.Await(absl::Condition(&copied));
        return absl::OkStatus();
      }
      source = broadcast_source_;
    }
    // The root stays inside Broadcast, its buffer untouched, until every copy is done.
    if (!data.empty()) std::memcpy(data.data(), source.data(), data.size());
    absl::MutexLock lock(&mu_);
    --broadcast_copies_left_;
    return absl::OkStatus();
  }

  void Barrier() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    const uint64_t generation = barrier_generation_;
    if (++barrier_arrived_ == size_) {
      barrier_arrived_ = 0;
      ++barrier_generation_;
      return;
    }
    auto released = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return barrier_generation_ != generation;
    };
    mu_.Await(absl::Condition(&released));
  }

 private:
  struct Mailbox {
    // Ring exchanges, numbered from 1 per rank; every rank's n-th exchange pairs with its
    // neighbours' n-th.
    std::span<const std::byte> send;  // the buffer of exchange `posted`, while in flight
    uint64_t posted = 0;              // the last exchange this rank started
    uint64_t consumed = 0;            // the last exchange whose send the next rank has copied
    absl::Status consumed_status;     // that copy's outcome (a size mismatch fails both ends)
    bool in_flight = false;
    // This rank's arguments to the broadcast being gathered.
    std::span<std::byte> broadcast_data;
    int broadcast_root = 0;
  };

  // Every rank named the same valid root and the same size.
  absl::Status CheckBroadcastLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int root = mailboxes_[0].broadcast_root;
    if (root < 0 || root >= size_) {
      return absl::InvalidArgumentError(
          absl::StrFormat("broadcast root %d outside a group of %d ranks", root, size_));
    }
    const size_t bytes = mailboxes_[root].broadcast_data.size();
    for (int r = 0; r < size_; ++r) {
      const Mailbox& box = mailboxes_[r];
      if (box.broadcast_root != root) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "broadcast: rank %d names root %d, rank 0 names %d", r, box.broadcast_root, root));
      }
      if (box.broadcast_data.size() != bytes) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "broadcast: rank %d has %d bytes, root %d has %d", r, box.broadcast_data.size(), root,
            bytes));
      }
    }
    return absl::OkStatus();
  }

  const int size_;
  absl::Mutex mu_;
  std::vector<Mailbox> mailboxes_ ABSL_GUARDED_BY(mu_);
  // The broadcast being gathered (`broadcast_arrived_` ranks in) and the last one completed.
  int broadcast_arrived_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t broadcast_generation_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status broadcast_status_ ABSL_GUARDED_BY(mu_);
  std::span<const std::byte> broadcast_source_ ABSL_GUARDED_BY(mu_);
  int broadcast_copies_left_ ABSL_GUARDED_BY(mu_) = 0;
  int barrier_arrived_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t barrier_generation_ ABSL_GUARDED_BY(mu_) = 0;
};

class HostPendingExchange final : public PendingExchange {
 public:
  HostPendingExchange(std::shared_ptr<HostGroup> group, int rank, uint64_t exchange,
                      std::span<std::byte> recv)
      : group_(std::move(group)), rank_(rank), exchange_(exchange), recv_(recv) {}
  // The buffers are in use until the exchange completes, so dropping it unwaited waits.
  ~HostPendingExchange() override { (void)Wait(); }

  absl::Status Wait() override {
    if (!done_) {
      status_ = group_->CompleteExchange(rank_, exchange_, recv_);
      done_ = true;
    }
    return status_;
  }

 private:
  const std::shared_ptr<HostGroup> group_;
  const int rank_;
  const uint64_t exchange_;
  const std::span<std::byte> recv_;
  bool done_ = false;
  absl::Status status_;
};

class HostCommunicator final : public Communicator {
 public:
  HostCommunicator(std::shared_ptr<HostGroup> group, int rank)
      : group_(std::move(group)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }

  std::unique_ptr<PendingExchange> StartRingExchange(std::span<const std::byte> send,
                                                     std::span<std::byte> recv) override {
    const uint64_t exchange = group_->PostSend(rank_, send);
    return std::make_unique<HostPendingExchange>(group_, rank_, exchange, recv);
  }

  absl::Status Broadcast(std::span<std::byte> data, int root) override {
    return group_->Broadcast(rank_, data, root);
  }

  absl::Status Barrier() override {
    group_->Barrier();
    return absl::OkStatus();
  }

 private:
  const std::shared_ptr<HostGroup> group_;
  const int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> CreateHostCommunicators(int size) {
  DUET_CHECK(size >= 1);
  auto group = std::make_shared<HostGroup>(size);
  std::vector<std::unique_ptr<Communicator>> ranks;
  ranks.reserve(size);
  for (int rank = 0; rank < size; ++rank) {
    ranks.push_back(std::make_unique<HostCommunicator>(group, rank));
  }
  return ranks;
}

}  // namespace duet::parallel

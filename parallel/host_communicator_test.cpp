#include "parallel/host_communicator.h"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace duet::parallel {
namespace {

// Runs `body` once per rank of a fresh group of `size`, each on a thread of its own.
void RunRanks(int size, const std::function<void(Communicator&)>& body) {
  std::vector<std::unique_ptr<Communicator>> ranks = CreateHostCommunicators(size);
  ASSERT_EQ(ranks.size(), static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    ASSERT_EQ(ranks[r]->rank(), r);
    ASSERT_EQ(ranks[r]->size(), size);
    threads.emplace_back([&, r] { body(*ranks[r]); });
  }
  for (std::thread& t : threads) t.join();
}

std::span<const std::byte> Bytes(const std::vector<int64_t>& v) {
  return std::as_bytes(std::span(v));
}
std::span<std::byte> Bytes(std::vector<int64_t>& v) { return std::as_writable_bytes(std::span(v)); }

// A block that names the rank that made it and the step it belongs to, element by element.
std::vector<int64_t> Block(int owner, int step, size_t elements) {
  std::vector<int64_t> block(elements);
  for (size_t i = 0; i < elements; ++i) {
    block[i] = (int64_t{owner} << 40) + (int64_t{step} << 20) + static_cast<int64_t>(i);
  }
  return block;
}

class HostRingTest : public ::testing::TestWithParam<int> {};

// N - 1 double-buffered steps carry every rank's block all the way round: at step s rank r holds
// rank (r - s)'s block, so it sees each other rank's block once, in ring order.
TEST_P(HostRingTest, BlocksGoAllTheWayRound) {
  const int size = GetParam();
  constexpr size_t kElements = 1000;
  std::vector<std::vector<int>> seen(size);
  RunRanks(size, [&](Communicator& comm) {
    const int r = comm.rank();
    std::vector<int64_t> buffers[2] = {Block(r, 0, kElements), std::vector<int64_t>(kElements)};
    for (int step = 1; step < size; ++step) {
      std::vector<int64_t>& in_hand = buffers[(step - 1) % 2];
      std::vector<int64_t>& next = buffers[step % 2];
      std::fill(next.begin(), next.end(), -1);
      std::unique_ptr<PendingExchange> exchange =
          comm.StartRingExchange(Bytes(in_hand), Bytes(next));
      ASSERT_TRUE(exchange->Wait().ok());
      const int owner = static_cast<int>(next[0] >> 40);
      EXPECT_EQ(owner, (r - step + size) % size) << "rank " << r << " step " << step;
      EXPECT_EQ(next, Block(owner, 0, kElements));
      seen[r].push_back(owner);
    }
  });
  for (int r = 0; r < size; ++r) {
    ASSERT_EQ(seen[r].size(), static_cast<size_t>(size - 1));
    for (int step = 1; step < size; ++step) {
      EXPECT_EQ(seen[r][step - 1], (r - step + size) % size);
    }
  }
}

// The caller computes on the block in hand while the next one travels; the send buffer is read
// by the neighbour during that time, so it stays untouched, and the result is the same.
TEST_P(HostRingTest, ComputeOverlapsTheExchangeInFlight) {
  const int size = GetParam();
  constexpr size_t kElements = 1 << 16;
  RunRanks(size, [&](Communicator& comm) {
    const int r = comm.rank();
    std::vector<int64_t> in_hand = Block(r, 0, kElements);
    std::vector<int64_t> next(kElements);
    int64_t total = 0;
    for (int step = 0; step < size; ++step) {
      std::unique_ptr<PendingExchange> exchange;
      if (step + 1 < size) exchange = comm.StartRingExchange(Bytes(in_hand), Bytes(next));
      const int owner = (r - step + size) % size;
      int64_t sum = 0;
      for (int64_t v : in_hand) sum += v;  // the "attention" on the block in hand
      std::vector<int64_t> expected = Block(owner, 0, kElements);
      int64_t expected_sum = 0;
      for (int64_t v : expected) expected_sum += v;
      EXPECT_EQ(sum, expected_sum) << "rank " << r << " step " << step;
      total += sum;
      if (exchange != nullptr) {
        ASSERT_TRUE(exchange->Wait().ok());
        std::swap(in_hand, next);
      }
    }
    int64_t want = 0;
    for (int owner = 0; owner < size; ++owner) {
      for (int64_t v : Block(owner, 0, kElements)) want += v;
    }
    EXPECT_EQ(total, want);
  });
}

// Many exchanges back to back, each step's data fresh, so a stale or early copy shows.
TEST_P(HostRingTest, ThousandsOfExchanges) {
  const int size = GetParam();
  constexpr int kSteps = 2000;
  constexpr size_t kElements = 64;
  RunRanks(size, [&](Communicator& comm) {
    const int r = comm.rank();
    const int prev = (r - 1 + size) % size;
    std::vector<int64_t> recv(kElements);
    for (int step = 0; step < kSteps; ++step) {
      const std::vector<int64_t> send = Block(r, step, kElements);
      std::unique_ptr<PendingExchange> exchange = comm.StartRingExchange(Bytes(send), Bytes(recv));
      ASSERT_TRUE(exchange->Wait().ok());
      ASSERT_EQ(recv, Block(prev, step, kElements)) << "rank " << r << " step " << step;
    }
  });
}

TEST_P(HostRingTest, BroadcastFromEveryRoot) {
  const int size = GetParam();
  constexpr size_t kElements = 4096;
  for (int root = 0; root < size; ++root) {
    RunRanks(size, [&](Communicator& comm) {
      std::vector<int64_t> data =
          comm.rank() == root ? Block(root, 7, kElements) : std::vector<int64_t>(kElements, -1);
      ASSERT_TRUE(comm.Broadcast(Bytes(data), root).ok());
      EXPECT_EQ(data, Block(root, 7, kElements)) << "rank " << comm.rank() << " root " << root;
    });
  }
}

// Broadcasts back to back with the root moving round: a rank that finishes early and enters the
// next one must not disturb the ranks still copying the last.
TEST_P(HostRingTest, RepeatedBroadcasts) {
  const int size = GetParam();
  RunRanks(size, [&](Communicator& comm) {
    for (int i = 0; i < 500; ++i) {
      const int root = i % size;
      std::vector<int64_t> data =
          comm.rank() == root ? Block(root, i, 16) : std::vector<int64_t>(16, -1);
      ASSERT_TRUE(comm.Broadcast(Bytes(data), root).ok());
      ASSERT_EQ(data, Block(root, i, 16)) << "rank " << comm.rank() << " broadcast " << i;
    }
  });
}

TEST_P(HostRingTest, BarrierHoldsEveryoneUntilAllArrive) {
  const int size = GetParam();
  constexpr int kRounds = 300;
  std::atomic<int> arrived{0};
  RunRanks(size, [&](Communicator& comm) {
    for (int round = 0; round < kRounds; ++round) {
      arrived.fetch_add(1);
      ASSERT_TRUE(comm.Barrier().ok());
      // Everyone has arrived at this round; nobody can be past the next barrier.
      const int now = arrived.load();
      EXPECT_GE(now, (round + 1) * size);
      EXPECT_LT(now, (round + 2) * size);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Sizes, HostRingTest, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "size" + std::to_string(info.param); });

TEST(HostCommunicatorTest, SizeOneExchangesWithItself) {
  std::vector<std::unique_ptr<Communicator>> ranks = CreateHostCommunicators(1);
  Communicator& comm = *ranks[0];
  const std::vector<int64_t> send = Block(0, 3, 100);
  std::vector<int64_t> recv(100, -1);
  ASSERT_TRUE(comm.StartRingExchange(Bytes(send), Bytes(recv))->Wait().ok());
  EXPECT_EQ(recv, send);
  std::vector<int64_t> data = Block(0, 4, 10);
  ASSERT_TRUE(comm.Broadcast(Bytes(data), 0).ok());
  EXPECT_EQ(data, Block(0, 4, 10));
  EXPECT_TRUE(comm.Barrier().ok());
  EXPECT_EQ(comm.Broadcast(Bytes(data), 1).code(), absl::StatusCode::kInvalidArgument);
}

// StartRingExchange returns before the neighbours have posted anything.
TEST(HostCommunicatorTest, StartDoesNotWaitForPeers) {
  std::vector<std::unique_ptr<Communicator>> ranks = CreateHostCommunicators(2);
  std::vector<int64_t> send0 = Block(0, 0, 8), recv0(8), send1 = Block(1, 0, 8), recv1(8);
  absl::Notification started;
  std::thread rank1([&] {
    ASSERT_TRUE(started.WaitForNotificationWithTimeout(absl::Seconds(30)));
    ASSERT_TRUE(ranks[1]->StartRingExchange(Bytes(send1), Bytes(recv1))->Wait().ok());
  });
  std::unique_ptr<PendingExchange> exchange =
      ranks[0]->StartRingExchange(Bytes(send0), Bytes(recv0));
  started.Notify();
  EXPECT_TRUE(exchange->Wait().ok());
  rank1.join();
  EXPECT_EQ(recv0, send1);
  EXPECT_EQ(recv1, send0);
}

// Dropping an exchange without waiting completes it (its buffers are in use until then).
TEST(HostCommunicatorTest, DroppedExchangeCompletes) {
  RunRanks(3, [](Communicator& comm) {
    const std::vector<int64_t> send = Block(comm.rank(), 0, 32);
    std::vector<int64_t> recv(32, -1);
    comm.StartRingExchange(Bytes(send), Bytes(recv)).reset();
    EXPECT_EQ(recv, Block((comm.rank() + 2) % 3, 0, 32));
  });
}

// A link whose two ends disagree on the size fails at both ends; the other links complete.
TEST(HostCommunicatorTest, ExchangeSizeMismatchFailsBothEnds) {
  std::vector<absl::StatusCode> codes(3);
  RunRanks(3, [&](Communicator& comm) {
    const std::vector<int64_t> send = Block(comm.rank(), 0, comm.rank() == 1 ? 4 : 8);
    std::vector<int64_t> recv(8, -1);
    codes[comm.rank()] = comm.StartRingExchange(Bytes(send), Bytes(recv))->Wait().code();
  });
  EXPECT_EQ(codes[0], absl::StatusCode::kOk);
  EXPECT_EQ(codes[1], absl::StatusCode::kInvalidArgument);  // sent 4 bytes to rank 2
  EXPECT_EQ(codes[2], absl::StatusCode::kInvalidArgument);  // expected 8
}

// Ranks that disagree on a broadcast's root or size all get InvalidArgument; none hangs, and the
// group stays usable.
TEST(HostCommunicatorTest, BroadcastDisagreementFailsEveryRank) {
  RunRanks(3, [](Communicator& comm) {
    std::vector<int64_t> data(comm.rank() == 2 ? 4 : 8, 1);
    EXPECT_EQ(comm.Broadcast(Bytes(data), 0).code(), absl::StatusCode::kInvalidArgument);
    std::vector<int64_t> same(8, comm.rank());
    EXPECT_EQ(comm.Broadcast(Bytes(same), comm.rank() == 0 ? 1 : 0).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(comm.Broadcast(Bytes(same), 5).code(), absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE(comm.Broadcast(Bytes(same), 2).ok());
    EXPECT_EQ(same, std::vector<int64_t>(8, 2));
  });
}

}  // namespace
}  // namespace duet::parallel

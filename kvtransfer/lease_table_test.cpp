#include "kvtransfer/lease_table.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

namespace duet::kvtransfer {
namespace {

using ::testing::ElementsAre;

class FakeClock final : public Clock {
 public:
  absl::Time Now() override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  absl::Mutex mu_;
  absl::Time now_ = absl::UnixEpoch() + absl::Hours(1);
};

class LeaseTableTest : public ::testing::Test {
 protected:
  LeaseTable table_{&clock_, [this](const ReleasedLease& lease) {
                      absl::MutexLock lock(&mu_);
                      released_.push_back(lease);
                    }};
  std::vector<ReleasedLease> Released() {
    absl::MutexLock lock(&mu_);
    return released_;
  }

  FakeClock clock_;
  absl::Mutex mu_;
  std::vector<ReleasedLease> released_;
};

TEST_F(LeaseTableTest, ExpiresAtTheDeadlineAndReleasesOnce) {
  ASSERT_TRUE(table_.Grant(1, {4, 5}, absl::Seconds(10)).ok());
  ASSERT_TRUE(table_.Grant(2, {6}, absl::Seconds(20)).ok());
  EXPECT_EQ(table_.NextDeadline(), clock_.Now() + absl::Seconds(10));
  clock_.Advance(absl::Seconds(9));
  EXPECT_EQ(table_.ExpireDue(), 0u);
  clock_.Advance(absl::Seconds(1));
  EXPECT_EQ(table_.ExpireDue(), 1u);
  EXPECT_EQ(table_.ExpireDue(), 0u);
  ASSERT_EQ(Released().size(), 1u);
  EXPECT_EQ(Released()[0].request_id, 1u);
  EXPECT_THAT(Released()[0].block_ids, ElementsAre(4, 5));
  EXPECT_EQ(Released()[0].reason, LeaseEnd::kExpired);
  EXPECT_FALSE(table_.Holds(1));
  EXPECT_TRUE(table_.Holds(2));
  EXPECT_FALSE(table_.Release(1, LeaseEnd::kCancelled));  // already ended
}

TEST_F(LeaseTableTest, RenewPushesTheDeadline) {
  ASSERT_TRUE(table_.Grant(1, {0}, absl::Seconds(10)).ok());
  clock_.Advance(absl::Seconds(8));
  ASSERT_TRUE(table_.Renew(1, absl::Seconds(10)).ok());
  ASSERT_TRUE(table_.Renew(1, absl::Seconds(1)).ok());  // never shortens
  clock_.Advance(absl::Seconds(9));
  EXPECT_EQ(table_.ExpireDue(), 0u);
  clock_.Advance(absl::Seconds(1));
  EXPECT_EQ(table_.ExpireDue(), 1u);
  EXPECT_EQ(table_.Renew(1, absl::Seconds(1)).code(), absl::StatusCode::kNotFound);
}

TEST_F(LeaseTableTest, CommitHandsBlocksOverWithoutRelease) {
  ASSERT_TRUE(table_.Grant(1, {7, 8}, absl::Seconds(1)).ok());
  absl::StatusOr<std::vector<uint32_t>> blocks = table_.Commit(1);
  ASSERT_TRUE(blocks.ok());
  EXPECT_THAT(*blocks, ElementsAre(7, 8));
  clock_.Advance(absl::Seconds(5));
  EXPECT_EQ(table_.ExpireDue(), 0u);
  EXPECT_FALSE(table_.Release(1, LeaseEnd::kCancelled));
  EXPECT_FALSE(table_.Commit(1).ok());
  EXPECT_TRUE(Released().empty());
}

TEST_F(LeaseTableTest, CancelReleasesAndDuplicateGrantIsRefused) {
  ASSERT_TRUE(table_.Grant(3, {1}, absl::Seconds(1)).ok());
  EXPECT_EQ(table_.Grant(3, {2}, absl::Seconds(1)).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(table_.Release(3, LeaseEnd::kCancelled));
  EXPECT_FALSE(table_.Release(3, LeaseEnd::kCancelled));
  ASSERT_EQ(Released().size(), 1u);
  EXPECT_EQ(Released()[0].reason, LeaseEnd::kCancelled);
  EXPECT_THAT(Released()[0].block_ids, ElementsAre(1));
  EXPECT_EQ(table_.size(), 0u);
}

TEST_F(LeaseTableTest, CallbackMayReenterTheTable) {
  LeaseTable* table = nullptr;
  LeaseTable reentrant(&clock_, [&](const ReleasedLease& lease) {
    // E.g. the owner re-grants the freed blocks at once.
    ASSERT_TRUE(table->Grant(lease.request_id + 100, lease.block_ids, absl::Seconds(1)).ok());
  });
  table = &reentrant;
  ASSERT_TRUE(reentrant.Grant(1, {9}, absl::Seconds(1)).ok());
  clock_.Advance(absl::Seconds(2));
  EXPECT_EQ(reentrant.ExpireDue(), 1u);
  EXPECT_TRUE(reentrant.Holds(101));
}

TEST_F(LeaseTableTest, RacingEndsReleaseEachLeaseExactlyOnce) {
  constexpr int kLeases = 2000;
  for (int i = 0; i < kLeases; ++i) ASSERT_TRUE(table_.Grant(i, {uint32_t(i)}, absl::Seconds(1)).ok());
  clock_.Advance(absl::Seconds(1));
  std::atomic<int> commits{0};
  std::vector<std::thread> threads;
  threads.emplace_back([&] { table_.ExpireDue(); });
  threads.emplace_back([&] {
    for (int i = 0; i < kLeases; ++i) table_.Release(i, LeaseEnd::kCancelled);
  });
  threads.emplace_back([&] {
    for (int i = kLeases - 1; i >= 0; --i) commits += table_.Commit(i).ok();
  });
  for (auto& t : threads) t.join();
  std::vector<int> ends(kLeases, 0);
  for (const ReleasedLease& lease : Released()) ++ends[lease.request_id];
  int released = 0;
  for (int count : ends) {
    ASSERT_LE(count, 1);
    released += count;
  }
  EXPECT_EQ(released + commits.load(), kLeases);
  EXPECT_EQ(table_.size(), 0u);
}

}  // namespace
}  // namespace duet::kvtransfer

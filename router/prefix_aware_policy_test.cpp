#include "router/prefix_aware_policy.h"

#include <numeric>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace duet::router {
namespace {

constexpr int kBlockSize = 16;

// Workers at addresses nothing listens on; the registry is never started, so states and stats
// are set here. Every worker reports 16-token blocks.
class PrefixAwarePolicyTest : public ::testing::Test {
 protected:
  PrefixAwarePolicyTest()
      : registry_({"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"}, {"127.0.0.1:4", "127.0.0.1:5", "127.0.0.1:6"}),
        policy_(&registry_, &index_, {.prefix_affinity = 2.0}) {
    for (WorkerRole role : {WorkerRole::kPrefill, WorkerRole::kDecode}) {
      for (Worker* worker : registry_.workers(role)) {
        worker->SetUpForTesting(true);
        worker->SetStatsForTesting(Stats(1000));
      }
    }
    SetPrompt(64);  // 4 blocks
  }
  Worker* prefill(int i) { return registry_.prefill_workers()[size_t(i)]; }
  Worker* decode(int i) { return registry_.decode_workers()[size_t(i)]; }
  static v1::WorkerStats Stats(int free_blocks) {
    v1::WorkerStats stats;
    stats.set_num_kv_blocks(1000);
    stats.set_num_free_kv_blocks(free_blocks);
    stats.set_block_size(kBlockSize);
    return stats;
  }
  // The request's prompt: tokens 1, 2, ... `length`.
  void SetPrompt(int length) {
    prompt_.resize(static_cast<size_t>(length));
    std::iota(prompt_.begin(), prompt_.end(), 1);
    hashes_.emplace(PrefixSeed("tiny", ""), prompt_);
    request_.prompt_token_ids = prompt_;
    request_.block_hashes = &*hashes_;
  }
  // `worker` holds the first `blocks` blocks of the prompt, by the index.
  void Cache(const Worker* worker, int blocks) {
    const absl::Span<const BlockHash> chain = hashes_->ForBlockSize(kBlockSize);
    index_.Insert(worker, chain.subspan(0, size_t(blocks)), 1000);
  }

  WorkerRegistry registry_;
  PrefixIndex index_;
  PrefixAwarePolicy policy_;
  std::vector<int32_t> prompt_;
  std::optional<BlockHashChain> hashes_;
  RequestInfo request_;
};

TEST_F(PrefixAwarePolicyTest, WithoutCachedPrefixesItIsLeastLoaded) {
  prefill(0)->AddInFlight(2);
  prefill(2)->AddInFlight(1);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(policy_.PickPrefill(request_), prefill(1));
  // Ties rotate, so an idle cluster spreads sequential requests.
  prefill(0)->AddInFlight(-2);
  prefill(2)->AddInFlight(-1);
  std::set<Worker*> picked;
  for (int i = 0; i < 3; ++i) picked.insert(policy_.PickPrefill(request_));
  EXPECT_EQ(picked.size(), 3u);
}

TEST_F(PrefixAwarePolicyTest, AffinityWinsWhenLoadsAreClose) {
  Cache(prefill(1), 4);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(policy_.PickPrefill(request_), prefill(1));
  prefill(1)->AddInFlight(1);  // one more in flight than the others: the whole cached prompt still wins
  for (int i = 0; i < 5; ++i) EXPECT_EQ(policy_.PickPrefill(request_), prefill(1));
  Cache(decode(2), 4);
  decode(2)->AddInFlight(1);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(policy_.PickDecode(request_), decode(2));
}

TEST_F(PrefixAwarePolicyTest, LoadWinsWhenTheImbalanceIsLarge) {
  Cache(prefill(1), 4);
  prefill(1)->AddInFlight(3);  // more than prefix_affinity (2) beyond the others
  for (int i = 0; i < 5; ++i) EXPECT_NE(policy_.PickPrefill(request_), prefill(1));
  Cache(decode(0), 4);
  decode(0)->AddInFlight(3);
  for (int i = 0; i < 5; ++i) EXPECT_NE(policy_.PickDecode(request_), decode(0));
}

TEST_F(PrefixAwarePolicyTest, TheLongerCachedPrefixWinsAndCountsInProportion) {
  Cache(prefill(0), 2);  // half the prompt: worth one request in flight
  Cache(prefill(2), 4);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(policy_.PickPrefill(request_), prefill(2));
  EXPECT_DOUBLE_EQ(policy_.CachedShare(*prefill(0), request_), 0.5);
  EXPECT_DOUBLE_EQ(policy_.CachedShare(*prefill(2), request_), 1.0);
  prefill(2)->AddInFlight(2);
  prefill(1)->AddInFlight(5);
  // Costs: prefill 0: 0 - 2*0.5 = -1; prefill 2: 2 - 2*1 = 0; prefill 1: 5.
  for (int i = 0; i < 5; ++i) EXPECT_EQ(policy_.PickPrefill(request_), prefill(0));
}

TEST_F(PrefixAwarePolicyTest, SkipsDownAndExcludedWorkers) {
  Cache(prefill(1), 4);
  request_.excluded.push_back(prefill(1));
  for (int i = 0; i < 5; ++i) EXPECT_NE(policy_.PickPrefill(request_), prefill(1));
  request_.excluded.clear();
  prefill(1)->SetUpForTesting(false);
  for (int i = 0; i < 5; ++i) EXPECT_NE(policy_.PickPrefill(request_), prefill(1));
  prefill(0)->SetUpForTesting(false);
  prefill(2)->SetUpForTesting(false);
  EXPECT_EQ(policy_.PickPrefill(request_), nullptr);
}

TEST_F(PrefixAwarePolicyTest, KeepsTheSequenceParallelPreference) {
  v1::WorkerStats sp = Stats(1000);
  sp.set_sp_ranks(4);
  sp.set_sp_min_tokens(64);
  prefill(0)->SetStatsForTesting(sp);
  Cache(prefill(1), 4);  // the whole prompt is cached on a worker without ranks
  // A long prompt (64 tokens, the threshold) still goes to the sequence-parallel worker.
  for (int i = 0; i < 4; ++i) EXPECT_EQ(policy_.PickPrefill(request_), prefill(0));
  // A short one avoids it, even where only it holds the prefix.
  SetPrompt(48);
  Cache(prefill(0), 3);
  for (int i = 0; i < 4; ++i) EXPECT_NE(policy_.PickPrefill(request_), prefill(0));
}

TEST_F(PrefixAwarePolicyTest, DecodeKeepsTheKvRoomRuleAndFreeBlockTies) {
  Cache(decode(1), 4);
  decode(1)->SetStatsForTesting(Stats(3));  // cannot hold the 4-block prompt
  decode(0)->AddInFlight(1);
  decode(2)->AddInFlight(1);
  for (int i = 0; i < 5; ++i) EXPECT_NE(policy_.PickDecode(request_), decode(1));
  // Equal costs: the most free KV blocks.
  decode(0)->SetStatsForTesting(Stats(500));
  for (int i = 0; i < 5; ++i) EXPECT_EQ(policy_.PickDecode(request_), decode(2));
}

TEST_F(PrefixAwarePolicyTest, ZeroAffinityIgnoresTheCache) {
  PrefixAwarePolicy balanced(&registry_, &index_, {.prefix_affinity = 0});
  Cache(prefill(1), 4);
  prefill(1)->AddInFlight(1);
  for (int i = 0; i < 5; ++i) EXPECT_NE(balanced.PickPrefill(request_), prefill(1));
}

TEST_F(PrefixAwarePolicyTest, RequestsWithoutHashesOrStatsSeeNoCache) {
  Cache(prefill(1), 4);
  EXPECT_DOUBLE_EQ(policy_.CachedShare(*prefill(1), request_), 1.0);
  RequestInfo no_hashes;
  no_hashes.prompt_token_ids = prompt_;
  EXPECT_DOUBLE_EQ(policy_.CachedShare(*prefill(1), no_hashes), 0.0);
  prefill(1)->SetStatsForTesting(v1::WorkerStats());  // no block size reported
  EXPECT_DOUBLE_EQ(policy_.CachedShare(*prefill(1), request_), 0.0);
  SetPrompt(15);  // no full block
  EXPECT_DOUBLE_EQ(policy_.CachedShare(*prefill(0), request_), 0.0);
}

}  // namespace
}  // namespace duet::router

#include "router/assignment_policy.h"

#include <set>

#include "gtest/gtest.h"

namespace duet::router {
namespace {

// Workers at addresses nothing listens on; the registry is never started, so states are set here.
class AssignmentPolicyTest : public ::testing::Test {
 protected:
  AssignmentPolicyTest()
      : registry_({"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"}, {"127.0.0.1:4", "127.0.0.1:5", "127.0.0.1:6"}),
        policy_(&registry_) {
    for (WorkerRole role : {WorkerRole::kPrefill, WorkerRole::kDecode}) {
      for (Worker* worker : registry_.workers(role)) worker->SetUpForTesting(true);
    }
  }
  Worker* prefill(int i) { return registry_.prefill_workers()[i]; }
  Worker* decode(int i) { return registry_.decode_workers()[i]; }
  static v1::WorkerStats Stats(int free_blocks, int block_size = 16) {
    v1::WorkerStats stats;
    stats.set_num_free_kv_blocks(free_blocks);
    stats.set_block_size(block_size);
    return stats;
  }

  WorkerRegistry registry_;
  LeastLoadedPolicy policy_;
  RequestInfo request_;
};

TEST_F(AssignmentPolicyTest, PicksFewestInFlight) {
  prefill(0)->AddInFlight(2);
  prefill(1)->AddInFlight(1);
  prefill(2)->AddInFlight(3);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(policy_.PickPrefill(request_), prefill(1));
  decode(0)->AddInFlight(1);
  decode(1)->AddInFlight(1);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(policy_.PickDecode(request_), decode(2));
}

TEST_F(AssignmentPolicyTest, SkipsDownAndExcludedWorkers) {
  prefill(0)->SetUpForTesting(false);
  prefill(1)->AddInFlight(5);
  prefill(2)->SetUpForTesting(false);
  EXPECT_EQ(policy_.PickPrefill(request_), prefill(1));
  request_.excluded.push_back(prefill(1));
  EXPECT_EQ(policy_.PickPrefill(request_), nullptr);

  decode(0)->SetUpForTesting(false);
  decode(1)->SetUpForTesting(false);
  EXPECT_EQ(policy_.PickDecode(request_), decode(2));
  decode(2)->SetUpForTesting(false);
  EXPECT_EQ(policy_.PickDecode(request_), nullptr);
}

TEST_F(AssignmentPolicyTest, DecodeTiesGoToMostFreeKvBlocks) {
  decode(0)->SetStatsForTesting(Stats(10));
  decode(1)->SetStatsForTesting(Stats(50));
  decode(2)->SetStatsForTesting(Stats(30));
  for (int i = 0; i < 5; ++i) EXPECT_EQ(policy_.PickDecode(request_), decode(1));
  // In-flight count comes first.
  decode(1)->AddInFlight(1);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(policy_.PickDecode(request_), decode(2));
}

TEST_F(AssignmentPolicyTest, DecodeAvoidsWorkersWithoutRoomForThePrompt) {
  std::vector<int32_t> prompt(100, 1);  // 7 blocks of 16
  request_.prompt_token_ids = prompt;
  decode(0)->SetStatsForTesting(Stats(6));
  decode(1)->SetStatsForTesting(Stats(7));
  decode(2)->SetStatsForTesting(Stats(200));
  decode(1)->AddInFlight(3);
  decode(2)->AddInFlight(4);
  EXPECT_EQ(policy_.PickDecode(request_), decode(1));  // fits, fewer in flight than 2
  decode(1)->SetUpForTesting(false);
  EXPECT_EQ(policy_.PickDecode(request_), decode(2));
  decode(2)->SetUpForTesting(false);
  EXPECT_EQ(policy_.PickDecode(request_), decode(0));  // too small, but the only one: ReserveKv decides
}

TEST_F(AssignmentPolicyTest, LongPromptsGoToSequenceParallelPrefillWorkers) {
  v1::WorkerStats sp;
  sp.set_sp_ranks(4);
  sp.set_sp_min_tokens(1000);
  prefill(1)->SetStatsForTesting(sp);
  prefill(1)->AddInFlight(2);  // busier, still preferred for a long prompt
  std::vector<int32_t> long_prompt(1000, 1), short_prompt(999, 1);
  request_.prompt_token_ids = long_prompt;
  for (int i = 0; i < 4; ++i) EXPECT_EQ(policy_.PickPrefill(request_), prefill(1));
  request_.prompt_token_ids = short_prompt;
  for (int i = 0; i < 4; ++i) EXPECT_NE(policy_.PickPrefill(request_), prefill(1));
  // The group is down: long prompts take the other workers.
  prefill(1)->SetUpForTesting(false);
  request_.prompt_token_ids = long_prompt;
  EXPECT_NE(policy_.PickPrefill(request_), nullptr);
  EXPECT_NE(policy_.PickPrefill(request_), prefill(1));
}

TEST_F(AssignmentPolicyTest, FullTiesRotate) {
  std::set<Worker*> prefills, decodes;
  for (int i = 0; i < 3; ++i) {
    prefills.insert(policy_.PickPrefill(request_));
    decodes.insert(policy_.PickDecode(request_));
  }
  EXPECT_EQ(prefills.size(), 3u);
  EXPECT_EQ(decodes.size(), 3u);
}

}  // namespace
}  // namespace duet::router

#include "engine/scheduler/scheduler.h"

#include <memory>

#include "gtest/gtest.h"

namespace duet {
namespace {

class SchedulerTest : public ::testing::Test {
 protected:
  Request* NewRequest(int prompt_len, int max_tokens) {
    SamplingParams p;
    p.max_tokens = max_tokens;
    requests_.push_back(std::make_unique<Request>("r" + std::to_string(requests_.size()),
                                                  requests_.size() + 1, std::vector<int32_t>(prompt_len, 5), p));
    return requests_.back().get();
  }
  // Runs the plan as the engine would: advance computed tokens, "sample" a token for chunks
  // that reach the end, finish requests at max_tokens.
  void Execute(Scheduler& s, const SchedulerOutput& out) {
    s.OnStepDone(out);
    for (const ScheduledChunk& c : out.chunks) {
      if (!c.samples) continue;
      c.request->output.push_back(7);
      if (int(c.request->output.size()) >= c.request->params.max_tokens) s.Remove(c.request);
    }
  }
  std::vector<std::unique_ptr<Request>> requests_;
};

// Every step lists its decoding requests before its prompt chunks (the CUDA backend attends a
// step's leading one-token sequences with its decode kernel): prompts arriving while others decode,
// a long one chunked over several steps, requests finishing at different steps.
TEST_F(SchedulerTest, DecodingRequestsComeBeforePromptChunks) {
  BlockManager blocks(256, 4);
  Scheduler s({/*max_num_seqs=*/16, /*max_num_batched_tokens=*/24, /*max_model_len=*/128}, blocks);
  int steps_with_both = 0;
  for (int step = 0; step < 60; ++step) {
    if (step % 3 == 0 && step < 36) {
      ASSERT_TRUE(s.Add(NewRequest(step % 9 == 0 ? 50 : 7, 4 + step % 5)).ok());
    }
    SchedulerOutput o = s.Schedule();
    bool prompt_seen = false, decode_seen = false;
    for (const ScheduledChunk& c : o.chunks) {
      const bool decoding = c.num_new_tokens == 1 && c.request->num_computed_tokens + 1 == c.request->num_tokens() &&
                            !c.request->output.empty();
      if (decoding) {
        EXPECT_FALSE(prompt_seen) << "step " << step << ": a decoding request after a prompt chunk";
        decode_seen = true;
      } else {
        prompt_seen = true;
      }
    }
    steps_with_both += prompt_seen && decode_seen;
    Execute(s, o);
  }
  EXPECT_GT(steps_with_both, 5);
  EXPECT_FALSE(s.HasWork());
}

TEST_F(SchedulerTest, RequestsJoinAndLeaveAtEveryStep) {
  BlockManager blocks(64, 4);
  Scheduler s({/*max_num_seqs=*/8, /*max_num_batched_tokens=*/64, /*max_model_len=*/128}, blocks);
  Request* a = NewRequest(6, 2);
  ASSERT_TRUE(s.Add(a).ok());
  SchedulerOutput o = s.Schedule();
  ASSERT_EQ(o.chunks.size(), 1u);
  EXPECT_EQ(o.chunks[0].num_new_tokens, 6);
  EXPECT_TRUE(o.chunks[0].samples);
  Execute(s, o);

  Request* b = NewRequest(3, 3);  // joins while a decodes
  ASSERT_TRUE(s.Add(b).ok());
  o = s.Schedule();
  ASSERT_EQ(o.chunks.size(), 2u);
  EXPECT_EQ(o.chunks[0].request, a);
  EXPECT_EQ(o.chunks[0].num_new_tokens, 1);
  EXPECT_EQ(o.chunks[1].request, b);
  EXPECT_EQ(o.chunks[1].num_new_tokens, 3);
  Execute(s, o);  // a reaches max_tokens and leaves
  EXPECT_TRUE(a->finished());
  EXPECT_EQ(s.num_running(), 1u);
  o = s.Schedule();
  ASSERT_EQ(o.chunks.size(), 1u);
  EXPECT_EQ(o.chunks[0].request, b);
  Execute(s, o);
  Execute(s, s.Schedule());
  EXPECT_TRUE(b->finished());
  EXPECT_FALSE(s.HasWork());
  EXPECT_EQ(blocks.num_free_blocks(), 64);
}

TEST_F(SchedulerTest, MaxNumSeqsAndTokenBudgetBoundTheBatch) {
  BlockManager blocks(64, 4);
  Scheduler s({2, 10, 128}, blocks);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(s.Add(NewRequest(4, 4)).ok());
  SchedulerOutput o = s.Schedule();
  EXPECT_EQ(o.chunks.size(), 2u);  // max_num_seqs
  EXPECT_EQ(s.num_waiting(), 2u);

  // A long prompt is prefilled in chunks within the token budget.
  BlockManager blocks2(64, 4);
  Scheduler s2({8, 10, 128}, blocks2);
  Request* r = NewRequest(25, 1);
  ASSERT_TRUE(s2.Add(r).ok());
  std::vector<int64_t> chunk_sizes;
  while (s2.HasWork()) {
    SchedulerOutput step = s2.Schedule();
    ASSERT_EQ(step.chunks.size(), 1u);
    chunk_sizes.push_back(step.chunks[0].num_new_tokens);
    EXPECT_EQ(step.chunks[0].samples, r->num_computed_tokens + step.chunks[0].num_new_tokens == 25);
    Execute(s2, step);
  }
  EXPECT_EQ(chunk_sizes, (std::vector<int64_t>{10, 10, 5}));
}

// max_num_mixed_tokens bounds the steps in which a request decodes; a step with nothing decoding
// takes max_num_batched_tokens, so an idle server's prompt is not chunked.
TEST_F(SchedulerTest, MixedStepsTakeTheMixedBudget) {
  BlockManager blocks(64, 4);
  Scheduler s({/*max_num_seqs=*/8, /*max_num_batched_tokens=*/32, /*max_model_len=*/128,
               /*max_num_mixed_tokens=*/12},
              blocks);
  Request* a = NewRequest(30, 20);
  ASSERT_TRUE(s.Add(a).ok());
  SchedulerOutput o = s.Schedule();
  ASSERT_EQ(o.chunks.size(), 1u);
  EXPECT_EQ(o.chunks[0].num_new_tokens, 30);  // nothing decodes: the whole prompt in one step
  Execute(s, o);

  Request* b = NewRequest(30, 2);  // arrives while a decodes
  ASSERT_TRUE(s.Add(b).ok());
  std::vector<int64_t> b_chunks;
  while (!b->finished()) {
    o = s.Schedule();
    int64_t tokens = 0;
    for (const ScheduledChunk& c : o.chunks) {
      tokens += c.num_new_tokens;
      if (c.request == b && b->output.empty()) b_chunks.push_back(c.num_new_tokens);
    }
    EXPECT_LE(tokens, 12);
    Execute(s, o);
  }
  EXPECT_EQ(b_chunks, (std::vector<int64_t>{11, 11, 8}));  // beside a's one decode token a step

  // More decoding requests than the mixed budget: each still gets its token, no prompt joins.
  BlockManager blocks3(64, 4);
  Scheduler s3({8, 32, 128, 3}, blocks3);
  std::vector<Request*> decoding;
  for (int i = 0; i < 5; ++i) {
    decoding.push_back(NewRequest(2, 20));
    ASSERT_TRUE(s3.Add(decoding.back()).ok());
  }
  Execute(s3, s3.Schedule());  // five prompts of 2 tokens in one step: nothing decodes yet
  ASSERT_TRUE(s3.Add(NewRequest(10, 1)).ok());
  o = s3.Schedule();
  ASSERT_EQ(o.chunks.size(), 5u);
  for (const ScheduledChunk& chunk : o.chunks) EXPECT_EQ(chunk.num_new_tokens, 1);

  // A budget at or above max_num_batched_tokens changes nothing.
  BlockManager blocks2(64, 4);
  Scheduler s2({8, 32, 128, 64}, blocks2);
  Request* c = NewRequest(5, 20);
  ASSERT_TRUE(s2.Add(c).ok());
  Execute(s2, s2.Schedule());
  ASSERT_TRUE(s2.Add(NewRequest(40, 1)).ok());
  o = s2.Schedule();
  ASSERT_EQ(o.chunks.size(), 2u);
  EXPECT_EQ(o.chunks[1].num_new_tokens, 31);
}

TEST_F(SchedulerTest, RejectsRequestsThatCanNeverFit) {
  BlockManager blocks(4, 4);  // 16 tokens in all
  Scheduler s({8, 64, 100}, blocks);
  absl::Status too_long = s.Add(NewRequest(90, 20));
  EXPECT_EQ(too_long.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_long.message().find("maximum context length"), std::string::npos);
  absl::Status too_big = s.Add(NewRequest(10, 10));
  EXPECT_EQ(too_big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_big.message().find("KV-cache blocks"), std::string::npos);
  EXPECT_EQ(s.Add(NewRequest(0, 1)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(s.Add(NewRequest(8, 8)).ok());
}

TEST_F(SchedulerTest, PreemptsYoungestWhenBlocksRunOutAndRecomputes) {
  BlockManager blocks(4, 4);
  Scheduler s({8, 64, 64}, blocks);
  Request* old_req = NewRequest(4, 8);    // will need 3 blocks at the end
  Request* young_req = NewRequest(4, 8);
  ASSERT_TRUE(s.Add(old_req).ok());
  ASSERT_TRUE(s.Add(young_req).ok());
  int preemptions = 0;
  int steps = 0;
  while (s.HasWork() && steps < 100) {
    SchedulerOutput o = s.Schedule();
    preemptions += o.num_preempted;
    Execute(s, o);
    ++steps;
    EXPECT_LE(blocks.num_used_blocks(), 4);
  }
  EXPECT_TRUE(old_req->finished());
  EXPECT_TRUE(young_req->finished());
  EXPECT_GE(preemptions, 1);
  EXPECT_EQ(old_req->num_preemptions, 0);  // the oldest keeps its place
  EXPECT_GE(young_req->num_preemptions, 1);
  EXPECT_EQ(young_req->output.size(), 8u);
  EXPECT_EQ(blocks.num_free_blocks(), 4);
}

TEST_F(SchedulerTest, RemoveWhileWaitingOrRunningFreesBlocks) {
  BlockManager blocks(16, 4);
  Scheduler s({8, 64, 64}, blocks);
  Request* a = NewRequest(8, 4);
  Request* b = NewRequest(8, 4);
  ASSERT_TRUE(s.Add(a).ok());
  Execute(s, s.Schedule());
  ASSERT_TRUE(s.Add(b).ok());
  s.Remove(b);  // still waiting
  s.Remove(a);  // running
  EXPECT_FALSE(s.HasWork());
  EXPECT_EQ(blocks.num_free_blocks(), 16);
}

// Async scheduling: a request whose pending token (sampled by a launched step, not yet seen)
// reaches max_tokens is not scheduled again, and its seat in the batch goes to a waiting request
// at once; its blocks stay until the engine removes it.
TEST_F(SchedulerTest, ARequestEndingWithItsPendingTokenGivesUpItsSeat) {
  BlockManager blocks(64, 4);
  Scheduler s({/*max_num_seqs=*/1, /*max_num_batched_tokens=*/64, /*max_model_len=*/128}, blocks);
  Request* ending = NewRequest(8, 3);
  Request* next = NewRequest(8, 3);
  ASSERT_TRUE(s.Add(ending).ok());
  ASSERT_TRUE(s.Add(next).ok());
  SchedulerOutput prompt = s.Schedule();
  ASSERT_EQ(prompt.chunks.size(), 1u);
  s.OnStepDone(prompt);
  ending->output = {7};
  ending->pending_rows = {0};  // its second token: launched, not yet known
  SchedulerOutput second = s.Schedule();
  ASSERT_EQ(second.chunks.size(), 1u);
  EXPECT_EQ(second.chunks[0].request, ending);  // the pending token is computed: it decodes
  s.OnStepDone(second);
  ending->pending_rows = {0, 0};  // the third, its last, launched too
  const int32_t free_before = blocks.num_free_blocks();
  SchedulerOutput third = s.Schedule();
  ASSERT_EQ(third.chunks.size(), 1u);
  EXPECT_EQ(third.chunks[0].request, next);  // the seat went to the waiting request
  EXPECT_EQ(ending->state, RequestState::kRunning);  // still holding its blocks
  EXPECT_LT(blocks.num_free_blocks(), free_before);  // the newcomer's blocks came from the free ones
}

}  // namespace
}  // namespace duet

// Continuous batching at iteration level: every step, running requests keep their place,
// finished ones leave, waiting ones join while KV blocks, the batch-size limit and the token
// budget allow. Two phases, as in TensorRT-LLM:
//   capacity: every running request gets KV room for its next tokens; when blocks run out the
//             most recently admitted running request is preempted (blocks freed, recomputed
//             later from its prompt and output so far);
//   micro-batch: waiting requests are admitted oldest first within max_num_seqs and the token
//             budget; a long prompt is split into chunks across steps (chunked prefill). With
//             prefix caching, an admitted request starts with the cached blocks of its tokens
//             and computes only the rest.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "engine/kv/block_manager.h"
#include "engine/request.h"

namespace duet {

struct SchedulerConfig {
  int32_t max_num_seqs = 256;             // requests in the running batch
  int32_t max_num_batched_tokens = 2048;  // tokens processed per step
  int64_t max_model_len = 4096;           // prompt + output limit per request
  // Tokens of a step in which running requests decode (their tokens and the prompt chunks beside
  // them), when below max_num_batched_tokens; 0: max_num_batched_tokens. Never fewer than the
  // decoding requests: each keeps its one token a step. A small mixed step keeps
  // the decoding requests' inter-token latency short and spreads prompts evenly over the steps,
  // while a step with nothing decoding (an idle server's prompt) still takes a whole prompt.
  int32_t max_num_mixed_tokens = 0;
};

struct ScheduledChunk {
  Request* request = nullptr;
  int64_t num_new_tokens = 0;  // tokens [num_computed_tokens, + num_new_tokens) run this step
  bool samples = false;        // the chunk reaches the end of the request's tokens
  // Draft tokens this decode chunk verifies (request->spec.lookahead_slots that got KV room;
  // they sit in slots after the chunk's token and count against the token budget).
  int32_t num_draft_slots = 0;
};

struct SchedulerOutput {
  std::vector<ScheduledChunk> chunks;
  std::vector<BlockCopy> block_copies;  // copy-on-write, before the step runs
  int32_t num_preempted = 0;
  bool empty() const { return chunks.empty(); }
};

class Scheduler {
 public:
  Scheduler(const SchedulerConfig& config, BlockManager& blocks);

  // Queues a request. InvalidArgument if it can never run: prompt + max_tokens beyond
  // max_model_len, or more KV blocks than the whole cache holds.
  absl::Status Add(Request* request);
  SchedulerOutput Schedule();
  // Called after the step: advances num_computed_tokens of every scheduled chunk (by its
  // num_new_tokens; the engine adds accepted draft tokens itself).
  void OnStepDone(const SchedulerOutput& output);
  // Removes a request (finished or aborted) and frees its blocks.
  void Remove(Request* request);
  // Takes a running request out of the batch (or a waiting one that joined with its KV out of the
  // queue) and leaves its blocks allocated (live KV migration: their owner frees them).
  void Detach(Request* request);

  // Whether a running or waiting request satisfies `predicate`.
  bool AnyUnfinished(const std::function<bool(const Request&)>& predicate) const;

  // Registers the full blocks the step computed in the prefix cache (after a successful step).
  void CommitComputedBlocks(const SchedulerOutput& output);

  bool HasWork() const { return !running_.empty() || !waiting_.empty(); }
  // Prefix caching: tokens of admitted requests looked up, and those found cached (vLLM's
  // prefix_cache_queries / hits).
  int64_t num_prefix_queries() const { return num_prefix_queries_; }
  int64_t num_prefix_hits() const { return num_prefix_hits_; }
  // Counts a lookup made outside admission (a decode worker's reservation).
  void RecordPrefixLookup(int64_t tokens, int64_t hits) {
    num_prefix_queries_ += tokens;
    num_prefix_hits_ += hits;
  }
  size_t num_running() const { return running_.size(); }
  // The running requests, in admission order.
  const std::vector<Request*>& running() const { return running_; }
  size_t num_waiting() const { return waiting_.size(); }
  const SchedulerConfig& config() const { return config_; }

 private:
  void Preempt(Request* request);
  // The step's token budget: max_num_mixed_tokens (or the number of decoding requests, if more)
  // when a running request decodes, else max_num_batched_tokens.
  int64_t StepTokenBudget() const;
  // Gives a request that holds no blocks the cached blocks its tokens begin with.
  void AttachCachedPrefix(Request* request);
  // A request whose pending token (async scheduling) ends it by length: nothing of it to run.
  bool EndsWithPendingToken(const Request& request) const;

  SchedulerConfig config_;
  BlockManager& blocks_;
  std::vector<Request*> running_;  // admission order
  std::deque<Request*> waiting_;   // preempted requests go to the front
  int64_t num_prefix_queries_ = 0;
  int64_t num_prefix_hits_ = 0;
};

}  // namespace duet

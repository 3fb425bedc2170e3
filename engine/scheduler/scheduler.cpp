#include "engine/scheduler/scheduler.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/check.h"

namespace duet {

Scheduler::Scheduler(const SchedulerConfig& config, BlockManager& blocks)
    : config_(config), blocks_(blocks) {
  DUET_CHECK(config.max_num_seqs > 0 && config.max_num_batched_tokens > 0 && config.max_num_mixed_tokens >= 0);
}

int64_t Scheduler::StepTokenBudget() const {
  const int64_t full = config_.max_num_batched_tokens, mixed = config_.max_num_mixed_tokens;
  if (mixed <= 0 || mixed >= full) return full;
  const int64_t decoding =
      std::count_if(running_.begin(), running_.end(), [](const Request* r) { return r->decoding(); });
  // Every decoding request keeps its token, however many there are.
  return decoding == 0 ? full : std::min(full, std::max(mixed, decoding));
}

absl::Status Scheduler::Add(Request* request) {
  const int64_t prompt_len = int64_t(request->prompt.size());
  if (prompt_len == 0) return absl::InvalidArgumentError("the prompt is empty");
  const int64_t total = prompt_len + request->params.max_tokens;
  if (total > config_.max_model_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "this model's maximum context length is ", config_.max_model_len, " tokens; the request has ",
        prompt_len, " prompt tokens and max_tokens ", request->params.max_tokens, " (", total,
        " in all)"));
  }
  const int32_t blocks_needed = blocks_.BlocksForTokens(total);
  if (blocks_needed > blocks_.num_blocks()) {
    return absl::InvalidArgumentError(absl::StrCat("the request needs ", blocks_needed,
                                                   " KV-cache blocks and the cache has only ",
                                                   blocks_.num_blocks()));
  }
  request->state = RequestState::kWaiting;
  waiting_.push_back(request);
  return absl::OkStatus();
}

void Scheduler::Preempt(Request* request) {
  blocks_.Free(request->seq_id);
  request->num_computed_tokens = 0;
  request->state = RequestState::kWaiting;
  ++request->num_preemptions;
  waiting_.push_front(request);
}

SchedulerOutput Scheduler::Schedule() {
  SchedulerOutput out;
  int64_t token_budget = StepTokenBudget();

  // Capacity phase: running requests, oldest first; the youngest are preempted to make room.
  std::vector<Request*> kept;
  kept.reserve(running_.size());
  int32_t num_ending = 0;  // running requests whose pending token is their last: their seats are free
  for (size_t i = 0; i < running_.size(); ++i) {
    Request* r = running_[i];
    // No room this step, or nothing to compute: its pending token (async scheduling) is its last.
    const bool ending = EndsWithPendingToken(*r);
    num_ending += ending ? 1 : 0;
    if (token_budget == 0 || ending) {  // stays running with its blocks
      kept.push_back(r);
      continue;
    }
    const int64_t remaining = r->num_tokens() - r->num_computed_tokens;
    const int64_t n = std::min(remaining, token_budget);
    // A decoding request's draft slots come only from spare blocks and budget: speculation
    // never preempts anyone.
    int32_t draft_slots = 0;
    if (remaining == 1 && r->spec.lookahead_slots > 0) {
      draft_slots = int32_t(std::min<int64_t>(r->spec.lookahead_slots, token_budget - n));
      if (draft_slots > 0 && !blocks_.Reserve(r->seq_id, r->num_computed_tokens + n + draft_slots,
                                              r->num_computed_tokens, &out.block_copies).ok()) {
        draft_slots = 0;
      }
    }
    r->spec.lookahead_slots = draft_slots;
    bool placed = false;
    while (!placed) {
      absl::Status s = blocks_.Reserve(r->seq_id, r->num_computed_tokens + n, r->num_computed_tokens,
                                       &out.block_copies);
      if (s.ok()) {
        placed = true;
      } else if (running_.size() > i + 1) {
        Request* victim = running_.back();  // youngest not yet considered
        running_.pop_back();
        Preempt(victim);
        ++out.num_preempted;
      } else {
        break;
      }
    }
    if (!placed) {  // nothing younger to evict: this request yields its own blocks
      Preempt(r);
      ++out.num_preempted;
      continue;
    }
    kept.push_back(r);
    out.chunks.push_back({r, n, r->num_computed_tokens + n == r->num_tokens(), draft_slots});
    token_budget -= n + draft_slots;
  }
  running_ = std::move(kept);

  // Micro-batch phase: admit waiting requests oldest first, but not right after preempting
  // (the freed blocks belong to the requests that stayed).
  while (out.num_preempted == 0 && !waiting_.empty() && token_budget > 0 &&
         int32_t(running_.size()) - num_ending < config_.max_num_seqs) {
    Request* r = waiting_.front();
    const bool attached = blocks_.prefix_caching() && !blocks_.HasSequence(r->seq_id);
    if (attached) AttachCachedPrefix(r);
    const int64_t remaining = r->num_tokens() - r->num_computed_tokens;
    const int64_t n = std::min(remaining, token_budget);
    if (!blocks_.Reserve(r->seq_id, r->num_computed_tokens + n, r->num_computed_tokens,
                         &out.block_copies).ok()) {
      if (attached) {  // it waits without them; they stay cached
        blocks_.Free(r->seq_id);
        r->num_computed_tokens = 0;
      }
      break;  // first come, first served: no overtaking by smaller requests
    }
    if (attached) {
      num_prefix_queries_ += r->num_tokens();
      num_prefix_hits_ += r->num_computed_tokens;
      if (r->first_scheduled_time == Clock::time_point{}) r->num_cached_tokens = r->num_computed_tokens;
    }
    waiting_.pop_front();
    r->spec.lookahead_slots = 0;
    r->state = RequestState::kRunning;
    if (r->first_scheduled_time == Clock::time_point{}) r->first_scheduled_time = Clock::now();
    running_.push_back(r);
    out.chunks.push_back({r, n, r->num_computed_tokens + n == r->num_tokens()});
    token_budget -= n;
  }
  return out;
}

bool Scheduler::EndsWithPendingToken(const Request& r) const {
  return !r.pending_rows.empty() && (int64_t(r.output.size() + r.pending_rows.size()) >= r.params.max_tokens ||
                                     r.num_tokens() >= config_.max_model_len);
}

bool Scheduler::AnyUnfinished(const std::function<bool(const Request&)>& predicate) const {
  return std::any_of(running_.begin(), running_.end(), [&](const Request* r) { return predicate(*r); }) ||
         std::any_of(waiting_.begin(), waiting_.end(), [&](const Request* r) { return predicate(*r); });
}

void Scheduler::AttachCachedPrefix(Request* r) {
  // At most all but the last token: the step that computes it produces the logits to sample.
  int32_t max_blocks = int32_t((r->num_tokens() - 1) / blocks_.block_size());
  // Prompt logprobs need the logits of every prompt position not scored yet: a cached block has
  // none, so those positions are computed again (as vLLM does).
  if (r->params.prompt_logprobs >= 0) {
    max_blocks = std::min(max_blocks, int32_t(int64_t(r->prompt_logprobs.size()) / blocks_.block_size()));
  }
  if (r->output.empty()) {
    r->num_computed_tokens = blocks_.AttachCachedPrefix(r->seq_id, r->prefix_seed, r->prompt, max_blocks);
    return;
  }
  std::vector<int32_t> tokens(r->prompt);  // a preempted request: prompt and output so far
  tokens.insert(tokens.end(), r->output.begin(), r->output.end());
  r->num_computed_tokens = blocks_.AttachCachedPrefix(r->seq_id, r->prefix_seed, tokens, max_blocks);
}

void Scheduler::CommitComputedBlocks(const SchedulerOutput& output) {
  if (!blocks_.prefix_caching()) return;
  for (const ScheduledChunk& c : output.chunks) {
    const Request* r = c.request;
    if (r->finished()) continue;
    // Not the tokens of a step launched since (async scheduling): their K/V are not written yet.
    blocks_.CommitFullBlocks(r->seq_id, r->prefix_seed, r->num_computed_tokens - r->num_launched_tokens,
                             [r](int64_t i) { return r->TokenAt(i); });
  }
}

void Scheduler::OnStepDone(const SchedulerOutput& output) {
  for (const ScheduledChunk& c : output.chunks) c.request->num_computed_tokens += c.num_new_tokens;
}

void Scheduler::Remove(Request* request) {
  blocks_.Free(request->seq_id);
  running_.erase(std::remove(running_.begin(), running_.end(), request), running_.end());
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), request), waiting_.end());
  request->state = RequestState::kFinished;
}

void Scheduler::Detach(Request* request) {
  running_.erase(std::remove(running_.begin(), running_.end(), request), running_.end());
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), request), waiting_.end());
  request->state = RequestState::kFinished;
}

}  // namespace duet

// A generation request as the engine tracks it, from arrival to finish.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "common/finish_reason.h"
#include "engine/grammar/matcher.h"
#include "engine/kv/block_hash.h"
#include "engine/kv/block_manager.h"
#include "engine/sampler.h"
#include "engine/sampling_params.h"
#include "engine/speculation/lookahead_cache.h"
#include "frontend/tokenizer/tokenizer.h"

namespace duet {

enum class RequestState {
  kWaiting,   // queued, holds no KV blocks (new, or preempted and waiting to recompute)
  kRunning,   // in the batch, holds KV blocks
  kFinished,  // done; blocks released
};

using Clock = std::chrono::steady_clock;

// A request's speculative-decoding state (see spec_decode.h).
struct SpeculationState {
  SpeculationMode mode = SpeculationMode::kNone;  // resolved from params and server default
  DraftTree tree;                 // this step's draft (lookahead: proposed before planning)
  int32_t lookahead_slots = 0;    // draft tokens the scheduler reserves KV room for this step
  // Decayed counts behind the acceptance estimate: accepted draft tokens, and those plus misses.
  double accepted = 0.0;
  double trials = 0.0;
  // `prior`: the engine's recent acceptance for this mode (optimistic while it has none), worth
  // one trial, so a few verified drafts of the request's own outweigh it.
  double acceptance(double prior) const { return (accepted + prior) / (trials + 1.0); }
};

struct Request {
  Request(std::string id, SequenceId seq_id, std::vector<int32_t> prompt, SamplingParams params)
      : id(std::move(id)), seq_id(seq_id), prompt(std::move(prompt)), params(std::move(params)),
        rng(this->params.seed) {}

  std::string id;
  SequenceId seq_id;
  std::vector<int32_t> prompt;
  std::vector<int32_t> output;
  SamplingParams params;
  SamplerRng rng;

  RequestState state = RequestState::kWaiting;
  FinishReason finish_reason = FinishReason::kNone;
  int64_t num_computed_tokens = 0;  // tokens whose K/V are in the cache
  // Prefix caching: the chain seed of its blocks (the cache salt's), and the prompt tokens its
  // first admission found cached.
  BlockHash prefix_seed = 0;
  int64_t num_cached_tokens = 0;
  int32_t num_preemptions = 0;
  // Disaggregated prefill (LlmEngine::KeepKvWhenFinished): a request that finishes with a token
  // leaves its blocks in `kept_kv`, a sequence of their own, until LlmEngine::ReleaseKv.
  bool keep_kv_when_finished = false;
  std::optional<SequenceId> kept_kv;

  // Detokenized output so far (stop strings are checked against it).
  std::unique_ptr<StreamingDecoder> decoder;
  std::string text;
  size_t num_emitted_text = 0;  // bytes of `text` already streamed out
  std::vector<float> output_logprobs;
  std::vector<std::vector<TokenLogprob>> output_top_logprobs;
  // With params.prompt_logprobs >= 0: entry i scores prompt[i + 1] (from position i's logits),
  // appended as the prompt's chunks run; complete (prompt.size() - 1 entries) by the first token.
  std::vector<ScoredToken> prompt_logprobs;
  SpeculationState spec;
  // With params.structured_output: the grammar's state after `output`, and its token mask.
  std::unique_ptr<grammar::GrammarMatcher> grammar;
  std::vector<uint32_t> token_mask;

  // Async scheduling (LlmEngine: a step launched before the previous one's tokens reach the
  // host). `pending_rows`: the request's tokens that launched steps have sampled and the host has
  // not seen yet, oldest first, each as its logits row in its step (at most one a step, two steps
  // launched); counted in num_tokens(), their ids unknown. `num_launched_tokens`: its tokens in
  // launched steps not yet collected; while any are, its blocks stay allocated.
  absl::InlinedVector<int32_t, 2> pending_rows;
  int64_t num_launched_tokens = 0;

  Clock::time_point arrival_time = Clock::now();
  Clock::time_point first_scheduled_time{};
  Clock::time_point first_token_time{};
  Clock::time_point finish_time{};

  // Prompt and output tokens, with the pending ones; TokenAt knows all but the pending.
  int64_t num_tokens() const { return num_known_tokens() + int64_t(pending_rows.size()); }
  int64_t num_known_tokens() const { return int64_t(prompt.size() + output.size()); }
  int32_t TokenAt(int64_t i) const {
    return i < int64_t(prompt.size()) ? prompt[size_t(i)] : output[size_t(i - int64_t(prompt.size()))];
  }
  bool finished() const { return state == RequestState::kFinished; }
  // Its next step computes one token after sampled ones: it decodes (not a prompt chunk).
  bool decoding() const {
    return (!output.empty() || !pending_rows.empty()) && num_tokens() - num_computed_tokens == 1;
  }
};

}  // namespace duet

// Model-based drafting: a chain of guessed tokens by greedy decoding with a cheaper model.
//   separate draft model  a small model with the target's tokenizer (e.g. tiny-code-llama-draft
//                         for tiny-code-llama) and its own executor, block manager and paged
//                         KV cache, kept in step with each request's tokens;
//   self-speculation      the target's first k layers plus its final norm and LM head. Their K/V
//                         for the context are exactly the target's, so the drafter reads the
//                         target's cache and writes only the slots the verification overwrites.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/grammar/matcher.h"
#include "engine/kv/block_manager.h"
#include "engine/kv/kv_cache.h"
#include "engine/model_executor.h"
#include "frontend/tokenizer/tokenizer.h"

namespace duet {

class ModelDrafter {
 public:
  // Loads a model directory on the target's backend.
  using ExecutorLoader = std::function<absl::StatusOr<std::unique_ptr<ModelExecutor>>(const std::string& model_dir)>;
  // Loads the draft model in `model_dir` with `load`. FailedPrecondition when its tokenizer or
  // vocabulary differs from the target's (drafts would be other tokens). Its KV cache holds
  // `num_blocks` blocks of `block_size` tokens.
  static absl::StatusOr<std::unique_ptr<ModelDrafter>> LoadDraftModel(const std::string& model_dir,
                                                                      const ExecutorLoader& load,
                                                                      const ModelConfig& target_config,
                                                                      const Tokenizer& target_tokenizer,
                                                                      int32_t num_blocks, int32_t block_size);
  // The first `num_layers` layers of `target` (which must outlive the drafter).
  static absl::StatusOr<std::unique_ptr<ModelDrafter>> SelfSpeculation(ModelExecutor& target, int64_t num_layers);

  // One request's drafting for this step.
  struct Job {
    SequenceId seq = 0;
    // All of the request's tokens; the target has the K/V of all but the last.
    absl::Span<const int32_t> tokens;
    // The target's block table, with room for tokens.size() + num_draft - 1 slots.
    absl::Span<const int32_t> target_block_table;
    int32_t num_draft = 0;
    // A constrained request's grammar state (a fork of its matcher, advanced here over the
    // draft) and whether EOS is masked: each draft token is then the drafter's best token the
    // grammar allows (where its logits reach the host; from the device, a token the grammar
    // rejects ends the draft), and the draft stops where the output would end.
    std::optional<grammar::GrammarMatcher> grammar;
    bool ignore_eos = false;
    std::vector<int32_t> draft;  // out: up to num_draft tokens (fewer if the drafter ran out of room)
  };
  // Drafts for every job, batched: round r runs one forward over all jobs that want more than r
  // tokens. `target_cache` is the target's (self-speculation writes its draft slots there).
  // `on_forward` (optional) hears each round's token count and seconds.
  using ForwardObserver = std::function<void(int64_t num_tokens, double seconds)>;
  absl::Status Propose(absl::Span<Job> jobs, KvCache& target_cache, const ForwardObserver& on_forward = nullptr);
  // Forgets a sequence (finished or aborted); its draft-cache blocks are freed.
  void Release(SequenceId seq);

  bool self_speculation() const { return own_cache_ == nullptr; }
  ModelExecutor& executor() { return *executor_; }
  // The draft model's own block manager and cache (null for self-speculation).
  BlockManager* own_blocks() { return blocks_.get(); }
  KvCache* own_cache() { return own_cache_.get(); }

 private:
  // A job still drafting: `feed` runs next at positions [start, start + feed.size()).
  struct ActiveJob {
    Job* job;
    int64_t start;
    std::vector<int32_t> feed;
    absl::Span<const int32_t> block_table;
  };

  ModelDrafter(std::unique_ptr<ModelExecutor> executor, std::unique_ptr<BlockManager> blocks,
               std::unique_ptr<KvCache> cache);
  // The job's first feed: its last token, or for a draft model of its own everything its cache
  // lacks (nullopt when that cache has no room: the job goes without drafts).
  std::optional<ActiveJob> Start(Job& job);
  // One forward over the active jobs; each gets its next draft token, and those that want
  // more stay active.
  absl::Status DraftRound(std::vector<ActiveJob>& active, KvCache& cache, const ForwardObserver& on_forward);
  // The job's next draft token: the argmax of its logits row (on the host: of the tokens the
  // grammar allows) or its device sample; the job's grammar advances over it. nullopt when the
  // grammar allows none (or rejects the device sample); `ends_output`: nothing can follow it
  // (EOS, or a grammar that allows nothing more).
  struct DraftToken {
    int32_t token;
    bool ends_output;
  };
  std::optional<DraftToken> NextDraftToken(Job& job, size_t row, bool on_device);

  std::unique_ptr<ModelExecutor> executor_;
  // Separate draft model only: its paged cache and, per sequence, the tokens whose K/V it holds.
  std::unique_ptr<BlockManager> blocks_;
  std::unique_ptr<KvCache> own_cache_;
  std::unordered_map<SequenceId, std::vector<int32_t>> cached_tokens_;
  std::vector<float> logits_;
  std::vector<DeviceSamplingRow> greedy_rows_;
  std::vector<DeviceSample> samples_;
  std::vector<uint32_t> token_mask_;
};

}  // namespace duet

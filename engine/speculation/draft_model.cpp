#include "engine/speculation/draft_model.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/status_macros.h"
#include "engine/sampler.h"

namespace duet {
namespace {

// Drafts are token ids the target verifies, so both models must give every id the same piece.
absl::Status CheckSameVocabulary(const std::string& draft_dir, const ModelConfig& draft_config,
                                 const ModelConfig& target_config, const Tokenizer& draft_tokenizer,
                                 const Tokenizer& target_tokenizer) {
  auto mismatch = [&](const std::string& what) {
    return absl::FailedPreconditionError(absl::StrCat("draft model ", draft_dir,
                                                      " cannot draft for this model: ", what));
  };
  if (draft_config.vocab_size != target_config.vocab_size) {
    return mismatch(absl::StrCat("vocab_size ", draft_config.vocab_size, " vs ", target_config.vocab_size));
  }
  if (draft_tokenizer.vocab_size() != target_tokenizer.vocab_size()) {
    return mismatch(absl::StrCat("tokenizer vocabulary of ", draft_tokenizer.vocab_size(), " vs ",
                                 target_tokenizer.vocab_size(), " tokens"));
  }
  for (int32_t id = 0; id < target_tokenizer.vocab_size(); ++id) {
    if (draft_tokenizer.IdToToken(id) != target_tokenizer.IdToToken(id)) {
      return mismatch(absl::StrCat("the tokenizers differ at token id ", id));
    }
  }
  return absl::OkStatus();
}

}  // namespace

ModelDrafter::ModelDrafter(std::unique_ptr<ModelExecutor> executor, std::unique_ptr<BlockManager> blocks,
                           std::unique_ptr<KvCache> cache)
    : executor_(std::move(executor)), blocks_(std::move(blocks)), own_cache_(std::move(cache)) {}

absl::StatusOr<std::unique_ptr<ModelDrafter>> ModelDrafter::LoadDraftModel(const std::string& model_dir,
                                                                           const ExecutorLoader& load,
                                                                           const ModelConfig& target_config,
                                                                           const Tokenizer& target_tokenizer,
                                                                           int32_t num_blocks, int32_t block_size) {
  absl::StatusOr<std::unique_ptr<ModelExecutor>> model = load(model_dir);
  if (!model.ok()) return model.status();
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromModelDir(model_dir);
  if (!tokenizer.ok()) return tokenizer.status();
  if (absl::Status s = CheckSameVocabulary(model_dir, (*model)->config(), target_config, **tokenizer,
                                           target_tokenizer);
      !s.ok()) {
    return s;
  }
  auto blocks = std::make_unique<BlockManager>(num_blocks, block_size);
  absl::StatusOr<std::unique_ptr<KvCache>> cache = (*model)->CreateKvCache(num_blocks, block_size);
  if (!cache.ok()) return cache.status();
  return std::unique_ptr<ModelDrafter>(new ModelDrafter(std::move(*model), std::move(blocks), std::move(*cache)));
}

absl::StatusOr<std::unique_ptr<ModelDrafter>> ModelDrafter::SelfSpeculation(ModelExecutor& target,
                                                                            int64_t num_layers) {
  absl::StatusOr<std::unique_ptr<ModelExecutor>> prefix = target.LayerPrefix(num_layers);
  if (!prefix.ok()) return prefix.status();
  return std::unique_ptr<ModelDrafter>(new ModelDrafter(std::move(*prefix), nullptr, nullptr));
}

void ModelDrafter::Release(SequenceId seq) {
  if (self_speculation()) return;
  blocks_->Free(seq);
  cached_tokens_.erase(seq);
}

absl::Status ModelDrafter::Propose(absl::Span<Job> jobs, KvCache& target_cache, const ForwardObserver& on_forward) {
  KvCache& cache = self_speculation() ? target_cache : *own_cache_;
  std::vector<ActiveJob> active;
  for (Job& job : jobs) {
    job.draft.clear();
    if (job.num_draft <= 0 || job.tokens.empty()) continue;
    if (std::optional<ActiveJob> a = Start(job)) active.push_back(*std::move(a));
  }
  while (!active.empty()) DUET_RETURN_IF_ERROR(DraftRound(active, cache, on_forward));
  return absl::OkStatus();
}

std::optional<ModelDrafter::ActiveJob> ModelDrafter::Start(Job& job) {
  const int64_t n = int64_t(job.tokens.size());
  ActiveJob a{&job, n - 1, {}, job.target_block_table};
  if (!self_speculation()) {
    // Catch up from the longest prefix whose K/V the draft cache already holds (the prompt
    // the first time; afterwards the tokens accepted since the last step).
    std::vector<int32_t>& cached = cached_tokens_[job.seq];
    const size_t limit = std::min(cached.size(), size_t(n - 1));
    const size_t common = size_t(std::mismatch(cached.begin(), cached.begin() + limit, job.tokens.begin()).first -
                                 cached.begin());
    cached.resize(common);
    // Room for the tokens plus every draft but the last (which is never fed back).
    if (!blocks_->Reserve(job.seq, n + job.num_draft - 1, int64_t(common), nullptr).ok()) {
      Release(job.seq);  // no room in the draft cache: this request goes without drafts
      return std::nullopt;
    }
    a.start = int64_t(common);
    a.block_table = blocks_->BlockTable(job.seq);
  }
  a.feed.assign(job.tokens.begin() + a.start, job.tokens.end());
  return a;
}

absl::Status ModelDrafter::DraftRound(std::vector<ActiveJob>& active, KvCache& cache,
                                      const ForwardObserver& on_forward) {
  std::vector<SequenceChunk> chunks;
  int64_t num_tokens = 0;
  for (const ActiveJob& a : active) {
    chunks.push_back(SequenceChunk{a.feed, a.start, a.block_table, a.job->seq, 1});
    num_tokens += int64_t(a.feed.size());
  }
  const auto start = std::chrono::steady_clock::now();
  const int64_t setups_before = executor_->num_one_time_setups();
  // Greedy drafts: argmax on the device where the executor samples there (only ids cross).
  const bool on_device = executor_->CanSampleOnDevice();
  if (on_device) {
    greedy_rows_.assign(chunks.size(), DeviceSamplingRow{});
    DUET_RETURN_IF_ERROR(executor_->ForwardSample(chunks, cache, greedy_rows_, samples_));
  } else {
    DUET_RETURN_IF_ERROR(executor_->Forward(chunks, cache, logits_));
  }
  if (on_forward && executor_->num_one_time_setups() == setups_before) {  // not a graph capture's round
    on_forward(num_tokens, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::vector<ActiveJob> still;
  for (size_t i = 0; i < active.size(); ++i) {
    ActiveJob& a = active[i];
    if (!self_speculation()) {
      std::vector<int32_t>& cached = cached_tokens_[a.job->seq];
      cached.insert(cached.end(), a.feed.begin(), a.feed.end());
    }
    const std::optional<DraftToken> next = NextDraftToken(*a.job, i, on_device);
    if (!next) continue;  // the grammar allows none: the draft ends here
    a.job->draft.push_back(next->token);
    if (!next->ends_output && int32_t(a.job->draft.size()) < a.job->num_draft) {
      a.start += int64_t(a.feed.size());
      a.feed.assign(1, next->token);
      still.push_back(std::move(a));
    }
  }
  active = std::move(still);
  return absl::OkStatus();
}

std::optional<ModelDrafter::DraftToken> ModelDrafter::NextDraftToken(Job& job, size_t row, bool on_device) {
  const std::vector<int32_t>* eos = job.grammar ? &job.grammar->compiled().vocab().eos_ids() : nullptr;
  int32_t token = -1;
  if (on_device) {
    token = samples_[row].token;
  } else {
    const int64_t vocab = executor_->config().vocab_size;
    absl::Span<float> logits(logits_.data() + int64_t(row) * vocab, size_t(vocab));
    if (job.grammar) {
      token_mask_.resize(size_t(job.grammar->compiled().vocab().mask_words()));
      job.grammar->FillNextTokenMask(absl::MakeSpan(token_mask_));
      if (job.ignore_eos) {
        for (int32_t id : *eos) token_mask_[size_t(id) / 32] &= ~(uint32_t(1) << (id % 32));
      }
      if (std::all_of(token_mask_.begin(), token_mask_.end(), [](uint32_t w) { return w == 0; })) return std::nullopt;
      Sampler::ApplyTokenMask(logits, token_mask_);
    }
    token = Sampler::Argmax(logits);
  }
  if (!job.grammar) return DraftToken{token, false};
  const bool is_eos = std::find(eos->begin(), eos->end(), token) != eos->end();
  // Only a device sample, drawn without the mask, can be rejected here.
  if ((is_eos && job.ignore_eos) || !job.grammar->AcceptToken(token)) return std::nullopt;
  return DraftToken{token, is_eos || job.grammar->IsTerminated()};
}

}  // namespace duet

#include "engine/llm_engine.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iterator>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace duet {

namespace {

absl::Status NoTokenContinuesError() {
  return absl::InvalidArgumentError("no token of the vocabulary continues the structured output");
}

// Device memory a draft model's weights and buffers take beside its KV cache: its checkpoint's
// size plus room for its runtime (cuBLAS workspace, activations).
int64_t DraftModelReserveBytes(const std::string& dir) {
  int64_t bytes = int64_t(512) << 20;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.path().extension() == ".safetensors") bytes += int64_t(entry.file_size(ec));
  }
  return bytes;
}

EngineConfig Resolve(EngineConfig config, const ModelExecutor& model) {
  const ModelConfig& m = model.config();
  if (config.scheduler.max_model_len <= 0) config.scheduler.max_model_len = m.max_position_embeddings;
  if (config.num_kv_blocks <= 0) {
    int64_t bytes_per_block =
        KvCacheShape{m.num_layers, 1, m.num_kv_heads, config.block_size, m.head_dim, model.kv_dtype()}.bytes_per_block();
    std::optional<int64_t> budget = model.DeviceKvBudgetBytes(config.gpu_memory_utilization);
    // A draft model on the device loads after this cache and keeps as many blocks: share.
    const std::string& draft_dir = config.speculation.draft_model_dir;
    if (budget && !draft_dir.empty()) {
      if (absl::StatusOr<ModelConfig> d = LoadModelConfig(draft_dir); d.ok()) {
        bytes_per_block +=
            KvCacheShape{d->num_layers, 1, d->num_kv_heads, config.block_size, d->head_dim, model.kv_dtype()}
                .bytes_per_block();
        *budget -= DraftModelReserveBytes(draft_dir);
      }
    }
    config.num_kv_blocks =
        static_cast<int32_t>(std::max<int64_t>(1, budget.value_or(config.kv_cache_bytes) / bytes_per_block));
  }
  return config;
}

}  // namespace

absl::StatusOr<std::unique_ptr<LlmEngine>> LlmEngine::Create(const EngineConfig& config,
                                                             const ExecutorLoader& load_executor) {
  if (config.block_size <= 0) return absl::InvalidArgumentError("block_size must be positive");
  if (!(config.gpu_memory_utilization > 0 && config.gpu_memory_utilization <= 1)) {
    return absl::InvalidArgumentError("gpu_memory_utilization must be in (0, 1]");
  }
  DUET_ASSIGN_OR_RETURN(std::unique_ptr<ModelExecutor> model, load_executor(config));
  DUET_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, Tokenizer::FromModelDir(config.model_dir));
  const EngineConfig resolved = Resolve(config, *model);
  DUET_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache,
                        model->CreateKvCache(resolved.num_kv_blocks, resolved.block_size));
  auto engine = std::make_unique<LlmEngine>(std::move(model), std::move(tokenizer), std::move(cache), resolved);
  DUET_RETURN_IF_ERROR(engine->SetUpPrefixCache());
  absl::StatusOr<std::unique_ptr<SpeculativeDecoder>> spec = SpeculativeDecoder::Create(
      engine->config_.speculation, *engine->model_, engine->blocks_, *engine->cache_, *engine->tokenizer_,
      [&config, &load_executor](const std::string& dir) {
        EngineConfig draft = config;
        draft.model_dir = dir;
        return load_executor(draft);
      });
  if (!spec.ok()) return spec.status();
  engine->spec_ = std::move(*spec);
  if (config.speculation.default_mode != SpeculationMode::kNone) {
    engine->spec_->WarmUpCosts(engine->config_.scheduler.max_num_seqs);
  }
  return engine;
}

LlmEngine::LlmEngine(std::unique_ptr<ModelExecutor> model, std::unique_ptr<Tokenizer> tokenizer,
                     std::unique_ptr<KvCache> cache, const EngineConfig& config)
    : config_(config),
      model_(std::move(model)),
      tokenizer_(std::move(tokenizer)),
      blocks_(config_.num_kv_blocks, config_.block_size),
      cache_(std::move(cache)),
      scheduler_(config_.scheduler, blocks_) {
  eos_token_ids_ = model_->config().eos_token_ids;
  if (std::optional<int32_t> eos = tokenizer_->eos_token_id();
      eos && std::find(eos_token_ids_.begin(), eos_token_ids_.end(), *eos) == eos_token_ids_.end()) {
    eos_token_ids_.push_back(*eos);
  }
}

absl::Status LlmEngine::SetUpPrefixCache() {
  if (!config_.enable_prefix_caching) {
    if (config_.host_kv_cache_bytes > 0) return absl::InvalidArgumentError("a host KV cache needs prefix caching on");
    return absl::OkStatus();
  }
  if (config_.host_kv_cache_bytes > 0) {
    DUET_ASSIGN_OR_RETURN(host_tier_, HostKvTier::Create(*cache_, config_.host_kv_cache_bytes));
  }
  blocks_.EnablePrefixCaching(host_tier_.get());
  return absl::OkStatus();
}

absl::Status LlmEngine::FlushTierCopies(HostKvTier::FlushMode mode) {
  if (host_tier_ == nullptr || !host_tier_->HasPendingCopies()) return absl::OkStatus();
  return host_tier_->Flush(mode);
}

absl::StatusOr<std::unique_ptr<Request>> LlmEngine::NewRequest(const std::string& id,
                                                               std::vector<int32_t> prompt,
                                                               SamplingParams params, SequenceId seq_id,
                                                               const ResumedOutput& resumed) {
  if (absl::Status s = params.Validate(); !s.ok()) return s;
  if (requests_.count(id)) return absl::AlreadyExistsError(absl::StrCat("request id '", id, "' is in use"));
  const int64_t vocab = model_->config().vocab_size;
  for (int32_t t : prompt) {
    if (t < 0 || t >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt token id ", t, " is outside the vocabulary [0, ", vocab, ")"));
    }
  }
  SpeculationMode mode = SpeculationMode::kNone;
  if (spec_) {
    absl::StatusOr<SpeculationMode> resolved = spec_->Resolve(params.speculation);
    if (!resolved.ok()) return resolved.status();
    mode = *resolved;
  }
  // The prompt was scored where the request began (a chunk of prompt and output has no rows for it).
  if (!resumed.tokens.empty()) params.prompt_logprobs = -1;
  std::unique_ptr<grammar::GrammarMatcher> matcher;
  if (params.structured_output.active()) {
    DUET_ASSIGN_OR_RETURN(matcher, NewGrammarMatcher(params.structured_output));
  }
  auto request = std::make_unique<Request>(id, seq_id, std::move(prompt), std::move(params));
  request->prefix_seed = PrefixSeed("", request->params.cache_salt);
  request->spec.mode = mode;
  request->grammar = std::move(matcher);
  request->decoder = std::make_unique<StreamingDecoder>(*tokenizer_, request->prompt, true);
  DUET_RETURN_IF_ERROR(ResumeOutput(*request, resumed));
  return request;
}

absl::Status LlmEngine::ResumeOutput(Request& r, const ResumedOutput& resumed) {
  if (resumed.tokens.empty()) {
    if (resumed.emitted_text_bytes == 0) return absl::OkStatus();
    return absl::InvalidArgumentError("text was emitted for a resumed output without tokens");
  }
  const SamplingParams& p = r.params;
  if (int64_t(resumed.tokens.size()) >= p.max_tokens ||
      r.num_tokens() + int64_t(resumed.tokens.size()) >= config_.scheduler.max_model_len) {
    return absl::InvalidArgumentError(absl::StrCat("a resumed output of ", resumed.tokens.size(),
                                                   " tokens leaves no room for another (max_tokens ", p.max_tokens,
                                                   ")"));
  }
  const int64_t vocab = model_->config().vocab_size;
  auto contains = [](const auto& ids, int32_t t) { return std::find(ids.begin(), ids.end(), t) != ids.end(); };
  for (int32_t t : resumed.tokens) {
    const bool ends_request = (!p.ignore_eos && contains(eos_token_ids_, t)) || contains(p.stop_token_ids, t);
    if (t < 0 || t >= vocab || ends_request) {
      return absl::InvalidArgumentError(
          absl::StrCat("resumed output token ", t, " is out of vocabulary or ends the request"));
    }
    // As AppendToken: the grammar accepts it, the detokenizer takes it.
    if (r.grammar && !r.grammar->AcceptToken(t)) {
      return absl::InvalidArgumentError(
          absl::StrCat("resumed output token ", t, " does not continue the structured output"));
    }
    r.output.push_back(t);
    r.text += r.decoder->Push(t);
  }
  if (r.grammar && r.grammar->IsTerminated()) {
    return absl::InvalidArgumentError("the resumed output completes the structured output");
  }
  if (resumed.emitted_text_bytes > r.text.size()) {
    return absl::InvalidArgumentError(absl::StrCat(resumed.emitted_text_bytes,
                                                   " bytes of text were emitted for a resumed output of ",
                                                   r.text.size()));
  }
  r.num_emitted_text = resumed.emitted_text_bytes;
  if (p.logprobs >= 0) {  // scored where they were sampled; kept in step with `output`
    r.output_logprobs.resize(r.output.size(), 0.0f);
    r.output_top_logprobs.resize(r.output.size());
  }
  // The host sampler drew one number per sampled token (ResumedOutput).
  if (!p.greedy()) {
    for (size_t i = 0; i < resumed.tokens.size(); ++i) r.rng.Uniform();
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<grammar::GrammarMatcher>> LlmEngine::NewGrammarMatcher(
    const grammar::StructuredOutput& constraint) {
  if (!grammar_compiler_) {
    const int32_t vocab = int32_t(model_->config().vocab_size);
    std::vector<std::optional<std::string>> strings(static_cast<size_t>(vocab));
    for (int32_t id = 0; id < vocab; ++id) {
      if (!tokenizer_->IsSpecial(id)) strings[size_t(id)] = tokenizer_->IdToToken(id);
    }
    std::vector<int32_t> eos(eos_token_ids_.begin(), eos_token_ids_.end());
    grammar_compiler_ = std::make_unique<grammar::GrammarCompiler>(
        grammar::TokenVocabulary::FromTokenStrings(strings, std::move(eos)));
  }
  absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> compiled = grammar_compiler_->Compile(constraint);
  if (!compiled.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        grammar::StructuredOutput::KindName(constraint.kind), ": ", compiled.status().message()));
  }
  return std::make_unique<grammar::GrammarMatcher>(std::move(*compiled));
}

bool LlmEngine::FillTokenMask(Request& r) {
  const grammar::TokenVocabulary& vocab = r.grammar->compiled().vocab();
  r.token_mask.resize(size_t(vocab.mask_words()));
  r.grammar->FillNextTokenMask(absl::MakeSpan(r.token_mask));
  if (r.params.ignore_eos) {
    for (int32_t id : vocab.eos_ids()) r.token_mask[size_t(id) / 32] &= ~(uint32_t(1) << (id % 32));
  }
  return std::any_of(r.token_mask.begin(), r.token_mask.end(), [](uint32_t w) { return w != 0; });
}

absl::Status LlmEngine::AddRequest(const std::string& id, std::vector<int32_t> prompt,
                                   SamplingParams params, const ResumedOutput& resumed) {
  absl::StatusOr<std::unique_ptr<Request>> request =
      NewRequest(id, std::move(prompt), std::move(params), next_seq_id_++, resumed);
  if (!request.ok()) return request.status();
  if (absl::Status s = scheduler_.Add(request->get()); !s.ok()) return s;
  requests_.emplace(id, std::move(*request));
  return absl::OkStatus();
}

absl::StatusOr<LlmEngine::KvReservation> LlmEngine::ReserveKv(absl::Span<const int32_t> prompt,
                                                              const std::string& cache_salt,
                                                              int64_t alignment_tokens) {
  const int64_t num_tokens = int64_t(prompt.size());
  if (num_tokens <= 0 || num_tokens > config_.scheduler.max_model_len) {
    return absl::InvalidArgumentError(absl::StrCat("cannot reserve KV for ", num_tokens, " tokens"));
  }
  if (cache_salt.size() > SamplingParams::kMaxCacheSaltBytes) {
    return absl::InvalidArgumentError(absl::StrCat("cache_salt is ", cache_salt.size(), " bytes; at most ",
                                                   SamplingParams::kMaxCacheSaltBytes, " are allowed"));
  }
  KvReservation r{next_seq_id_++, 0};
  if (alignment_tokens > 0 && blocks_.prefix_caching()) {
    // At least the last block is written by the prefill worker, so a transfer is never empty;
    // the prefix ends where both sides' blocks end.
    const int64_t unit = std::lcm(alignment_tokens, int64_t(blocks_.block_size()));
    const BlockHash seed = PrefixSeed("", cache_salt);
    int32_t max_blocks = blocks_.BlocksForTokens(num_tokens) - 1;
    r.num_cached_tokens = blocks_.AttachCachedPrefix(r.seq, seed, prompt, max_blocks);
    if (r.num_cached_tokens % unit != 0) {
      blocks_.Free(r.seq);
      max_blocks = int32_t(r.num_cached_tokens / unit * unit / blocks_.block_size());
      r.num_cached_tokens = blocks_.AttachCachedPrefix(r.seq, seed, prompt, max_blocks);
    }
    scheduler_.RecordPrefixLookup(num_tokens, r.num_cached_tokens);
  }
  if (absl::Status s = blocks_.Reserve(r.seq, num_tokens, r.num_cached_tokens, nullptr); !s.ok()) {
    blocks_.Free(r.seq);
    return s;
  }
  // The prefill worker writes into these blocks before the next step: evicted ones must reach
  // the host tier, and hits must be in place, now.
  if (absl::Status s = FlushTierCopies(HostKvTier::FlushMode::kWait); !s.ok()) {
    blocks_.Free(r.seq);
    return s;
  }
  return r;
}

void LlmEngine::ReleaseKv(SequenceId reservation) { blocks_.Free(reservation); }

absl::Status LlmEngine::KeepKvWhenFinished(const std::string& id) {
  DrainLaunched();
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second->finished()) {
    return absl::NotFoundError(absl::StrCat("no unfinished request '", id, "'"));
  }
  it->second->keep_kv_when_finished = true;
  return absl::OkStatus();
}

absl::StatusOr<RequestOutput> LlmEngine::AddPrefilledRequest(const std::string& id,
                                                             std::vector<int32_t> prompt,
                                                             SamplingParams params,
                                                             SequenceId reservation,
                                                             const SampledToken& first_token,
                                                             const ResumedOutput& resumed) {
  const int64_t prefilled = int64_t(prompt.size() + resumed.tokens.size());
  if (blocks_.Capacity(reservation) < prefilled) {
    return absl::FailedPreconditionError("the KV reservation does not cover the prompt");
  }
  // The prompt was scored where it was prefilled; a recompute here (preemption) scores nothing.
  params.prompt_logprobs = -1;
  absl::StatusOr<std::unique_ptr<Request>> request =
      NewRequest(id, std::move(prompt), std::move(params), reservation, resumed);
  if (!request.ok()) return request.status();
  Request& r = **request;
  if (absl::Status s = scheduler_.Add(&r); !s.ok()) return s;
  r.num_computed_tokens = prefilled;
  // The prompt's blocks are written now (the transfer finished): cache them for later turns.
  blocks_.CommitFullBlocks(reservation, r.prefix_seed, prefilled, [&r](int64_t i) { return r.TokenAt(i); });
  // The prefill worker drew one number from this request's stream to sample the first token.
  if (!r.params.greedy()) r.rng.Uniform();
  r.first_scheduled_time = r.arrival_time;
  requests_.emplace(id, std::move(*request));
  RequestOutput out{id};
  AppendToken(r, first_token, out);
  return out;
}

absl::StatusOr<LlmEngine::DetachedRequest> LlmEngine::Detach(const std::string& id) {
  DrainLaunched();  // its last token known, and none of its K/V still being written
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second->finished()) {
    return absl::NotFoundError(absl::StrCat("no running request '", id, "'"));
  }
  Request& r = *it->second;
  // Decoding: every token but the last sampled one has its KV. That includes a request that joined
  // with its KV (prefilled elsewhere, or attached) and waits for its first step here.
  const bool holds_kv = r.state == RequestState::kRunning ||
                        (r.state == RequestState::kWaiting && r.num_computed_tokens > 0);
  if (!holds_kv || r.output.empty() || r.num_computed_tokens != r.num_tokens() - 1) {
    return absl::FailedPreconditionError(absl::StrCat("request '", id, "' is not decoding"));
  }
  scheduler_.Detach(&r);
  if (spec_) spec_->OnFinished(r);  // a draft model's own KV of it goes
  DetachedRequest detached{r.seq_id, std::move(r.prompt), std::move(r.output)};
  requests_.erase(it);
  return detached;
}

absl::Status LlmEngine::AttachRequest(const std::string& id, std::vector<int32_t> prompt, SamplingParams params,
                                      SequenceId reservation, const ResumedOutput& resumed) {
  if (resumed.tokens.empty()) return absl::InvalidArgumentError("an attached request needs its output so far");
  const int64_t computed = int64_t(prompt.size() + resumed.tokens.size()) - 1;
  if (blocks_.Capacity(reservation) < computed) {
    return absl::FailedPreconditionError("the KV reservation does not cover the prompt and the output so far");
  }
  absl::StatusOr<std::unique_ptr<Request>> request =
      NewRequest(id, std::move(prompt), std::move(params), reservation, resumed);
  if (!request.ok()) return request.status();
  Request& r = **request;
  if (absl::Status s = scheduler_.Add(&r); !s.ok()) return s;
  r.num_computed_tokens = computed;
  blocks_.CommitFullBlocks(reservation, r.prefix_seed, computed, [&r](int64_t i) { return r.TokenAt(i); });
  r.first_scheduled_time = r.arrival_time;
  r.first_token_time = r.arrival_time;  // its first token came where it began
  requests_.emplace(id, std::move(*request));
  return absl::OkStatus();
}

bool LlmEngine::Abort(const std::string& id) {
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second->finished()) return false;
  FinishRequest(*it->second, FinishReason::kAbort);
  return true;
}

const Request* LlmEngine::Find(const std::string& id) const {
  auto it = requests_.find(id);
  return it == requests_.end() ? nullptr : it->second.get();
}

void LlmEngine::Release(const std::string& id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  if (!it->second->finished()) FinishRequest(*it->second, FinishReason::kAbort);
  if (it->second->num_launched_tokens > 0) released_while_launched_.push_back(std::move(it->second));
  requests_.erase(it);
}

EngineStats LlmEngine::Stats() const {
  EngineStats stats{int32_t(scheduler_.num_running()), int32_t(scheduler_.num_waiting()),
                    blocks_.num_blocks(), blocks_.num_free_blocks(), num_preemptions_,
                    spec_ ? spec_->stats() : SpecDecodeStats{}, model_->num_one_time_setups()};
  stats.prefix_cache_queries = scheduler_.num_prefix_queries();
  stats.prefix_cache_hits = scheduler_.num_prefix_hits();
  stats.num_cached_kv_blocks = blocks_.num_cached_blocks();
  stats.num_kv_evictions = blocks_.num_evictions();
  stats.num_prompt_tokens = num_prompt_tokens_;
  stats.num_generation_tokens = num_generation_tokens_;
  stats.num_steps = num_steps_;
  stats.step_seconds = step_seconds_;
  stats.forward_seconds = forward_seconds_;
  stats.num_late_scheduled_steps = num_late_scheduled_steps_;
  stats.num_late_launches = num_late_launches_;
  if (host_tier_ != nullptr) {
    stats.host_tier = host_tier_->stats();
    stats.host_tier_slots = host_tier_->num_slots();
    stats.host_tier_used_slots = host_tier_->num_used_slots();
  }
  return stats;
}

absl::Status LlmEngine::ResetPrefixCache() {
  if (HasUnfinished()) return absl::FailedPreconditionError("the prefix cache cannot be reset while requests run");
  if (host_tier_ != nullptr) {
    DUET_RETURN_IF_ERROR(host_tier_->Flush(HostKvTier::FlushMode::kWait));
    host_tier_->Clear();
  }
  blocks_.ResetPrefixCache();
  return absl::OkStatus();
}

bool LlmEngine::RunIdleWork() {
  constexpr int64_t kIndexedPerSlice = 4096;  // tokens: tens of microseconds
  return spec_ != nullptr && spec_->IndexQueuedOutputs(kIndexedPerSlice);
}

void LlmEngine::FinishRequest(Request& r, FinishReason reason) {
  if (r.keep_kv_when_finished && (reason == FinishReason::kStop || reason == FinishReason::kLength)) {
    const SequenceId kept = next_seq_id_++;
    const absl::Status forked = blocks_.Fork(r.seq_id, kept);
    DUET_CHECK_MSG(forked.ok(), forked.ToString());  // the request's sequence exists until Remove
    r.kept_kv = kept;
  }
  if (r.num_launched_tokens > 0) {  // a launched step still writes its K/V: freed once collected
    scheduler_.Detach(&r);
    deferred_frees_.push_back(r.seq_id);
  } else {
    scheduler_.Remove(&r);
  }
  if (spec_) spec_->OnFinished(r);
  r.finish_reason = reason;
  r.finish_time = Clock::now();
}

void LlmEngine::AppendToken(Request& r, const SampledToken& token, RequestOutput& out) {
  const SamplingParams& p = r.params;
  r.output.push_back(token.token);
  out.new_token_ids.push_back(token.token);
  if (p.logprobs >= 0) {
    r.output_logprobs.push_back(token.logprob);
    r.output_top_logprobs.push_back(token.top_logprobs);
    out.new_logprobs.push_back(token.logprob);
    out.new_top_logprobs.push_back(token.top_logprobs);
  }
  if (p.prompt_logprobs >= 0 && r.output.size() == 1) out.prompt_logprobs = r.prompt_logprobs;
  out.num_prompt_tokens = int32_t(r.prompt.size());
  out.num_output_tokens = int32_t(r.output.size());
  if (r.first_token_time == Clock::time_point{}) r.first_token_time = Clock::now();

  FinishReason reason = FinishReason::kNone;
  const bool is_eos = !p.ignore_eos &&
      std::find(eos_token_ids_.begin(), eos_token_ids_.end(), token.token) != eos_token_ids_.end();
  const bool is_stop_id =
      std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token.token) != p.stop_token_ids.end();
  if (r.grammar && !is_eos && !r.grammar->AcceptToken(token.token)) {
    // Only a token sampled elsewhere (a prefill worker's first token) can get here.
    FinishWithError(r, absl::InvalidArgumentError(absl::StrCat(
                           "token ", token.token, " does not continue the request's structured output")), out);
    return;
  }
  if (is_eos || is_stop_id) {
    reason = FinishReason::kStop;  // the stop token is in token_ids but not in the text
  } else {
    r.text += r.decoder->Push(token.token);
    // A complete grammar that allows nothing more ends the request without waiting for EOS.
    if (r.grammar && r.grammar->IsTerminated()) reason = FinishReason::kStop;
  }
  if (reason == FinishReason::kNone) {
    // A new match must end in the newly decoded text, so it starts after the emitted part.
    for (const std::string& stop : p.stop) {
      const size_t pos = r.text.find(stop, r.num_emitted_text);
      if (pos != std::string::npos) {
        r.text.resize(pos);
        reason = FinishReason::kStop;
      }
    }
  }
  if (reason == FinishReason::kNone &&
      (int32_t(r.output.size()) >= p.max_tokens || r.num_known_tokens() >= config_.scheduler.max_model_len)) {
    reason = FinishReason::kLength;
  }
  if (reason != FinishReason::kNone) {
    if (reason == FinishReason::kLength || (r.grammar && !is_eos && !is_stop_id)) r.text += r.decoder->Flush();
    FinishRequest(r, reason);
    out.finished = true;
    out.finish_reason = reason;
  }
  // Stream the text, holding back what could still turn out to be the start of a stop string.
  size_t holdback = 0;
  if (!out.finished) {
    for (const std::string& stop : p.stop) holdback = std::max(holdback, stop.size() - 1);
  }
  size_t end = r.text.size() > holdback ? r.text.size() - holdback : 0;
  // Never split a UTF-8 character: step back over continuation bytes.
  while (end > r.num_emitted_text && end < r.text.size() && (static_cast<unsigned char>(r.text[end]) & 0xC0) == 0x80) {
    --end;
  }
  if (end > r.num_emitted_text) {  // appended: a verified draft appends several tokens to one output
    out.new_text += r.text.substr(r.num_emitted_text, end - r.num_emitted_text);
    r.num_emitted_text = end;
  }
}

void LlmEngine::PlanSpeculation() {
  std::vector<Request*> decoding;
  for (Request* r : scheduler_.running()) {  // not every request kept until Release
    if (r->spec.mode != SpeculationMode::kNone && r->decoding()) decoding.push_back(r);
  }
  if (decoding.empty()) return;
  spec_->WarmUpCosts(config_.scheduler.max_num_seqs);  // once
  spec_->Plan(decoding, config_.scheduler.max_model_len, scheduler_.num_waiting() > 0);
}

void LlmEngine::VerifyDraft(Request& r, const std::vector<int32_t>& tokens, const std::vector<int32_t>& parents,
                            const std::function<std::optional<SampledToken>(int32_t node)>& draw,
                            RequestOutput& out) {
  const int64_t start = r.num_computed_tokens - 1;  // the root's slot (the scheduler counted it)
  std::optional<SampledToken> last;
  auto draw_token = [&](int32_t node) {
    last = draw(node);
    return last ? last->token : -1;
  };
  auto emit = [&](int32_t) {
    if (!last) {
      FinishWithError(r, NoTokenContinuesError(), out);
      return false;
    }
    AppendToken(r, *last, out);
    return !r.finished();
  };
  const std::vector<int32_t> accepted = VerifyDraftTree(tokens, parents, draw_token, emit);
  const int32_t end_node = accepted.empty() ? 0 : accepted.back();
  const bool missed = !r.finished() && std::find(parents.begin(), parents.end(), end_node) != parents.end();
  std::vector<int32_t> depths(accepted.size());
  std::iota(depths.begin(), depths.end(), 1);
  spec_->OnVerified(r, int32_t(tokens.size()) - 1, depths, missed);
  if (r.finished()) return;  // its blocks are already free
  // The accepted path's K/V move to the slots right after the root, in order (a node's slot is
  // never before its depth, so no move overwrites a slot still to be read).
  std::vector<KvSlotMove> moves;
  for (size_t i = 0; i < accepted.size(); ++i) {
    if (accepted[i] != int32_t(i) + 1) moves.push_back({start + accepted[i], start + int64_t(i) + 1});
  }
  if (absl::Status s = model_->MoveKvSlots(*cache_, blocks_.BlockTable(r.seq_id), moves); !s.ok()) {
    FinishWithError(r, s, out);
    return;
  }
  r.num_computed_tokens += int64_t(accepted.size());
  blocks_.Truncate(r.seq_id, r.num_tokens());
}

absl::StatusOr<std::vector<RequestOutput>> LlmEngine::Step(const LayerDoneCallback& on_layer_done) {
  const Clock::time_point start = Clock::now();
  absl::StatusOr<std::vector<RequestOutput>> outputs = ScheduleAndRun(on_layer_done);
  if (last_step_num_tokens_ > 0) {
    ++num_steps_;
    step_seconds_ += std::chrono::duration<double>(Clock::now() - start).count();
  }
  return outputs;
}

void LlmEngine::WaitForSchedulingPoint() {
  if (!config_.late_scheduling || late_scheduling_off_ || !launched_) return;
  // Device time: counted in the step's wall time and forward time as the collection's wait is.
  const Clock::time_point start = Clock::now();
  model_->WaitForLaunchedStepMidpoint();
  const double waited = std::chrono::duration<double>(Clock::now() - start).count();
  step_seconds_ += waited;
  forward_seconds_ += waited;
  planned_late_ = true;
}

void LlmEngine::CountLateLaunch() {
  constexpr int64_t kTrialSteps = 64;
  ++num_late_scheduled_steps_;
  if (model_->OldestLaunchedStepDone()) ++num_late_launches_;
  if (num_late_scheduled_steps_ >= kTrialSteps && num_late_launches_ * 8 > num_late_scheduled_steps_) {
    late_scheduling_off_ = true;
    DUET_LOG(WARNING) << "late scheduling off: " << num_late_launches_ << " of " << num_late_scheduled_steps_
                      << " steps planned at the launched step's midpoint were launched after it had finished; "
                         "steps are planned as soon as the one before is launched";
  }
}

absl::StatusOr<std::vector<RequestOutput>> LlmEngine::ScheduleAndRun(const LayerDoneCallback& on_layer_done) {
  const bool planned_late = std::exchange(planned_late_, false);
  std::vector<RequestOutput> outputs = std::exchange(drained_outputs_, {});
  auto append = [&outputs](std::vector<RequestOutput> more) {
    outputs.insert(outputs.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
  };
  last_step_num_tokens_ = 0;
  const bool ahead = CanLaunchAhead(on_layer_done);
  // A step run one at a time needs every token known: the launched step is collected first, and
  // this one runs on the next call.
  if (!ahead && launched_) {
    append(CollectLaunched(*std::exchange(launched_, std::nullopt)));
    return outputs;
  }
  const int64_t setups_before = model_->num_one_time_setups();
  if (spec_) {
    spec_->BeginStep();
    PlanSpeculation();
  }
  SchedulerOutput plan = scheduler_.Schedule();
  num_preemptions_ += plan.num_preempted;
  std::optional<SchedulerOutput> previous = std::exchange(launched_, std::nullopt);
  auto collect_previous = [&] {
    if (previous) append(CollectLaunched(*previous));
  };
  if (plan.empty()) {
    collect_previous();
    return outputs;
  }
  // Ordered ahead of the step's kernels, not waited for here.
  if (absl::Status s = FlushTierCopies(HostKvTier::FlushMode::kOrdered); !s.ok()) {
    scheduler_.OnStepDone(plan);
    append(FailStep(plan, s));
    collect_previous();
    return outputs;
  }
  cache_->CopyBlocks(plan.block_copies);
  DraftScheduled(plan);
  const StepBatch batch = BuildBatch(plan);
  last_step_num_tokens_ = batch.num_tokens;
  const std::optional<std::vector<DeviceSamplingRow>> device_rows = DeviceSamplingRows(plan, batch);
  if (ahead) {
    DUET_CHECK(device_rows.has_value());  // CanLaunchAhead found no request that samples on the host
    if (absl::Status s = LaunchAhead(plan, batch, *device_rows); s.ok()) {
      launched_ = std::move(plan);
      if (planned_late && previous) CountLateLaunch();
    } else {
      scheduler_.OnStepDone(plan);
      append(FailStep(plan, s));
    }
    collect_previous();  // the device runs the new step meanwhile
    return outputs;
  }
  const Clock::time_point forward_start = Clock::now();
  const absl::Status forward =
      device_rows ? model_->ForwardSample(batch.chunks, *cache_, *device_rows, device_samples_, on_layer_done,
                                          DeviceMaskFiller(plan))
                  : model_->Forward(batch.chunks, *cache_, logits_, on_layer_done);
  forward_seconds_ += std::chrono::duration<double>(Clock::now() - forward_start).count();
  scheduler_.OnStepDone(plan);
  if (!forward.ok()) {
    append(FailStep(plan, forward));
    return outputs;
  }
  CountPromptTokens(plan);
  scheduler_.CommitComputedBlocks(plan);
  std::vector<RequestOutput> sampled = ApplySamples(plan, batch, device_rows.has_value());
  for (const RequestOutput& out : sampled) num_generation_tokens_ += int64_t(out.new_token_ids.size());
  append(std::move(sampled));
  // What the step cost teaches the planner, unless it paid a one-time setup (a graph capture).
  if (spec_ && model_->num_one_time_setups() == setups_before) {
    const bool verification = std::any_of(batch.parents.begin(), batch.parents.end(),
                                          [](const std::vector<int32_t>& p) { return !p.empty(); });
    spec_->EndStep(batch.num_tokens, verification);
  }
  return outputs;
}

void LlmEngine::CountPromptTokens(const SchedulerOutput& plan) {
  for (const ScheduledChunk& sc : plan.chunks) {  // OnStepDone has counted the chunk computed
    const int64_t first = sc.request->num_computed_tokens - sc.num_new_tokens;
    num_prompt_tokens_ += std::clamp<int64_t>(int64_t(sc.request->prompt.size()) - first, 0, sc.num_new_tokens);
  }
}

namespace {

// Whether a request's tokens need the host sampler: penalties, logit bias, top-N logprobs.
bool SamplesOnHost(const SamplingParams& p) {
  return p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f ||
         p.logprobs > 0 || !p.logit_bias.empty();
}

// Whether a request's steps must run one at a time: its token or its prompt's logprobs come from
// the host, its mask from the grammar's state after the previous token, its tokens from
// speculation, or its KV is kept for a transfer that starts after the step.
bool NeedsStepsOneAtATime(const Request& r) {
  return SamplesOnHost(r.params) || r.params.prompt_logprobs >= 0 || r.grammar != nullptr ||
         r.spec.mode != SpeculationMode::kNone || r.keep_kv_when_finished;
}

}  // namespace

bool LlmEngine::CanLaunchAhead(const LayerDoneCallback& on_layer_done) const {
  return config_.async_scheduling && !on_layer_done && model_->CanLaunchAhead() &&
         !scheduler_.AnyUnfinished(NeedsStepsOneAtATime);
}

absl::Status LlmEngine::LaunchAhead(const SchedulerOutput& plan, const StepBatch& batch,
                                    const std::vector<DeviceSamplingRow>& rows) {
  const Clock::time_point start = Clock::now();
  const absl::Status launched = model_->LaunchSample(batch.chunks, *cache_, rows);
  forward_seconds_ += std::chrono::duration<double>(Clock::now() - start).count();
  if (!launched.ok()) return launched;
  scheduler_.OnStepDone(plan);
  CountPromptTokens(plan);
  int32_t row = 0;  // one sampled row per sampling chunk: no trees, no prompt logprobs here
  for (const ScheduledChunk& sc : plan.chunks) {
    sc.request->num_launched_tokens += sc.num_new_tokens;
    if (sc.samples) sc.request->pending_rows.push_back(row++);
  }
  return absl::OkStatus();
}

std::vector<RequestOutput> LlmEngine::CollectLaunched(const SchedulerOutput& step) {
  const Clock::time_point start = Clock::now();
  const absl::Status collected = model_->CollectSamples(device_samples_);
  forward_seconds_ += std::chrono::duration<double>(Clock::now() - start).count();
  // The device is done with the step: the blocks of requests that finished while it ran can go.
  const std::vector<SequenceId> frees = std::exchange(deferred_frees_, {});
  for (const ScheduledChunk& sc : step.chunks) sc.request->num_launched_tokens -= sc.num_new_tokens;
  if (collected.ok()) scheduler_.CommitComputedBlocks(step);
  std::vector<RequestOutput> outputs;
  int32_t row = 0;
  for (const ScheduledChunk& sc : step.chunks) {
    if (!sc.samples) continue;
    Request& r = *sc.request;
    DUET_CHECK(!r.pending_rows.empty() && r.pending_rows.front() == row);
    r.pending_rows.erase(r.pending_rows.begin());
    const DeviceSample sample = collected.ok() ? device_samples_[size_t(row)] : DeviceSample{};
    ++row;
    if (r.finished()) continue;  // it finished while the step ran (stop, abort): the token goes
    RequestOutput& out = outputs.emplace_back(RequestOutput{r.id});
    if (!collected.ok()) {
      FinishWithError(r, collected, out);
      continue;
    }
    AppendToken(r, SampledToken{sample.token, sample.logprob, {}}, out);
    num_generation_tokens_ += int64_t(out.new_token_ids.size());
  }
  for (SequenceId seq : frees) blocks_.Free(seq);
  std::erase_if(released_while_launched_, [](const std::unique_ptr<Request>& r) { return r->num_launched_tokens == 0; });
  return outputs;
}

void LlmEngine::DrainLaunched() {
  if (!launched_) return;
  std::vector<RequestOutput> collected = CollectLaunched(*std::exchange(launched_, std::nullopt));
  drained_outputs_.insert(drained_outputs_.end(), std::make_move_iterator(collected.begin()),
                          std::make_move_iterator(collected.end()));
}

void LlmEngine::DraftScheduled(const SchedulerOutput& plan) {
  // Drafts for the decoding requests that got room for them.
  std::vector<Request*> drafting;
  for (const ScheduledChunk& sc : plan.chunks) {
    if (sc.samples && sc.num_draft_slots > 0) drafting.push_back(sc.request);
  }
  if (!drafting.empty() && !spec_->Draft(drafting).ok()) {
    for (Request* r : drafting) r->spec.tree.Clear();  // a failed draft only costs the speed-up
  }
}

LlmEngine::StepBatch LlmEngine::BuildBatch(const SchedulerOutput& plan) const {
  StepBatch batch;
  batch.tokens.resize(plan.chunks.size());
  batch.parents.resize(plan.chunks.size());
  batch.chunks.resize(plan.chunks.size());
  batch.num_prompt_logprob_rows.resize(plan.chunks.size());
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const ScheduledChunk& sc = plan.chunks[i];
    const Request& r = *sc.request;
    std::vector<int32_t>& tokens = batch.tokens[i];
    std::vector<int32_t>& parents = batch.parents[i];
    for (int64_t pos = r.num_computed_tokens; pos < r.num_computed_tokens + sc.num_new_tokens; ++pos) {
      // A pending token (async scheduling) is the launched step's sample, resolved on the device.
      tokens.push_back(pos < r.num_known_tokens()
                           ? r.TokenAt(pos)
                           : PreviousStepSample(r.pending_rows[size_t(pos - r.num_known_tokens())]));
    }
    if (sc.num_draft_slots > 0 && !r.spec.tree.empty()) {
      parents.push_back(-1);
      for (int32_t j = 0; j < r.spec.tree.size(); ++j) {
        tokens.push_back(r.spec.tree.tokens[size_t(j)]);
        parents.push_back(r.spec.tree.parents[size_t(j)] + 1);
      }
    }
    SequenceChunk& chunk = batch.chunks[i];
    chunk = SequenceChunk{tokens, r.num_computed_tokens, blocks_.BlockTable(r.seq_id), r.seq_id, sc.samples ? 1 : 0};
    if (r.params.prompt_logprobs >= 0) {
      // Position p's logits score prompt token p + 1: the chunk's positions before the prompt's
      // last that are not scored yet (the scheduler attaches no cached block past those scored).
      const int64_t chunk_end = r.num_computed_tokens + sc.num_new_tokens;
      const int64_t first = int64_t(r.prompt_logprobs.size());
      const int64_t end = std::min(chunk_end, int64_t(r.prompt.size()) - 1);
      if (end > first) {
        DUET_CHECK(first >= r.num_computed_tokens);
        // They are the chunk's last rows, or all but its last (the sampled) one.
        DUET_CHECK(end == chunk_end - (sc.samples ? 1 : 0));
        batch.num_prompt_logprob_rows[i] = int32_t(end - first);
        chunk.num_logits += int32_t(end - first);
      }
    }
    if (!parents.empty()) {  // a tree: every node's logits
      chunk.tree_parents = parents;
      chunk.num_logits = int32_t(tokens.size());
    }
    batch.num_tokens += int64_t(tokens.size());
  }
  return batch;
}

// Sample on the executor's device when it can and no request needs host-side processing
// (penalties, logit bias, top-N logprobs): then only token ids cross back, not [rows, vocab]
// logits. A draft tree samples every node's row, each node keyed by the output index it would
// fill. A constrained request's row carries its grammar mask, sized here and filled by
// FillDeviceMasks while the device runs the step (draft trees of constrained requests sample on
// the host: each node has a mask of its own).
std::optional<std::vector<DeviceSamplingRow>> LlmEngine::DeviceSamplingRows(const SchedulerOutput& plan,
                                                                           const StepBatch& batch) {
  if (!model_->CanSampleOnDevice()) return std::nullopt;
  // Prompt logprobs need the rows' logits on the host.
  for (int32_t rows : batch.num_prompt_logprob_rows) {
    if (rows > 0) return std::nullopt;
  }
  // Decided for the whole step before any request's generator is drawn from, so a request's
  // draws do not depend on what it is batched with.
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const ScheduledChunk& sc = plan.chunks[i];
    if (!sc.samples) continue;
    const Request& r = *sc.request;
    if (SamplesOnHost(r.params)) return std::nullopt;
    if (r.grammar && !batch.parents[i].empty()) return std::nullopt;
  }
  std::vector<DeviceSamplingRow> rows;
  std::vector<int32_t> depths;
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const ScheduledChunk& sc = plan.chunks[i];
    if (!sc.samples) continue;
    Request& r = *sc.request;
    const SamplingParams& p = r.params;
    const std::vector<int32_t>& parents = batch.parents[i];
    // Each draw is keyed by a number from the request's own generator (seeded when the request
    // has a seed) and the token index, so seeded requests repeat exactly.
    const auto key = static_cast<uint64_t>(r.rng.Uniform() * 9007199254740992.0);
    if (r.grammar) r.token_mask.resize(size_t(r.grammar->compiled().vocab().mask_words()));
    const DeviceSamplingRow row{p.greedy() ? 0.0f : p.temperature, p.top_k, p.top_p, p.min_p, key,
                                uint64_t(r.output.size() + r.pending_rows.size()),
                                r.grammar ? absl::Span<const uint32_t>(r.token_mask) : absl::Span<const uint32_t>()};
    if (parents.empty()) {
      rows.push_back(row);
      continue;
    }
    depths.assign(parents.size(), 0);
    for (size_t j = 0; j < parents.size(); ++j) {
      if (j > 0) depths[j] = depths[size_t(parents[j])] + 1;
      rows.push_back(row);
      rows.back().offset += uint64_t(depths[j]);
    }
  }
  return rows;
}

FillMasksCallback LlmEngine::DeviceMaskFiller(const SchedulerOutput& plan) {
  std::vector<Request*> constrained;
  for (const ScheduledChunk& sc : plan.chunks) {
    if (sc.samples && sc.request->grammar) constrained.push_back(sc.request);
  }
  if (constrained.empty()) return nullptr;
  return [this, constrained = std::move(constrained)] {
    for (Request* r : constrained) FillTokenMask(*r);  // in place: DeviceSamplingRows sized each mask
  };
}

std::vector<RequestOutput> LlmEngine::FailStep(const SchedulerOutput& plan, const absl::Status& error) {
  std::vector<RequestOutput> outputs;
  for (const ScheduledChunk& sc : plan.chunks) {
    RequestOutput& out = outputs.emplace_back(RequestOutput{sc.request->id});
    FinishWithError(*sc.request, error, out);
  }
  return outputs;
}

void LlmEngine::FinishWithError(Request& r, const absl::Status& error, RequestOutput& out) {
  FinishRequest(r, FinishReason::kError);
  out.finished = true;
  out.finish_reason = FinishReason::kError;
  out.error = std::string(error.message());
}

std::vector<RequestOutput> LlmEngine::ApplySamples(const SchedulerOutput& plan, const StepBatch& batch,
                                                   bool on_device) {
  std::vector<RequestOutput> outputs;
  int64_t logit_row = 0;
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const ScheduledChunk& sc = plan.chunks[i];
    Request& r = *sc.request;
    if (const int32_t rows = batch.num_prompt_logprob_rows[i]; rows > 0) {
      ScorePromptRows(r, logit_row, rows);
      logit_row += rows;
    }
    if (!sc.samples) continue;
    RequestOutput& out = outputs.emplace_back(RequestOutput{r.id});
    if (!batch.parents[i].empty()) {
      // Each node is drawn under the mask of the grammar's state after the node's ancestors:
      // the walk appends (and the matcher accepts) every drawn token before drawing the next.
      // Those masks are known only along the walk, so such trees sample on the host
      // (DeviceSamplingRows).
      DUET_CHECK(!on_device || r.grammar == nullptr);
      const int64_t first_row = logit_row;
      auto draw = [&](int32_t node) { return SampleRow(r, first_row + node, on_device); };
      VerifyDraft(r, batch.tokens[i], batch.parents[i], draw, out);
      logit_row += int64_t(batch.tokens[i].size());
      continue;
    }
    const std::optional<SampledToken> token = SampleRow(r, logit_row++, on_device);
    if (!token) {
      FinishWithError(r, NoTokenContinuesError(), out);
      continue;
    }
    if (r.spec.mode != SpeculationMode::kNone && !r.output.empty()) ScorePlannedGuess(r, token->token);
    AppendToken(r, *token, out);
  }
  return outputs;
}

std::optional<SampledToken> LlmEngine::SampleRow(Request& r, int64_t row, bool on_device) {
  if (r.grammar) {
    // On the device the mask was filled during the step (DeviceMaskFiller).
    const bool allows_a_token =
        on_device ? std::any_of(r.token_mask.begin(), r.token_mask.end(), [](uint32_t w) { return w != 0; })
                  : FillTokenMask(r);
    if (!allows_a_token) return std::nullopt;
  }
  if (on_device) {
    const DeviceSample& d = device_samples_[size_t(row)];
    return SampledToken{d.token, d.logprob, {}};
  }
  const int64_t vocab = model_->config().vocab_size;
  absl::Span<float> logits(logits_.data() + row * vocab, size_t(vocab));
  return Sampler::Sample(logits, r.params, r.prompt, r.output, r.rng,
                         r.grammar ? absl::Span<const uint32_t>(r.token_mask) : absl::Span<const uint32_t>());
}

void LlmEngine::ScorePromptRows(Request& r, int64_t first_row, int32_t num_rows) {
  const int64_t vocab = model_->config().vocab_size;
  for (int32_t j = 0; j < num_rows; ++j) {
    const size_t scored = r.prompt_logprobs.size() + 1;  // the prompt token this row scores
    absl::Span<const float> logits(logits_.data() + (first_row + j) * vocab, size_t(vocab));
    r.prompt_logprobs.push_back(Sampler::ScoreToken(logits, r.prompt[scored], r.params.prompt_logprobs));
  }
}

void LlmEngine::ScorePlannedGuess(Request& r, int32_t token) {
  const DraftTree& guess = r.spec.tree;
  bool hit = false;
  for (int32_t j = 0; j < guess.size(); ++j) hit |= guess.parents[size_t(j)] == -1 && guess.tokens[size_t(j)] == token;
  const int32_t first_depth[] = {1};
  spec_->OnVerified(r, 0, hit ? absl::MakeConstSpan(first_depth) : absl::Span<const int32_t>(), !hit);
}

}  // namespace duet

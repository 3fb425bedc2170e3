// The generation loop: requests in, one batched forward step at a time, tokens out.
// Single-threaded by design (gpt-fast style); servers drive it from one engine thread.
#pragma once

#include <cstdint>
#include <map>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/grammar/structured_output.h"
#include "engine/kv/block_manager.h"
#include "engine/kv/host_kv_tier.h"
#include "engine/kv/kv_cache.h"
#include "engine/model_executor.h"
#include "engine/request.h"
#include "engine/scheduler/scheduler.h"
#include "engine/speculation/spec_decode.h"
#include "frontend/tokenizer/tokenizer.h"

namespace duet {

struct EngineConfig {
  std::string model_dir;
  // "cpu", "cuda", or "auto": cuda when this build has it and a GPU is visible, else cpu.
  std::string backend = "cpu";
  int32_t block_size = 16;
  // Prefix caching: computed full blocks stay cached for later requests that begin with the
  // same tokens; blocks the device evicts go to a host tier of `host_kv_cache_bytes` (0: none).
  bool enable_prefix_caching = false;
  int64_t host_kv_cache_bytes = 0;
  // KV-cache size: explicit block count, else from a byte budget.
  int32_t num_kv_blocks = 0;
  int64_t kv_cache_bytes = int64_t(1) << 30;  // host backends
  // Device backends: the KV cache takes what is left of this fraction of device memory once the
  // weights and activations are in (like vLLM's --gpu-memory-utilization).
  double gpu_memory_utilization = 0.9;
  SchedulerConfig scheduler;  // max_model_len 0: the model's max_position_embeddings
  // Async scheduling (vLLM's --async-scheduling): with an executor that can (CUDA), each step is
  // launched before the previous one's tokens reach the host, so the device does not idle while
  // the host applies them and schedules. Steps with requests that need host-side sampling
  // (penalties, logit bias, top-N logprobs, prompt logprobs, structured output, speculation) and
  // steps with a layer callback run one at a time. Outputs are the same either way.
  bool async_scheduling = true;
  // Late scheduling (with async scheduling, for an engine fed while it runs: an EngineLoop's): the
  // step after the launched one is planned once the launched step is halfway through its layers,
  // not as soon as it is launched, so requests that arrive meanwhile (a closed loop's next request
  // after one finishes) join it rather than the step after; the host still has half a step to
  // launch it. Turns itself off when more than one late launch in 8 finishes after the device has
  // finished the step before (the device waited).
  bool late_scheduling = true;
  SpeculationConfig speculation;
  // Sequence-parallel prefill (ring attention): a prompt of at least `min_tokens` that a step
  // takes whole runs on `ranks` ranks (cpu: threads of this process). 1: off.
  struct SequenceParallel {
    int ranks = 1;
    int64_t min_tokens = 2048;
    // cuda: the GPU of each rank (rank 0's first), one executor per rank; empty: virtual ranks
    // on the one GPU of rank 0 (device 0).
    std::vector<int> devices;
    std::string transport = "peer";  // with devices: how ranks pass ring blocks ("peer" or "nccl")
  } sequence_parallel;
};

// What a step produced for one request.
struct RequestOutput {
  std::string id;
  std::vector<int32_t> new_token_ids;
  std::string new_text;
  // With params.logprobs >= 0: per new token, its logprob and the top-N alternatives.
  std::vector<float> new_logprobs;
  std::vector<std::vector<TokenLogprob>> new_top_logprobs;
  // With params.prompt_logprobs >= 0, on the output that carries the first token:
  // Request::prompt_logprobs (one per prompt token after the first).
  std::vector<ScoredToken> prompt_logprobs;
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  std::string error;  // with FinishReason::kError
  int32_t num_prompt_tokens = 0;
  int32_t num_output_tokens = 0;  // so far
};

struct EngineStats {
  int32_t num_running = 0;
  int32_t num_waiting = 0;
  int32_t num_kv_blocks = 0;
  int32_t num_free_kv_blocks = 0;
  int64_t num_preemptions = 0;
  SpecDecodeStats spec_decode;
  int64_t num_one_time_setups = 0;  // the executor's (e.g. CUDA graph captures)
  // Prefix caching: tokens looked up and found, cached blocks, evictions; the host tier's.
  int64_t prefix_cache_queries = 0;
  int64_t prefix_cache_hits = 0;
  int32_t num_cached_kv_blocks = 0;
  int64_t num_kv_evictions = 0;
  HostKvTierStats host_tier;
  int64_t host_tier_slots = 0;
  int64_t host_tier_used_slots = 0;
  // Since the engine started: prompt tokens its forward passes computed (cached ones not
  // included), and tokens it sampled (not the first token a prefill worker sampled for it).
  int64_t num_prompt_tokens = 0;
  int64_t num_generation_tokens = 0;
  // Since the engine started: steps that ran a forward pass, their wall time, and the part of it
  // spent in the executor's forward (on a GPU: launches and the wait for the step's samples). The
  // rest is host work between forwards (scheduling, batch building, applying samples), which the
  // device waits through when steps run one at a time; with async scheduling it runs while the
  // device computes the launched step.
  int64_t num_steps = 0;
  double step_seconds = 0;
  double forward_seconds = 0;
  // Filled by an EngineLoop (0 without one): host time its thread spent between steps handing the
  // steps' outputs to subscribers, and running posted work (the device waits through both when
  // steps run one at a time).
  double delivery_seconds = 0;
  double posted_seconds = 0;
  // Late scheduling: steps planned at the launched step's midpoint, and those of them whose launch
  // finished after the device had finished the step before.
  int64_t num_late_scheduled_steps = 0;
  int64_t num_late_launches = 0;
};

// Makes the executor for a model directory (`config.model_dir`, on `config.backend`); the
// engine calls it for the target model and for a draft model (backends/executor_factory.h).
using ExecutorLoader =
    std::function<absl::StatusOr<std::unique_ptr<ModelExecutor>>(const EngineConfig& config)>;

// A request that continues an output produced elsewhere (request migration: its decode worker
// failed mid-stream). `tokens` are its first output tokens (computed like the prompt, as a
// preempted request's are), `emitted_text_bytes` the bytes of their text already streamed out.
// The request then goes on exactly as the one that produced them would have: its detokenizer and
// stop-string state rebuilt from the tokens, its grammar advanced over them, penalties and
// max_tokens counting them, and a seeded generator past the draws they took. The host sampler
// draws once per sampled token (also when verifying drafts), so a seeded continuation repeats the
// uninterrupted draws exactly; so does device sampling without speculation. Device sampling with
// drafts draws one key per verification step, not per token: there the continuation is a sample
// of the same distribution, not the same sample.
struct ResumedOutput {
  std::vector<int32_t> tokens;
  size_t emitted_text_bytes = 0;
};

class LlmEngine {
 public:
  static absl::StatusOr<std::unique_ptr<LlmEngine>> Create(const EngineConfig& config,
                                                           const ExecutorLoader& load_executor);
  // `config` as Create resolved it (block count, max_model_len); `cache` holds its blocks.
  LlmEngine(std::unique_ptr<ModelExecutor> model, std::unique_ptr<Tokenizer> tokenizer,
            std::unique_ptr<KvCache> cache, const EngineConfig& config);

  // Queues a request. InvalidArgument for bad params, an empty or over-long prompt, an
  // out-of-vocabulary token id, or a duplicate id.
  // With `resumed` tokens, InvalidArgument also when they cannot be the request's output (out of
  // vocabulary, a stop token, max_tokens or more, rejected by its grammar, text shorter than
  // emitted_text_bytes); its prompt logprobs are not computed (they were where it began).
  absl::Status AddRequest(const std::string& id, std::vector<int32_t> prompt, SamplingParams params,
                          const ResumedOutput& resumed = {});
  // Finishes a request with reason abort and frees its blocks; false if it is unknown.
  bool Abort(const std::string& id);
  // Runs one scheduling step and forward pass; returns the requests that advanced.
  // `on_layer_done` sees each layer's K/V as soon as the step has written it.
  absl::StatusOr<std::vector<RequestOutput>> Step(const LayerDoneCallback& on_layer_done = nullptr);
  // Late scheduling (EngineConfig::late_scheduling): with a step launched ahead, waits until it is
  // halfway; whoever feeds the engine while it runs calls this before adding what arrived and
  // calling Step. Returns at once otherwise.
  void WaitForSchedulingPoint();

  // Disaggregated decode. ReserveKv sets aside blocks for the prompt's tokens that a prefill
  // worker will write (BlockTable gives their ids); AddPrefilledRequest then joins the request
  // to the batch with those blocks and the first token the prefill worker sampled. ReleaseKv
  // returns a reservation that will not be used (cancelled, transfer failed). With prefix
  // caching, the reservation starts with the cached blocks the prompt begins with (all but its
  // last block at most), and the prefill worker writes only the blocks after
  // `num_cached_tokens`.
  struct KvReservation {
    SequenceId seq = 0;
    int64_t num_cached_tokens = 0;
  };
  // The cached prefix is rounded down to a multiple of `alignment_tokens` (0: none is used).
  absl::StatusOr<KvReservation> ReserveKv(absl::Span<const int32_t> prompt, const std::string& cache_salt,
                                          int64_t alignment_tokens);
  void ReleaseKv(SequenceId reservation);
  // Disaggregated prefill (vLLM's delayed block freeing): when request `id` finishes with a token
  // (stop or length), its blocks stay as they are, in Request::kept_kv, for a KV transfer that
  // starts after the forward pass; ReleaseKv frees them. NotFound for an unknown or finished request.
  absl::Status KeepKvWhenFinished(const std::string& id);
  const std::vector<int32_t>& BlockTable(SequenceId seq) const { return blocks_.BlockTable(seq); }
  // With `resumed` tokens the reservation holds the prompt's and theirs, and `first_token` comes
  // after them.
  absl::StatusOr<RequestOutput> AddPrefilledRequest(const std::string& id, std::vector<int32_t> prompt,
                                                    SamplingParams params, SequenceId reservation,
                                                    const SampledToken& first_token,
                                                    const ResumedOutput& resumed = {});
  // Live KV migration (a draining decode worker). Detach takes a decoding request out of the
  // batch with its KV: its blocks (`seq`, freed by ReleaseKv) hold the K/V of every token but the
  // last output token, which is sampled and not yet computed; a request that joined with its KV
  // (AddPrefilledRequest, AttachRequest) detaches before its first step too. FailedPrecondition
  // for a request that is not decoding (waiting for its prefill, preempted, prefilling): it stays
  // as it is. The request is gone
  // from the engine; no output follows.
  struct DetachedRequest {
    SequenceId seq = 0;
    std::vector<int32_t> prompt;
    std::vector<int32_t> output;  // non-empty
    int64_t num_computed_tokens() const { return int64_t(prompt.size() + output.size()) - 1; }
  };
  absl::StatusOr<DetachedRequest> Detach(const std::string& id);
  // The other end: a request whose `resumed` output (non-empty, its last token not computed)
  // continues from `reservation`, which holds the K/V of the prompt and all but that last token.
  // It joins the batch as a detached request left it; nothing is emitted until its next token.
  absl::Status AttachRequest(const std::string& id, std::vector<int32_t> prompt, SamplingParams params,
                             SequenceId reservation, const ResumedOutput& resumed);
  KvCache& kv_cache() { return *cache_; }
  // Requests to run, a launched step to collect (async scheduling), or collected outputs to give.
  bool HasUnfinished() const { return scheduler_.HasWork() || launched_.has_value() || !drained_outputs_.empty(); }
  // Tokens in the last Step's forward pass (0 when it ran none).
  int64_t last_step_num_tokens() const { return last_step_num_tokens_; }
  // Forgets the prefix cache's blocks on the device and in the host tier (vLLM's
  // reset_prefix_cache), e.g. after a warm-up whose requests run again. FailedPrecondition while
  // requests are unfinished.
  absl::Status ResetPrefixCache();
  // Work that waits for the engine to idle (indexing finished outputs for lookahead), done in
  // slices short enough not to delay an arriving request; returns whether more remains.
  bool RunIdleWork();

  // A finished request stays readable until Release (timings, logprobs).
  const Request* Find(const std::string& id) const;
  void Release(const std::string& id);

  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const ModelConfig& model_config() const { return model_->config(); }
  const EngineConfig& config() const { return config_; }
  EngineStats Stats() const;

 private:
  // One step's batch as the executor runs it: per scheduled chunk its tokens (new tokens, or
  // the root and drafts of a draft tree it verifies), the tree's parents (empty: no tree) and
  // its logits rows that score prompt tokens (prompt_logprobs; they come before a sampled row).
  // `chunks` point into `tokens` and `parents`.
  struct StepBatch {
    std::vector<std::vector<int32_t>> tokens;
    std::vector<std::vector<int32_t>> parents;
    std::vector<int32_t> num_prompt_logprob_rows;
    std::vector<SequenceChunk> chunks;
    int64_t num_tokens = 0;
  };

  // The parts of Step, in order: drafts for the scheduled decoding requests that got room for
  // them, the batch, the device-sampling rows (none: sample on the host from logits_), then,
  // after the forward, the sampled tokens applied to their requests (or every scheduled
  // request failed with the forward's error).
  absl::StatusOr<std::vector<RequestOutput>> ScheduleAndRun(const LayerDoneCallback& on_layer_done);
  void DraftScheduled(const SchedulerOutput& plan);
  StepBatch BuildBatch(const SchedulerOutput& plan) const;
  std::optional<std::vector<DeviceSamplingRow>> DeviceSamplingRows(const SchedulerOutput& plan,
                                                                   const StepBatch& batch);
  std::vector<RequestOutput> ApplySamples(const SchedulerOutput& plan, const StepBatch& batch, bool on_device);
  std::vector<RequestOutput> FailStep(const SchedulerOutput& plan, const absl::Status& error);
  // The target's token for logits row `row` of this step, under the request's grammar mask (of
  // the state after its tokens so far); nullopt when the grammar allows no token.
  std::optional<SampledToken> SampleRow(Request& r, int64_t row, bool on_device);
  // Scores the request's next `num_rows` prompt tokens from logits rows [first_row, + num_rows).
  void ScorePromptRows(Request& r, int64_t first_row, int32_t num_rows);
  // A speculating request that verified no drafts this step: tells the decoder whether its
  // planned guess (lookahead's tree, kept for this) foresaw `token`.
  void ScorePlannedGuess(Request& r, int32_t token);

  // Async scheduling. Whether the next step may be launched ahead of the collection of the one
  // launched before it; launching one (its samples become the requests' pending tokens); and
  // collecting the launched step: its samples applied, the blocks of requests that finished
  // while it ran freed. DrainLaunched collects it outside Step (before what needs every token
  // known), keeping its outputs for the next Step.
  bool CanLaunchAhead(const LayerDoneCallback& on_layer_done) const;
  absl::Status LaunchAhead(const SchedulerOutput& plan, const StepBatch& batch,
                           const std::vector<DeviceSamplingRow>& rows);
  std::vector<RequestOutput> CollectLaunched(const SchedulerOutput& step);
  // After a step planned late was launched: counts it, and whether it was launched too late.
  void CountLateLaunch();
  void DrainLaunched();
  // Counts the prompt tokens of a step's chunks (after OnStepDone).
  void CountPromptTokens(const SchedulerOutput& plan);

  // Appends a sampled token; finishes the request on EOS, stop id, stop string or length.
  void AppendToken(Request& r, const SampledToken& token, RequestOutput& out);
  void FinishRequest(Request& r, FinishReason reason);
  void FinishWithError(Request& r, const absl::Status& error, RequestOutput& out);
  // Sets the draft budget of every decoding request before the scheduler reserves its room.
  void PlanSpeculation();
  // Verifies request r's draft tree: `draw(node)` gives the target's token after tree node
  // `node` (sampled from that node's logits row, on the host or the device; nullopt: the grammar
  // allows none, which fails the request). Appends the accepted tokens and the target's next
  // one, then compacts the accepted K/V and frees the unused slots.
  void VerifyDraft(Request& r, const std::vector<int32_t>& tokens, const std::vector<int32_t>& parents,
                   const std::function<std::optional<SampledToken>(int32_t node)>& draw, RequestOutput& out);
  // Compiles the request's constraint (the compiler and its vocabulary are made on first use).
  absl::StatusOr<std::unique_ptr<grammar::GrammarMatcher>> NewGrammarMatcher(const grammar::StructuredOutput& c);
  // What fills the step's device-sampled grammar masks while the device computes (null: none).
  FillMasksCallback DeviceMaskFiller(const SchedulerOutput& plan);
  // Fills r.token_mask from its grammar; false when no token of the vocabulary may follow.
  bool FillTokenMask(Request& r);
  // Creates the host tier and turns the block manager's prefix cache on, as configured.
  absl::Status SetUpPrefixCache();
  // The host tier's copies for this step's evictions and hits, before anything uses the blocks.
  absl::Status FlushTierCopies(HostKvTier::FlushMode mode);
  absl::StatusOr<std::unique_ptr<Request>> NewRequest(const std::string& id, std::vector<int32_t> prompt,
                                                      SamplingParams params, SequenceId seq_id,
                                                      const ResumedOutput& resumed);
  // Makes `resumed` the output of the new request `r` (see ResumedOutput).
  absl::Status ResumeOutput(Request& r, const ResumedOutput& resumed);

  EngineConfig config_;
  std::unique_ptr<ModelExecutor> model_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::vector<int64_t> eos_token_ids_;
  BlockManager blocks_;
  std::unique_ptr<KvCache> cache_;
  Scheduler scheduler_;
  std::unique_ptr<HostKvTier> host_tier_;  // null: no host tier
  std::map<std::string, std::unique_ptr<Request>> requests_;
  SequenceId next_seq_id_ = 1;
  int64_t num_preemptions_ = 0;
  int64_t num_prompt_tokens_ = 0;      // EngineStats'
  int64_t num_generation_tokens_ = 0;  // EngineStats'
  int64_t last_step_num_tokens_ = 0;
  int64_t num_steps_ = 0;       // EngineStats'
  double step_seconds_ = 0;     // EngineStats'
  double forward_seconds_ = 0;  // EngineStats'
  std::vector<float> logits_;
  std::vector<DeviceSample> device_samples_;
  // Async scheduling: the launched step not yet collected; outputs collected outside Step; the
  // sequences of requests that finished while in it (freed once it is collected); requests
  // released while in it (destroyed then).
  std::optional<SchedulerOutput> launched_;
  std::vector<RequestOutput> drained_outputs_;
  std::vector<SequenceId> deferred_frees_;
  std::vector<std::unique_ptr<Request>> released_while_launched_;
  std::unique_ptr<SpeculativeDecoder> spec_;  // null: no request speculates
  std::unique_ptr<grammar::GrammarCompiler> grammar_compiler_;
  // Late scheduling: whether the step being planned waited for the launched one's midpoint; the
  // counts (EngineStats'); off once too many late launches were late.
  bool planned_late_ = false;
  int64_t num_late_scheduled_steps_ = 0;
  int64_t num_late_launches_ = 0;
  bool late_scheduling_off_ = false;
};

}  // namespace duet

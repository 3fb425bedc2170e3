// Async scheduling in the engine (EngineConfig::async_scheduling): each step launched before the
// previous one's tokens reach the host. With an executor whose tokens are a function of the K/V it
// reads, every request's output must be the one of steps run one at a time, through stops,
// aborts, preemption, prefix caching and seeded sampling; blocks of a request that finished
// while a launched step still writes them stay allocated until that step is collected. Late
// scheduling plans a step at the launched step's midpoint, so what arrives before it joins.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/status_macros.h"
#include "engine/engine_loop.h"
#include "engine/llm_engine.h"
#include "gtest/gtest.h"
#include "model/model_config.h"

namespace duet {
namespace {

constexpr char kModel[] = DUET_MODELS_DIR "/tiny-code-llama";

// A cache whose "K/V" of a slot is the token id written there ([num_blocks * block_size]).
class TokenKvCache : public KvCache {
 public:
  explicit TokenKvCache(const KvCacheShape& shape)
      : KvCache(shape), slots_(size_t(shape.num_blocks * shape.block_size), -1) {}
  MemorySpace memory_space() const override { return MemorySpace::kHost; }
  void* key_pool(int64_t) override { return slots_.data(); }
  void* value_pool(int64_t) override { return slots_.data(); }
  void CopyBlocks(const std::vector<BlockCopy>& copies) override {
    const int64_t bs = shape().block_size;
    for (const BlockCopy& c : copies) {
      std::copy_n(slots_.begin() + c.src * bs, bs, slots_.begin() + c.dst * bs);
    }
  }
  absl::Status CopyBlocksToHost(int64_t, int64_t, absl::Span<const BlockCopy>, const HostKvBlocks&) override {
    return absl::UnimplementedError("no host tier in this test");
  }
  absl::Status CopyBlocksFromHost(int64_t, int64_t, absl::Span<const BlockCopy>, const HostKvBlocks&) override {
    return absl::UnimplementedError("no host tier in this test");
  }
  std::vector<int32_t>& slots() { return slots_; }

 private:
  std::vector<int32_t> slots_;
};

// Writes each chunk token into its slot, then samples the token after a sampled row from a hash
// of the whole context as the cache holds it (and of the row's seed and offset when it draws),
// so a block freed or overwritten too early changes the output. Runs a step when it is given;
// with `launch_ahead`, LaunchSample resolves PreviousStepSample placeholders from the samples of
// the step before, as a device would. Its launched steps "reach their midpoint" when the engine
// waits for it (counted; `on_midpoint_wait` runs then), and are done by the next launch or not as
// `launches_late` says.
class ContextHashExecutor : public ModelExecutor {
 public:
  ContextHashExecutor(ModelConfig config, bool launch_ahead, int32_t eos)
      : config_(std::move(config)), launch_ahead_(launch_ahead), eos_(eos) {}
  const ModelConfig& config() const override { return config_; }
  KvDtype kv_dtype() const override { return KvDtype::kFloat32; }
  absl::StatusOr<std::unique_ptr<KvCache>> CreateKvCache(int64_t num_blocks, int64_t block_size) override {
    return std::unique_ptr<KvCache>(std::make_unique<TokenKvCache>(
        KvCacheShape{1, num_blocks, 1, block_size, 1, kv_dtype()}));
  }
  // The host sampler's logits: the greedy token of each row far above the rest.
  absl::Status Forward(absl::Span<const SequenceChunk> chunks, KvCache& cache, std::vector<float>& logits,
                       const LayerDoneCallback&) override {
    if (!launched_.empty()) return absl::FailedPreconditionError("a launched step is not collected");
    int64_t rows = 0;
    for (const SequenceChunk& c : chunks) rows += c.num_logits;
    std::vector<DeviceSample> samples;
    DUET_RETURN_IF_ERROR(Run(chunks, cache, std::vector<DeviceSamplingRow>(size_t(rows)), samples));
    logits.assign(size_t(rows) * size_t(config_.vocab_size), 0.0f);
    for (size_t i = 0; i < samples.size(); ++i) logits[i * size_t(config_.vocab_size) + size_t(samples[i].token)] = 100.0f;
    return absl::OkStatus();
  }
  bool CanSampleOnDevice() const override { return true; }
  absl::Status ForwardSample(absl::Span<const SequenceChunk> chunks, KvCache& cache,
                             absl::Span<const DeviceSamplingRow> rows, std::vector<DeviceSample>& samples,
                             const LayerDoneCallback&, const FillMasksCallback&) override {
    if (!launched_.empty()) return absl::FailedPreconditionError("a launched step is not collected");
    return Run(chunks, cache, rows, samples);
  }
  bool CanLaunchAhead() const override { return launch_ahead_; }
  absl::Status LaunchSample(absl::Span<const SequenceChunk> chunks, KvCache& cache,
                            absl::Span<const DeviceSamplingRow> rows) override {
    if (launched_.size() == 2) return absl::FailedPreconditionError("two launched steps are not collected");
    std::vector<DeviceSample> samples;
    DUET_RETURN_IF_ERROR(Run(chunks, cache, rows, samples));
    launched_.push_back(std::move(samples));
    ++num_launched_;
    for (const SequenceChunk& c : chunks) {
      if (c.start_position == 0 && !c.tokens.empty()) first_launch_starting_.emplace(c.tokens[0], num_launched_);
    }
    return absl::OkStatus();
  }
  absl::Status CollectSamples(std::vector<DeviceSample>& samples) override {
    if (launched_.empty()) return absl::FailedPreconditionError("nothing launched");
    samples = std::move(launched_.front());
    launched_.pop_front();
    return absl::OkStatus();
  }
  void WaitForLaunchedStepMidpoint() override {
    ++num_midpoint_waits_;
    if (on_midpoint_wait) on_midpoint_wait();
  }
  bool OldestLaunchedStepDone() override { return launches_late && !launched_.empty(); }
  int64_t num_launched() const { return num_launched_; }
  int64_t num_midpoint_waits() const { return num_midpoint_waits_; }
  // The launch (1-based) of the first chunk that starts a sequence with `token`, 0 if none did.
  int64_t FirstLaunchStarting(int32_t token) const {
    auto it = first_launch_starting_.find(token);
    return it == first_launch_starting_.end() ? 0 : it->second;
  }

  std::function<void()> on_midpoint_wait;
  bool launches_late = false;

 private:
  absl::Status Run(absl::Span<const SequenceChunk> chunks, KvCache& cache, absl::Span<const DeviceSamplingRow> rows,
                   std::vector<DeviceSample>& samples) {
    std::vector<int32_t>& slots = static_cast<TokenKvCache&>(cache).slots();
    const int64_t bs = cache.shape().block_size;
    auto slot = [&](const SequenceChunk& c, int64_t pos) -> int32_t& {
      return slots[size_t(c.block_table[size_t(pos / bs)] * bs + pos % bs)];
    };
    std::vector<DeviceSample> out;
    size_t row = 0;
    for (const SequenceChunk& c : chunks) {
      for (size_t j = 0; j < c.tokens.size(); ++j) {
        int32_t token = c.tokens[j];
        if (IsPreviousStepSample(token)) {
          const int32_t previous_row = PreviousStepSampleRow(token);
          if (size_t(previous_row) >= last_samples_.size()) return absl::InternalError("no such previous row");
          token = last_samples_[size_t(previous_row)].token;
        }
        if (token < 0 || token >= config_.vocab_size) return absl::InvalidArgumentError("token out of range");
        slot(c, c.start_position + int64_t(j)) = token;
      }
      if (c.num_logits == 0) continue;
      if (row >= rows.size()) return absl::InvalidArgumentError("fewer sampling rows than logits rows");
      const DeviceSamplingRow& r = rows[row++];
      uint64_t h = 1469598103934665603ull;
      const int64_t end = c.start_position + int64_t(c.tokens.size());
      for (int64_t pos = 0; pos < end; ++pos) h = (h ^ uint64_t(uint32_t(slot(c, pos)))) * 1099511628211ull;
      if (r.temperature > 0) h = (h ^ r.seed ^ (r.offset << 32)) * 1099511628211ull;
      h ^= h >> 29;
      // EOS about one token in 40, the rest spread over the vocabulary.
      const int32_t token = h % 40 == 0 ? eos_ : int32_t(3 + (h >> 8) % uint64_t(config_.vocab_size - 3));
      out.push_back(DeviceSample{token, -float(h % 1000) / 100.0f});
    }
    if (row != rows.size()) return absl::InvalidArgumentError("more sampling rows than logits rows");
    last_samples_ = out;
    samples = std::move(out);
    return absl::OkStatus();
  }

  ModelConfig config_;
  bool launch_ahead_;
  int32_t eos_;
  std::vector<DeviceSample> last_samples_;
  std::deque<std::vector<DeviceSample>> launched_;
  int64_t num_launched_ = 0;
  int64_t num_midpoint_waits_ = 0;
  std::map<int32_t, int64_t> first_launch_starting_;
};

SamplingParams Greedy(int32_t max_tokens) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

struct Finished {
  std::vector<int32_t> tokens;
  std::string text;
  FinishReason reason = FinishReason::kNone;
};

struct Engine {
  std::unique_ptr<LlmEngine> engine;
  ContextHashExecutor* executor = nullptr;
};

Engine NewEngine(bool async, int32_t num_kv_blocks, bool prefix_caching, bool late = true) {
  absl::StatusOr<ModelConfig> model = LoadModelConfig(kModel);
  EXPECT_TRUE(model.ok()) << model.status();
  EngineConfig config;
  config.model_dir = kModel;
  config.num_kv_blocks = num_kv_blocks;
  config.block_size = 4;
  config.enable_prefix_caching = prefix_caching;
  config.async_scheduling = async;
  config.late_scheduling = late;
  config.scheduler.max_num_seqs = 12;
  config.scheduler.max_num_batched_tokens = 64;
  config.scheduler.max_num_mixed_tokens = 24;
  config.scheduler.max_model_len = 512;
  Engine e;
  absl::StatusOr<std::unique_ptr<LlmEngine>> created =
      LlmEngine::Create(config, [&](const EngineConfig&) -> absl::StatusOr<std::unique_ptr<ModelExecutor>> {
        // The tiny model's EOS (token 1) ends some requests.
        auto executor = std::make_unique<ContextHashExecutor>(*model, /*launch_ahead=*/true, 1);
        e.executor = executor.get();
        return std::unique_ptr<ModelExecutor>(std::move(executor));
      });
  EXPECT_TRUE(created.ok()) << created.status();
  e.engine = std::move(*created);
  return e;
}

// Forty requests in a closed loop of twelve: prompts sharing prefixes, greedy and seeded draws,
// EOS and stop ids, max_tokens from 1 to 60, one request aborted once it has 5 tokens. Returns
// what each request produced in `finished`.
void RunWorkload(Engine& e, std::map<std::string, Finished>& finished) {
  std::map<std::string, Finished> streaming;
  int next = 0;
  constexpr int kRequests = 40;
  auto add = [&] {
    const int i = next++;
    std::vector<int32_t> prompt;
    for (int t = 0; t < 9 + (i * 7) % 23; ++t) prompt.push_back(int32_t(100 + (t < 8 ? t : i * 31 + t) % 5000));
    SamplingParams p;
    p.temperature = 0.0f;
    p.max_tokens = 1 + (i * 13) % 60;
    p.ignore_eos = i % 3 == 0;
    if (i % 4 == 1) {
      p.temperature = 0.8f;
      p.seed = uint64_t(i);
    }
    if (i % 5 == 2) p.stop_token_ids = {int32_t(3 + i)};
    const std::string id = "r" + std::to_string(i);
    ASSERT_TRUE(e.engine->AddRequest(id, std::move(prompt), p).ok());
    streaming[id];
  };
  for (int i = 0; i < 12; ++i) add();
  int steps = 0;
  while (e.engine->HasUnfinished()) {
    ASSERT_LT(++steps, 10000);
    e.engine->WaitForSchedulingPoint();  // as an EngineLoop does
    absl::StatusOr<std::vector<RequestOutput>> outputs = e.engine->Step();
    ASSERT_TRUE(outputs.ok()) << outputs.status();
    for (const RequestOutput& out : *outputs) {
      Finished& f = streaming.at(out.id);
      f.tokens.insert(f.tokens.end(), out.new_token_ids.begin(), out.new_token_ids.end());
      f.text += out.new_text;
      if (!out.finished) continue;
      f.reason = out.finish_reason;
      finished[out.id] = std::move(f);
      streaming.erase(out.id);
      e.engine->Release(out.id);
      if (next < kRequests) add();
    }
    auto aborted = streaming.find("r7");
    if (aborted != streaming.end() && aborted->second.tokens.size() >= 5) {
      ASSERT_TRUE(e.engine->Abort("r7"));
      aborted->second.reason = FinishReason::kAbort;
      finished["r7"] = std::move(aborted->second);
      streaming.erase(aborted);
      e.engine->Release("r7");
      if (next < kRequests) add();
    }
  }
  EXPECT_TRUE(streaming.empty());
}

void ExpectSameOutputs(const std::map<std::string, Finished>& got, const std::map<std::string, Finished>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [id, w] : want) {
    const Finished& g = got.at(id);
    EXPECT_EQ(g.tokens, w.tokens) << id;
    EXPECT_EQ(g.text, w.text) << id;
    EXPECT_EQ(g.reason, w.reason) << id;
  }
}

// The workload on an engine running steps one at a time and on one launching them ahead: the
// same outputs, and nothing leaked. Returns the second engine's stats and the first's outputs.
std::pair<EngineStats, std::map<std::string, Finished>> ExpectAsyncOutputsEqual(int32_t num_kv_blocks,
                                                                               bool prefix_caching) {
  Engine one_at_a_time = NewEngine(/*async=*/false, num_kv_blocks, prefix_caching);
  Engine ahead = NewEngine(/*async=*/true, num_kv_blocks, prefix_caching);
  std::map<std::string, Finished> want, got;
  RunWorkload(one_at_a_time, want);
  RunWorkload(ahead, got);
  EXPECT_EQ(one_at_a_time.executor->num_launched(), 0);
  EXPECT_GT(ahead.executor->num_launched(), 100);
  ExpectSameOutputs(got, want);
  const EngineStats stats = ahead.engine->Stats();
  EXPECT_EQ(stats.num_free_kv_blocks, stats.num_kv_blocks);  // nothing leaked
  return {stats, want};
}

TEST(LlmEngineAsyncTest, OutputsEqualStepsOneAtATime) {
  const auto [stats, want] = ExpectAsyncOutputsEqual(1024, /*prefix_caching=*/true);
  int stops = 0, lengths = 0;
  for (const auto& [id, f] : want) (f.reason == FinishReason::kStop ? stops : lengths) += 1;
  EXPECT_GT(stops, 3);  // the workload stops some requests on EOS and stop ids
  EXPECT_GT(lengths, 3);
}

// 40 blocks of 4 tokens for twelve running requests of up to ~90 tokens: preemption (with the
// prefix cache: evictions, and preempted requests finding their own blocks again).
TEST(LlmEngineAsyncTest, OutputsEqualUnderPreemption) {
  EXPECT_GT(ExpectAsyncOutputsEqual(40, /*prefix_caching=*/false).first.num_preemptions, 0);
}

TEST(LlmEngineAsyncTest, OutputsEqualUnderPreemptionWithThePrefixCache) {
  EXPECT_GT(ExpectAsyncOutputsEqual(40, /*prefix_caching=*/true).first.num_preemptions, 0);
}

// The workload with late scheduling: each step after the first launched one is planned at the
// launched step's midpoint; the outputs are those of steps one at a time either way.
TEST(LlmEngineAsyncTest, LateSchedulingPlansAtTheMidpointWithTheSameOutputs) {
  Engine one_at_a_time = NewEngine(/*async=*/false, 1024, /*prefix_caching=*/true);
  Engine late = NewEngine(/*async=*/true, 1024, /*prefix_caching=*/true);
  Engine at_once = NewEngine(/*async=*/true, 1024, /*prefix_caching=*/true, /*late=*/false);
  std::map<std::string, Finished> want, got_late, got_at_once;
  RunWorkload(one_at_a_time, want);
  RunWorkload(late, got_late);
  RunWorkload(at_once, got_at_once);
  ExpectSameOutputs(got_late, want);
  ExpectSameOutputs(got_at_once, want);
  EXPECT_EQ(one_at_a_time.executor->num_midpoint_waits(), 0);
  EXPECT_EQ(at_once.executor->num_midpoint_waits(), 0);
  const EngineStats stats = late.engine->Stats();
  EXPECT_GT(stats.num_late_scheduled_steps, 100);
  EXPECT_EQ(stats.num_late_launches, 0);
  // Every wait had a launched step and every step planned after one was launched ahead of it,
  // except those that ran no forward pass or ran one at a time.
  EXPECT_GE(late.executor->num_midpoint_waits(), stats.num_late_scheduled_steps);
  EXPECT_LE(late.executor->num_midpoint_waits(), late.executor->num_launched());
  EXPECT_EQ(at_once.engine->Stats().num_late_scheduled_steps, 0);
}

// A device that finishes each step before the host has launched the next one planned late: after
// 64 such steps the engine plans each step as soon as the one before is launched again.
TEST(LlmEngineAsyncTest, LateSchedulingTurnsItselfOffWhenLaunchesAreLate) {
  Engine e = NewEngine(/*async=*/true, 1024, /*prefix_caching=*/true);
  e.executor->launches_late = true;
  std::map<std::string, Finished> got;
  RunWorkload(e, got);
  const EngineStats stats = e.engine->Stats();
  EXPECT_EQ(stats.num_late_scheduled_steps, 64);
  EXPECT_EQ(stats.num_late_launches, 64);
  EXPECT_EQ(e.executor->num_midpoint_waits(), 64);
  EXPECT_GT(e.executor->num_launched(), 100);
  Engine one_at_a_time = NewEngine(/*async=*/false, 1024, /*prefix_caching=*/true);
  std::map<std::string, Finished> want;
  RunWorkload(one_at_a_time, want);
  ExpectSameOutputs(got, want);
}

// In an EngineLoop: a request posted while the loop waits for the launched step's midpoint is in
// the very next step launched (without late scheduling it would wait for the one after).
TEST(LlmEngineAsyncTest, ARequestPostedBeforeTheMidpointJoinsTheNextStep) {
  Engine e = NewEngine(/*async=*/true, 1024, /*prefix_caching=*/false);
  ContextHashExecutor* executor = e.executor;
  EngineLoop* loop_ptr = nullptr;
  std::mutex mu;
  std::condition_variable cv;
  bool b_finished = false;
  int64_t launched_at_post = -1;
  constexpr int32_t kMarker = 4321;  // the first token of b's prompt
  auto add_b = [&](LlmEngine& engine) {
    EXPECT_TRUE(engine.AddRequest("b", {kMarker, 7, 8}, Greedy(4)).ok());
    loop_ptr->Subscribe("b", [&](const RequestOutput& out) {
      if (!out.finished) return;
      std::lock_guard<std::mutex> lock(mu);
      b_finished = true;
      cv.notify_all();
    });
  };
  // Runs on the loop thread, inside the wait: the third midpoint posts b.
  int waits = 0;
  executor->on_midpoint_wait = [&] {
    if (++waits != 3) return;
    launched_at_post = executor->num_launched();
    loop_ptr->Post(add_b);
  };
  EngineLoop loop(std::move(e.engine));
  loop_ptr = &loop;
  loop.Call([&](LlmEngine& engine) {
    EXPECT_TRUE(engine.AddRequest("a", {5, 6, 7, 8, 9}, Greedy(40)).ok());
    loop.Subscribe("a", [](const RequestOutput&) {});
  });
  std::unique_lock<std::mutex> lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(30), [&] { return b_finished; }));
  lock.unlock();
  ASSERT_GT(launched_at_post, 0);
  EXPECT_EQ(executor->FirstLaunchStarting(kMarker), launched_at_post + 1);
}

TEST(LlmEngineAsyncTest, BlocksOfARequestStoppedInALaunchedStepWaitForIt) {
  Engine e = NewEngine(/*async=*/true, 64, /*prefix_caching=*/false);
  ASSERT_TRUE(e.engine->AddRequest("a", {5, 6, 7, 8, 9}, Greedy(50)).ok());
  // The first step is launched and gives nothing yet; each later one collects the step before.
  absl::StatusOr<std::vector<RequestOutput>> first = e.engine->Step();
  ASSERT_TRUE(first.ok());
  EXPECT_TRUE(first->empty());
  absl::StatusOr<std::vector<RequestOutput>> second = e.engine->Step();
  ASSERT_TRUE(second.ok());
  ASSERT_EQ(second->size(), 1u);
  // Aborted while a launched step computes its next token: its blocks stay until that step is
  // collected, and the token it samples is dropped.
  ASSERT_TRUE(e.engine->Abort("a"));
  e.engine->Release("a");
  EXPECT_LT(e.engine->Stats().num_free_kv_blocks, 64);
  EXPECT_TRUE(e.engine->HasUnfinished());
  absl::StatusOr<std::vector<RequestOutput>> third = e.engine->Step();
  ASSERT_TRUE(third.ok());
  EXPECT_TRUE(third->empty());
  EXPECT_EQ(e.engine->Stats().num_free_kv_blocks, 64);
  EXPECT_FALSE(e.engine->HasUnfinished());
}

TEST(LlmEngineAsyncTest, RequestsThatSampleOnTheHostRunStepsOneAtATime) {
  Engine e = NewEngine(/*async=*/true, 256, /*prefix_caching=*/false);
  const SamplingParams plain = Greedy(8);
  SamplingParams penalized = Greedy(20);
  penalized.repetition_penalty = 1.2f;  // the host sampler's
  ASSERT_TRUE(e.engine->AddRequest("plain", {5, 6, 7}, plain).ok());
  ASSERT_TRUE(e.engine->Step().ok());
  EXPECT_EQ(e.executor->num_launched(), 1);
  ASSERT_TRUE(e.engine->AddRequest("penalized", {5, 6, 7}, penalized).ok());
  // The launched step is collected first; no step is launched while "penalized" is unfinished.
  std::map<std::string, size_t> tokens;
  while (e.engine->Find("penalized")->state != RequestState::kFinished) {
    absl::StatusOr<std::vector<RequestOutput>> outputs = e.engine->Step();
    ASSERT_TRUE(outputs.ok()) << outputs.status();
    for (const RequestOutput& out : *outputs) tokens[out.id] += out.new_token_ids.size();
    EXPECT_EQ(e.executor->num_launched(), 1);
  }
  EXPECT_EQ(tokens["plain"], 8u);
  EXPECT_EQ(tokens["penalized"], 20u);
}

// As a worker runs it: an EngineLoop streams each request's tokens to its subscriber once, in
// order, ends it with the finishing output (an abort's too: its launched token is dropped), and
// releases it while a launched step may still hold it; the tokens are those of steps one at a time.
std::map<std::string, Finished> StreamThroughALoop(bool async) {
  Engine e = NewEngine(async, 1024, /*prefix_caching=*/true);
  EngineLoop loop(std::move(e.engine));
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, Finished> finished;
  constexpr int kRequests = 24;
  for (int i = 0; i < kRequests; ++i) {
    const std::string id = "r" + std::to_string(i);
    loop.Call([&, i, id](LlmEngine& engine) {
      SamplingParams p;
      p.temperature = i % 4 == 1 ? 0.8f : 0.0f;
      p.seed = uint64_t(i);
      p.max_tokens = 4 + (i * 11) % 40;
      p.ignore_eos = i % 2 == 0;
      std::vector<int32_t> prompt;
      for (int t = 0; t < 6 + i % 9; ++t) prompt.push_back(int32_t(200 + (t < 4 ? t : i * 17 + t) % 3000));
      EXPECT_TRUE(engine.AddRequest(id, std::move(prompt), p).ok());
      auto streamed = std::make_shared<Finished>();
      loop.Subscribe(id, [&, id, streamed](const RequestOutput& out) {
        streamed->tokens.insert(streamed->tokens.end(), out.new_token_ids.begin(), out.new_token_ids.end());
        streamed->text += out.new_text;
        if (id == "r5" && !out.finished && streamed->tokens.size() >= 3) loop.Abort(id);
        if (!out.finished) return;
        streamed->reason = out.finish_reason;
        std::lock_guard<std::mutex> lock(mu);
        EXPECT_EQ(finished.count(id), 0u) << id << " finished twice";
        finished[id] = *streamed;
        cv.notify_all();
      });
    });
  }
  std::unique_lock<std::mutex> lock(mu);
  EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(30), [&] { return finished.size() == size_t(kRequests); }));
  lock.unlock();
  // The last launched step is collected (and its held blocks freed) once the loop runs out of work.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (loop.Stats().num_free_kv_blocks != loop.Stats().num_kv_blocks && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(loop.Stats().num_free_kv_blocks, loop.Stats().num_kv_blocks);
  EXPECT_EQ(loop.Call([](LlmEngine& engine) { return engine.HasUnfinished(); }), false);
  lock.lock();
  return finished;
}

TEST(LlmEngineAsyncTest, AnEngineLoopStreamsTheTokensOfStepsOneAtATime) {
  const std::map<std::string, Finished> want = StreamThroughALoop(false), got = StreamThroughALoop(true);
  ExpectSameOutputs(got, want);
  EXPECT_EQ(want.at("r5").reason, FinishReason::kAbort);
}

}  // namespace
}  // namespace duet

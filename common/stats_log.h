// vLLM's periodic stats line in the log of a long-running process (its LoggingStatLogger):
//
//   decode worker: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 412.3 tokens/s,
//   Running: 12 reqs, Waiting: 0 reqs, CPU KV cache usage: 37.5%, Prefix cache hit rate: 61.2%,
//   Steps: 104.2/s, 9.60 ms each, forward 8.90 ms
//
// (the steps are Duet's own: an engine's step time and its forward pass's part of it), written
// every interval by a thread that waits on a condition with a deadline (so it stops at once). As
// in vLLM, an interval with no tokens after another with none is logged at DEBUG only, so an idle
// server does not fill its log.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

namespace duet {

// What a process did over one interval, and its state at the end of it.
struct IntervalStats {
  double seconds = 0;
  int64_t prompt_tokens = 0;      // in the interval
  int64_t generation_tokens = 0;  // in the interval
  int64_t running = 0;
  int64_t waiting = 0;
  // The KV cache's share in use (0..1) and whose memory it is ("GPU", "CPU"); none: no cache.
  std::optional<double> kv_cache_usage;
  std::string kv_cache_device;
  // Prompt tokens found cached over those looked up in the interval; none: no prefix caching.
  std::optional<double> prefix_cache_hit_rate;
  // An engine's steps in the interval, their wall time and its part in the forward pass (the
  // rest: host work, which the device waits through unless steps are launched ahead). Shown only
  // when there were steps.
  int64_t steps = 0;
  double step_seconds = 0;
  double forward_seconds = 0;
  // Host time between those steps (an engine loop's): handing outputs to their streams, and
  // running posted work (new requests, aborts). Shown when there was some.
  double delivery_seconds = 0;
  double posted_seconds = 0;
  // Late scheduling (EngineConfig::late_scheduling): steps planned at the launched step's midpoint,
  // and those launched after the device had finished the step before. Shown when there were some.
  int64_t late_scheduled_steps = 0;
  int64_t late_launches = 0;

  bool idle() const { return prompt_tokens == 0 && generation_tokens == 0; }
  // A step's mean wall time and forward time in the interval, in ms (0 without steps).
  double step_ms() const { return steps > 0 ? 1e3 * step_seconds / double(steps) : 0.0; }
  double forward_ms() const { return steps > 0 ? 1e3 * forward_seconds / double(steps) : 0.0; }
};

// The line after "<label>: " (percentages and rates with one decimal, as vLLM prints them).
std::string FormatStatsLine(const IntervalStats& stats);

// Logs "<label>: FormatStatsLine(sample(seconds))" every `interval` on its own thread, where
// `seconds` is the time since the previous sample (since the start for the first). `sample`
// runs on that thread only.
class PeriodicStatsLogger {
 public:
  using Sample = std::function<IntervalStats(double seconds)>;
  PeriodicStatsLogger(std::string label, std::chrono::milliseconds interval, Sample sample);
  ~PeriodicStatsLogger();  // stops without waiting for the interval to end
  PeriodicStatsLogger(const PeriodicStatsLogger&) = delete;
  PeriodicStatsLogger& operator=(const PeriodicStatsLogger&) = delete;

 private:
  void Run();

  const std::string label_;
  const std::chrono::milliseconds interval_;
  const Sample sample_;
  std::mutex mu_;
  std::condition_variable stop_;
  bool stopping_ = false;  // guarded by mu_
  std::thread thread_;     // last: started once the rest exists
};

}  // namespace duet

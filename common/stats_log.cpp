#include "common/stats_log.h"

#include "absl/strings/str_format.h"
#include "common/logging.h"

namespace duet {

std::string FormatStatsLine(const IntervalStats& s) {
  const double per_s = s.seconds > 0 ? 1.0 / s.seconds : 0.0;
  std::string line = absl::StrFormat(
      "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
      "Waiting: %d reqs",
      double(s.prompt_tokens) * per_s, double(s.generation_tokens) * per_s, s.running, s.waiting);
  if (s.kv_cache_usage) {
    absl::StrAppendFormat(&line, ", %s KV cache usage: %.1f%%", s.kv_cache_device, 100 * *s.kv_cache_usage);
  }
  if (s.prefix_cache_hit_rate) absl::StrAppendFormat(&line, ", Prefix cache hit rate: %.1f%%", 100 * *s.prefix_cache_hit_rate);
  if (s.steps > 0) {
    absl::StrAppendFormat(&line, ", Steps: %.1f/s, %.2f ms each, forward %.2f ms", double(s.steps) * per_s,
                          s.step_ms(), s.forward_ms());
    if (s.delivery_seconds > 0 || s.posted_seconds > 0) {
      absl::StrAppendFormat(&line, ", between steps: delivery %.2f ms, posted work %.2f ms",
                            1e3 * s.delivery_seconds / double(s.steps), 1e3 * s.posted_seconds / double(s.steps));
    }
    if (s.late_scheduled_steps > 0) {
      absl::StrAppendFormat(&line, ", planned late: %d steps, %d launched late", s.late_scheduled_steps,
                            s.late_launches);
    }
  }
  return line;
}

PeriodicStatsLogger::PeriodicStatsLogger(std::string label, std::chrono::milliseconds interval, Sample sample)
    : label_(std::move(label)), interval_(interval), sample_(std::move(sample)), thread_([this] { Run(); }) {}

PeriodicStatsLogger::~PeriodicStatsLogger() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  stop_.notify_all();
  thread_.join();
}

void PeriodicStatsLogger::Run() {
  using Clock = std::chrono::steady_clock;
  Clock::time_point last = Clock::now();
  bool was_idle = false;
  std::unique_lock lock(mu_);
  while (!stop_.wait_until(lock, last + interval_, [this] { return stopping_; })) {
    lock.unlock();
    const Clock::time_point now = Clock::now();
    const IntervalStats stats = sample_(std::chrono::duration<double>(now - last).count());
    last = now;
    if (stats.idle() && was_idle) {
      DUET_LOG(DEBUG) << label_ << ": " << FormatStatsLine(stats);
    } else {
      DUET_LOG(INFO) << label_ << ": " << FormatStatsLine(stats);
    }
    was_idle = stats.idle();
    lock.lock();
  }
}

}  // namespace duet

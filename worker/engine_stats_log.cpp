#include "worker/engine_stats_log.h"

#include <filesystem>
#include <utility>

#include "absl/strings/str_format.h"
#include "backends/executor_factory.h"
#include "rpc/rpc_util.h"

namespace duet {

std::string EngineConfigSummary(LlmEngine& engine) {
  const EngineConfig& config = engine.config();
  const metrics::CacheConfig cache = rpc::CacheConfigOf(engine);
  const int64_t max_model_len = config.scheduler.max_model_len;
  const int64_t blocks_per_request = (max_model_len + cache.block_size - 1) / cache.block_size;
  const double bytes = double(engine.kv_cache().shape().bytes_per_block()) * double(cache.num_gpu_blocks);
  return absl::StrFormat(
      "model %s (%s), backend %s, dtype %s, block size %d, %d KV blocks (%d tokens, %.1f MiB), max model len %d: "
      "max concurrency %.2fx, prefix caching %s",
      std::filesystem::path(config.model_dir).filename().string(), engine.model_config().architecture,
      ResolveBackend(config.backend), cache.cache_dtype, cache.block_size, cache.num_gpu_blocks,
      cache.num_gpu_blocks * cache.block_size, bytes / double(1 << 20), max_model_len,
      blocks_per_request > 0 ? double(cache.num_gpu_blocks) / double(blocks_per_request) : 0.0,
      config.enable_prefix_caching ? "on" : "off");
}

EngineStatsLabels EngineStatsLabelsOf(LlmEngine& engine) {
  return {.kv_cache_device = ResolveBackend(engine.config().backend) == "cuda" ? "GPU" : "CPU",
          .prefix_caching = engine.config().enable_prefix_caching};
}

IntervalStats EngineIntervalStats(const EngineStats& before, const EngineStats& now, double seconds,
                                  const EngineStatsLabels& labels) {
  IntervalStats s{.seconds = seconds,
                  .prompt_tokens = now.num_prompt_tokens - before.num_prompt_tokens,
                  .generation_tokens = now.num_generation_tokens - before.num_generation_tokens,
                  .running = now.num_running,
                  .waiting = now.num_waiting,
                  .kv_cache_usage = rpc::KvCacheUsage(now),
                  .kv_cache_device = labels.kv_cache_device,
                  .steps = now.num_steps - before.num_steps,
                  .step_seconds = now.step_seconds - before.step_seconds,
                  .forward_seconds = now.forward_seconds - before.forward_seconds,
                  .delivery_seconds = now.delivery_seconds - before.delivery_seconds,
                  .posted_seconds = now.posted_seconds - before.posted_seconds,
                  .late_scheduled_steps = now.num_late_scheduled_steps - before.num_late_scheduled_steps,
                  .late_launches = now.num_late_launches - before.num_late_launches};
  if (labels.prefix_caching) {
    const int64_t queries = now.prefix_cache_queries - before.prefix_cache_queries;
    s.prefix_cache_hit_rate = queries > 0 ? double(now.prefix_cache_hits - before.prefix_cache_hits) / double(queries) : 0.0;
  }
  return s;
}

PeriodicStatsLogger::Sample EngineStatsSample(std::function<EngineStats()> stats, EngineStatsLabels labels) {
  return [stats = std::move(stats), labels = std::move(labels), before = EngineStats()](double seconds) mutable {
    const EngineStats now = stats();
    const IntervalStats interval = EngineIntervalStats(before, now, seconds, labels);
    before = now;
    return interval;
  };
}

}  // namespace duet

// What a worker (or `duet generate`) logs about its engine: a one-time summary of its
// configuration and KV capacity at start-up, and vLLM's periodic stats line (common/stats_log.h)
// from the engine's counters.
#pragma once

#include <functional>
#include <string>

#include "common/stats_log.h"
#include "engine/llm_engine.h"

namespace duet {

// "model tiny-code-llama (LlamaForCausalLM), backend cpu, dtype float32, block size 16, 256 KV
// blocks (4096 tokens, 8.0 MiB), max model len 2048: max concurrency 2.00x, prefix caching on"
// (max concurrency: how many requests of max-model-len tokens the KV blocks hold at once, as
// vLLM's "Maximum concurrency for N tokens per request").
std::string EngineConfigSummary(LlmEngine& engine);

// How an engine's stats are shown: "GPU" or "CPU" memory for the KV cache, and whether the
// prefix cache hit rate is (prefix caching on).
struct EngineStatsLabels {
  std::string kv_cache_device = "CPU";
  bool prefix_caching = false;
};
EngineStatsLabels EngineStatsLabelsOf(LlmEngine& engine);

// The interval from `before` to `now`, `seconds` long: tokens and prefix-cache lookups in it,
// requests and KV use at its end.
IntervalStats EngineIntervalStats(const EngineStats& before, const EngineStats& now, double seconds,
                                  const EngineStatsLabels& labels);

// A PeriodicStatsLogger sample over `stats()` (read from the logger's thread): each call the
// interval since the previous one.
PeriodicStatsLogger::Sample EngineStatsSample(std::function<EngineStats()> stats, EngineStatsLabels labels);

}  // namespace duet

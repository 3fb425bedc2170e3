// vLLM's stats-logging flags, on `duet router`, the workers and `duet serve` (which passes them
// on): --log-stats-interval SECONDS (0: off) and --disable-log-stats.
#pragma once

#include "CLI/CLI.hpp"

namespace duet {

struct LogStatsFlags {
  double interval_s = 10;
  bool disabled = false;

  void Add(CLI::App* cmd) {
    cmd->add_option("--log-stats-interval", interval_s,
                    "Seconds between the stats lines in the log (throughput, running and waiting requests, KV "
                    "cache use, prefix cache hit rate; 0: none)")
        ->check(CLI::Range(0.0, 86400.0));
    cmd->add_flag("--disable-log-stats", disabled, "No stats lines in the log (as --log-stats-interval 0)");
  }
  // The interval asked for; 0: no stats lines.
  double seconds() const { return disabled ? 0 : interval_s; }
};

}  // namespace duet

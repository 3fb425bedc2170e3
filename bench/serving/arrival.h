// When each benchmark request is sent: an open-loop arrival process (Poisson at a rate, or gamma
// with a burstiness shape, as vLLM's benchmark_serving does; all at once for rate inf), and the
// dispatcher that sends on that schedule, optionally capped at a number of requests in flight
// (with rate inf and a cap, a closed loop: a new request goes out as soon as one finishes).
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "absl/status/statusor.h"

namespace duet::bench {

struct ArrivalOptions {
  double request_rate = std::numeric_limits<double>::infinity();  // requests/s; inf: all at t=0
  // Gamma shape: 1 is Poisson; below 1 burstier, above 1 more regular. The mean rate stays
  // request_rate (scale = 1 / (rate * burstiness)).
  double burstiness = 1.0;
  uint64_t seed = 0;
};

// Send times of `count` requests in seconds from the start: the first at 0, then cumulative
// gamma-distributed gaps. Same seed, same schedule.
absl::StatusOr<std::vector<double>> ArrivalSchedule(int count, const ArrivalOptions& options);

// Sends request i (by calling `send(i, done)`) no earlier than schedule[i] seconds after the
// call, with at most `max_concurrency` requests in flight (0: no cap); a request is in flight
// from its send until it calls `done` (from any thread). Returns once every request is done.
using SendFn = std::function<void(int index, std::function<void()> done)>;
void Dispatch(const std::vector<double>& schedule, int max_concurrency, const SendFn& send);

// Sessions of `turns` requests each (multi-turn chats): session s's turn 0 is sent no earlier
// than session_starts[s] seconds after the call (the starts ascending), each later turn as soon
// as the session's previous turn is done; requests ready to go wait, in the order they became
// ready, while `max_concurrency` are in flight (0: no cap). Returns once every turn is done.
using SessionSendFn = std::function<void(int session, int turn, std::function<void()> done)>;
void DispatchSessions(const std::vector<double>& session_starts, int turns, int max_concurrency,
                      const SessionSendFn& send);

}  // namespace duet::bench

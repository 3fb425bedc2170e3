// What the benchmark sends and the interface every backend implements.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bench/serving/metrics.h"

namespace duet::bench {

// Seconds from `start` until now.
inline double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::string content;
};

// A run's sampling settings (vLLM bench serve's --temperature, --top-p, ...): unset ones are the
// server's, except the temperature, greedy (0) unless given.
struct SamplingFlags {
  std::optional<double> temperature, top_p, min_p, frequency_penalty, presence_penalty, repetition_penalty;
  std::optional<int> top_k;
};

// Extra HTTP headers / gRPC metadata (--header KEY=VALUE) sent with every request.
using Headers = std::vector<std::pair<std::string, std::string>>;

// One request as sent, streamed, as vLLM's benchmark does.
struct ClientRequest {
  std::string prompt;
  // openai-chat: the conversation, sent instead of one user message holding `prompt`.
  std::vector<ChatMessage> messages;
  int max_tokens = 16;
  bool ignore_eos = false;
};

class Client {
 public:
  virtual ~Client() = default;
  // Starts the request and returns at once; `done` is called exactly once, from any thread, with
  // the request's timeline (times measured from this call).
  virtual void Send(const ClientRequest& request, std::function<void(RequestResult)> done) = 0;
};

}  // namespace duet::bench

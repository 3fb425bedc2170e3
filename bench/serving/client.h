// What the benchmark sends and the interface every backend implements.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "bench/serving/metrics.h"

namespace duet::bench {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::string content;
};

// One request as sent: greedy (temperature 0), streamed, as vLLM's benchmark does.
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

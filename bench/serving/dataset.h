// Benchmark workloads: what each request sends and how many tokens it asks for.
//   random         prompts of random tokens with lengths uniform in
//                  [input_len·(1−range_ratio), input_len·(1+range_ratio)] (the same for outputs),
//                  exact in tokens of the model's tokenizer
//   jsonl          a file of {"prompt": str, "output_len"?: int} lines (also "max_tokens")
//   sharegpt       a ShareGPT JSON file: [{"conversations": [{"from", "value"}, ...]}, ...]; the
//                  first human turn is the prompt, the reply's token count the output length
//   shared-prefix  num_prefix_groups long "system prompts" of prefix_len tokens; each request is
//                  one of them followed by its own input_len-token question
//   code           code completion: a source file under code_dir cut at a random line, the last
//                  input_len tokens before the cut as the prompt
//   multi-turn     chat sessions (LoadChatSessions): session s has system prompt s mod
//                  num_prefix_groups (prefix_len tokens) and num_turns user messages of input_len
//                  tokens; turn k's prompt is the system prompt, turns 1..k-1 (each user message
//                  and the answer the server actually gave) and turn k's message. Sessions run
//                  side by side, each turn sent once the session's previous one has ended
// A file that is missing, malformed or has no usable entries is an error naming what is wrong.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/serving/client.h"
#include "frontend/tokenizer/tokenizer.h"

namespace duet::bench {

struct BenchRequest {
  std::string prompt;
  int prompt_tokens = 0;  // by our tokenizer, without special tokens; 0 when there is none
  int output_tokens = 0;  // max_tokens to ask for
};

enum class DatasetKind { kRandom, kJsonl, kShareGpt, kSharedPrefix, kCode, kMultiTurn };
absl::StatusOr<DatasetKind> ParseDatasetKind(const std::string& name);

struct DatasetOptions {
  DatasetKind kind = DatasetKind::kRandom;
  std::string path;       // jsonl, sharegpt
  std::string code_dir;   // code
  int num_prompts = 100;
  int input_len = 256;
  int output_len = 128;
  // jsonl, sharegpt: use output_len instead of each entry's own length (sharegpt without a
  // tokenizer needs it).
  bool fixed_output_len = false;
  double range_ratio = 0;  // [0, 1)
  int prefix_len = 512;    // shared-prefix, multi-turn (the system prompts)
  int num_prefix_groups = 4;
  int num_sessions = 16;   // multi-turn
  int num_turns = 4;
  uint64_t seed = 0;
  // Needed by random, shared-prefix and code; optional for jsonl and sharegpt.
  const Tokenizer* tokenizer = nullptr;
};

// One multi-turn chat: what its turns send (the answers come from the server as it runs).
struct ChatSession {
  std::string system_prompt;
  std::vector<std::string> user_messages;  // one a turn
  std::vector<int> output_tokens;          // max_tokens of each turn
};
// multi-turn: num_sessions sessions of num_turns turns.
absl::StatusOr<std::vector<ChatSession>> LoadChatSessions(const DatasetOptions& options);
// The prompt of turn answers.size() of `session`, given the answers of the turns before it, as
// one completion prompt: a transcript whose text (and so, up to the last token or two, whose
// tokens) extends the previous turn's prompt and answer.
std::string ChatPrompt(const ChatSession& session, const std::vector<std::string>& answers);
// The same turn as chat messages: system, then user and assistant in turn, then the new user message.
std::vector<ChatMessage> ChatMessages(const ChatSession& session, const std::vector<std::string>& answers);

// Exactly num_prompts requests (not multi-turn). jsonl keeps the file's order; sharegpt is shuffled by the seed;
// a file with fewer usable entries than num_prompts is cycled.
absl::StatusOr<std::vector<BenchRequest>> LoadDataset(const DatasetOptions& options);

// The requests as `duet generate` input (cli/generate_request.h), one JSON object a line:
// {"id": "<index>", "prompt_token_ids", "max_tokens", "temperature": 0, "ignore_eos"}. The ids are
// the prompt encoded with special tokens added, as a Duet router encodes a text prompt, so the
// engine alone can run exactly what the benchmark sends a cluster (greedy, as every request is).
std::string GenerateInputJsonl(const std::vector<BenchRequest>& requests, const Tokenizer& tokenizer,
                               bool ignore_eos);

}  // namespace duet::bench

// The OpenAI-compatible API's wire format, as pure functions: request parsing and validation
// (completions, chat completions, tokenize, detokenize), error objects, response and SSE chunk
// JSON. No I/O; router/openai_api.cpp runs the requests.
//
// Errors follow OpenAI's shape {"error": {"message", "type", "param", "code"}}: type
// "invalid_request_error" for 400/404/413 (code "model_not_found" for an unknown model,
// "context_length_exceeded" for a prompt that does not fit), "authentication_error" /
// "invalid_api_key" for 401, "rate_limit_error" / "rate_limit_exceeded" for 429,
// "server_error" for 500 and "service_unavailable" for 503.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "duet/v1/duet.pb.h"
#include "frontend/chat_template/chat_template.h"
#include "frontend/tokenizer/tokenizer.h"
#include "grpcpp/support/status.h"
#include "nlohmann/json.hpp"
#include "router/openai_tool_calls.h"
#include "router/request_limits.h"

namespace duet::router::openai {

using Json = nlohmann::ordered_json;

// The OpenAI error object a failed request answers with, and its HTTP status.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::optional<std::string> param;
  std::optional<std::string> code;
};

// Errors are absl::Status until they become a response (ToApiError): the status code picks the
// HTTP status and type, payloads carry the error object's `param` and `code`.
absl::Status BadRequest(absl::string_view message, std::optional<std::string> param = std::nullopt);
absl::Status NotFound(absl::string_view message, std::optional<std::string> code = std::nullopt,
                      std::optional<std::string> param = std::nullopt);
// The one place an error becomes a response: InvalidArgument, AlreadyExists, OutOfRange → 400;
// NotFound → 404; ResourceExhausted → 429; Unauthenticated, PermissionDenied → 401;
// Unavailable, DeadlineExceeded → 503; anything else → 500 (types and codes as above).
ApiError ToApiError(const absl::Status& status);
// A gRPC status from the router's Generate as an API error: ToApiError, with code
// "context_length_exceeded" for a prompt that does not fit.
ApiError FromGrpc(const grpc::Status& status);
// {"error": {...}}
std::string ErrorBody(const ApiError& error);

// What parsing needs to know about the server.
struct ProtocolContext {
  std::string model_name;                  // in responses (--served-model-name's first)
  std::vector<std::string> model_aliases;  // the other names a request's `model` may give
  const Tokenizer* tokenizer = nullptr;         // required for text and chat
  const LoadedChatTemplate* chat = nullptr;     // required for chat
  int64_t max_model_len = 0;
  int max_n = kMaxCompletionsPerRequest;  // n above this is "absurd"
  int max_logprobs = 20;   // like vLLM's default max_logprobs
  // --enable-auto-tool-choice with --tool-call-parser: tool_choice "auto" parses calls in this
  // format; unset: "auto" is a 400 (as vLLM).
  std::optional<ToolCallFormat> auto_tool_call_format;
};

// What a chat request asks of its `tools`. kNone: the tools reach the template (as vLLM's
// default) but the output is content. kAuto: calls are parsed from the output in the server's
// format. kRequired and kNamed: the grammar engine forces calls (a JSON schema made from the
// tools' parameters).
enum class ToolChoice { kNone, kAuto, kRequired, kNamed };

// What a chat request asks of its tools' output.
struct ToolCalling {
  ToolChoice choice = ToolChoice::kNone;
  std::string name;  // kNamed
  bool parallel = true;  // parallel_tool_calls
  std::optional<ToolCallFormat> format;  // kAuto
};

// One prompt of a request: text (tokenized by the router, with special tokens) or token ids.
struct PromptInput {
  bool is_text = false;
  std::string text;
  std::vector<int32_t> token_ids;
};

struct ParsedRequest {
  bool chat = false;
  std::string model;
  std::vector<PromptInput> prompts;  // completions: one or more; chat: one (token ids)
  v1::SamplingOptions sampling;      // without seed (see seed)
  std::optional<uint64_t> seed;      // choice i of a prompt gets seed + i
  int n = 1;
  bool stream = false;
  bool include_usage = false;        // stream_options.include_usage
  bool echo = false;                 // completions
  bool include_stop_str_in_output = false;  // the stop string that ended a choice ends its text
  // completions: `logprobs` (top-N); chat: `top_logprobs` when `logprobs` is true.
  std::optional<int> logprobs;
  // vLLM's `prompt_logprobs` (both endpoints, not streaming): the choices' `prompt_logprobs`
  // (chat: the response's). Completions with `echo` and `logprobs` score the prompt too (top
  // `prompt_logprobs`, else `logprobs`), for the echoed tokens' logprobs.
  std::optional<int> prompt_logprobs;
  bool chat_add_role_first = true;   // chat streaming: first chunk carries the role
  int64_t created = 0;
  // The client's `request_id` (a vLLM extra field; at most kMaxRequestIdBytes): the response is
  // "cmpl-<request_id>" / "chatcmpl-<request_id>".
  std::optional<std::string> request_id;
  ToolCalling tools;  // chat
};

// The parser that splits a choice's output into content and tool calls; null when the request
// does not parse tool calls.
std::unique_ptr<ToolCallParser> NewToolCallParser(const ToolCalling& tools, ToolCallIdFn new_id = nullptr);

// The `created` of responses and model cards: Unix seconds now.
int64_t UnixSecondsNow();

absl::StatusOr<ParsedRequest> ParseCompletionRequest(std::string_view body, const ProtocolContext& context);
absl::StatusOr<ParsedRequest> ParseChatRequest(std::string_view body, const ProtocolContext& context);

// The chat part of a request, which HTTP chat completions and gRPC Generate's `chat` share: the
// fields `tools`, `tool_choice` and `parallel_tool_calls` of `request` (a forced call's schema
// becomes `sampling`'s structured output, which must not have one of its own then), and
// `messages` rendered through the chat template (RenderChat) and tokenized. Without max_tokens,
// `sampling` gets what is left of the context (max_model_len − the prompt's tokens, at least 1).
struct ChatInput {
  std::vector<int32_t> prompt_token_ids;
  ToolCalling tools;
};
absl::StatusOr<ChatInput> ParseChatInput(const Json& request, const ProtocolContext& context,
                                         v1::SamplingOptions* sampling);

// The request's `model` check alone (unknown → 404 model_not_found).
absl::Status CheckModel(const Json& request, const ProtocolContext& context);

// The chat prompt: messages rendered with the template (add_generation_prompt defaults true),
// tokenized without special tokens (the template has them). Exposed for tests and /tokenize.
absl::StatusOr<std::string> RenderChat(const Json& request, const ProtocolContext& context);

// POST /tokenize and /detokenize bodies → response JSON, or an error.
absl::StatusOr<Json> Tokenize(std::string_view body, const ProtocolContext& context);
absl::StatusOr<Json> Detokenize(std::string_view body, const ProtocolContext& context);

// --- responses ---

// The result of one choice, accumulated from the router's stream.
struct ChoiceResult {
  int index = 0;
  std::string text;
  std::vector<int32_t> token_ids;
  std::vector<v1::TokenLogprobs> logprobs;  // one per token id, when asked
  // When the prompt was scored (sampling.prompt_logprobs): its ids, and one entry per id after
  // the first.
  std::vector<int32_t> prompt_token_ids;
  std::vector<v1::TokenLogprobs> prompt_logprobs;
  std::string finish_reason;
  Json stop_reason;  // vLLM's: the stop string or stop token id that ended the choice, else null
  int prompt_tokens = 0;
  int completion_tokens = 0;
};

// The longest cache_salt, in bytes.
inline constexpr size_t kMaxCacheSaltBytes = 256;

// vLLM's stop_reason of a choice that finished with "stop": the stop string that ended it (of
// those at the earliest place in the decoded output, the first listed), else the stop token id
// that ended it, else null (EOS, a complete grammar).
Json StopReason(const v1::SamplingOptions& sampling, const Tokenizer* tokenizer, const std::vector<int32_t>& token_ids);

Json UsageJson(int prompt_tokens, int completion_tokens);

// A token as a string for logprobs (its own decoded text, special tokens kept).
std::string TokenString(const Tokenizer* tokenizer, int32_t id);
// Completions logprobs: {tokens, token_logprobs, top_logprobs, text_offset}; `offset` is the
// text offset of the first token (grows as tokens are added). The first `num_unscored` ids have
// none (null; echo: the prompt's first token), logprobs[k] is that of ids[num_unscored + k].
Json CompletionLogprobs(const Tokenizer* tokenizer, const std::vector<int32_t>& ids,
                        const std::vector<v1::TokenLogprobs>& logprobs, size_t* offset, size_t num_unscored = 0);
// vLLM's prompt_logprobs: null for the first prompt token, then per token an object
// {"<token id>": {"logprob", "rank", "decoded_token"}} with the prompt token's own entry first
// and then the top-K (ranks 1..K) other than it. `logprobs[i]` is prompt_ids[i + 1]'s.
Json PromptLogprobsJson(const Tokenizer* tokenizer, const std::vector<int32_t>& prompt_ids,
                        const std::vector<v1::TokenLogprobs>& logprobs);
// Chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
Json ChatLogprobs(const Tokenizer* tokenizer, const std::vector<int32_t>& ids,
                  const std::vector<v1::TokenLogprobs>& logprobs, int top_n);

// Whole (non-streaming) responses. `echo_prefix[i]` is prepended to prompt i's choices (echo).
// Chat: a request that parses tool calls (NewToolCallParser) answers them in message.tool_calls
// (content null when only calls were made) and finish_reason "tool_calls" for a choice that made
// calls and stopped.
Json CompletionResponse(const std::string& id, const ParsedRequest& request, const Tokenizer* tokenizer,
                        const std::vector<ChoiceResult>& choices, const std::vector<std::string>& echo_prefix);
Json ChatResponse(const std::string& id, const ParsedRequest& request, const Tokenizer* tokenizer,
                  const std::vector<ChoiceResult>& choices);

// One choice of a streaming chunk (the JSON of one `data:` event).
struct ChunkChoice {
  int index = 0;
  bool role = false;                   // chat: the first chunk of a choice ({"role":"assistant","content":""})
  std::optional<std::string> content;  // chat: delta.content (absent when unset); completions: text
  std::vector<OutputDelta::Call> tool_calls;  // chat: delta.tool_calls
  Json logprobs;                       // null: none
  std::optional<std::string> finish_reason;
  Json stop_reason;                    // with finish_reason
};
Json CompletionChunk(const std::string& id, const ParsedRequest& request, const ChunkChoice& choice);
Json ChatChunk(const std::string& id, const ParsedRequest& request, const ChunkChoice& choice);
// delta.tool_calls / message.tool_calls entries.
Json ToolCallDeltaJson(const OutputDelta::Call& call);
Json ToolCallJson(const ToolCall& call);
// A chat choice's finish reason: "tool_calls" when it made calls and stopped.
std::string ChatFinishReason(const std::string& finish_reason, int num_tool_calls);
// The last chunk with include_usage: empty choices and the usage.
Json UsageChunk(const std::string& id, const ParsedRequest& request, int prompt_tokens, int completion_tokens);

// SSE framing: "data: <json>\n\n" and "data: [DONE]\n\n".
std::string SseEvent(const Json& json);
inline constexpr char kSseDone[] = "data: [DONE]\n\n";

// Random ids: "cmpl-<32 hex>", "chatcmpl-<32 hex>" (128 bits from the kernel's CSPRNG).
std::string NewId(std::string_view prefix);

}  // namespace duet::router::openai

// Tool calls in chat completions: the parsers that split a choice's generated text into content
// and tool calls, incrementally (for streaming) and whole, and the JSON schemas that force a
// tool call through the grammar engine (tool_choice "required" or a named function), as vLLM
// builds them.
//
// Formats (`--tool-call-parser`, used with tool_choice "auto"):
//   llama3_json  Llama 3.x: an optional <|python_tag|>, then one or more JSON objects
//                {"name": ..., "parameters": {...}} ("arguments" is taken too) separated by ';'.
//                Output that does not start that way is content.
//   hermes       Hermes / Qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks
//                anywhere in the text (the last may be left unclosed); text around them is content.
// Forced (tool_choice "required"): a JSON array of {"name", "parameters"} objects; a named
// function: the output is its arguments.
//
// What is not a well-formed call stays content, byte for byte: a Llama-3 output whose first
// object is not a call is all content; a later bad object and everything after it is content; a
// Hermes block whose JSON does not parse is content with its tags. Whitespace next to a call
// (before, between, after calls) is dropped. A streaming parser gives the same result, however
// the text is split, as parsing the whole text at once: it holds text back only while it may
// still turn out to be (part of) a call, and emits a call once it is complete (a named call's
// arguments stream as they come).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace duet::router::openai {

enum class ToolCallFormat { kLlama3Json, kHermes };
// "llama3_json" or "hermes"; InvalidArgument naming both otherwise.
absl::StatusOr<ToolCallFormat> ParseToolCallFormat(std::string_view name);
const char* ToolCallFormatName(ToolCallFormat format);

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // JSON text
};

// What one piece of a choice's output shows the client: content, and pieces of tool calls.
struct OutputDelta {
  struct Call {
    int index = 0;                  // the call's position among the choice's calls
    std::optional<std::string> id;  // set on a call's first piece, with its name
    std::string name;
    std::string arguments;  // appended to the call's arguments
  };
  std::string content;
  std::vector<Call> calls;
};

// Makes the id of each new call ("chatcmpl-tool-<32 hex>" by default, as vLLM's).
using ToolCallIdFn = std::function<std::string()>;

class ToolCallParser {
 public:
  virtual ~ToolCallParser() = default;
  // The next piece of the output: what it makes visible is appended to `out`.
  virtual void Push(std::string_view text, OutputDelta* out) = 0;
  // The output ended: what was held back is resolved into `out`.
  virtual void Finish(OutputDelta* out) = 0;
  int num_calls() const { return num_calls_; }

 protected:
  explicit ToolCallParser(ToolCallIdFn new_id);
  // A new call with its name and the first part of its arguments.
  void StartCall(std::string name, std::string arguments, OutputDelta* out);

 private:
  ToolCallIdFn new_id_;
  int num_calls_ = 0;
};

// tool_choice "auto": calls in `format`; after `max_calls` calls (parallel_tool_calls false: 1)
// the rest is content.
std::unique_ptr<ToolCallParser> NewAutoToolCallParser(ToolCallFormat format, int max_calls,
                                                      ToolCallIdFn new_id = nullptr);
// tool_choice "required": the JSON array the schema of RequiredToolCallSchema forces.
std::unique_ptr<ToolCallParser> NewRequiredToolCallParser(ToolCallIdFn new_id = nullptr);
// A named function: the whole output is its arguments.
std::unique_ptr<ToolCallParser> NewNamedToolCallParser(std::string name, ToolCallIdFn new_id = nullptr);

// A choice's output put together from its deltas.
struct ParsedOutput {
  std::string content;
  std::vector<ToolCall> calls;
};
void Accumulate(const OutputDelta& delta, ParsedOutput* out);
// The whole text through `parser` (a fresh one).
ParsedOutput ParseToolCalls(ToolCallParser& parser, std::string_view text);

// A function the request offers: its name and its parameters' JSON schema (null: none).
struct ToolSpec {
  std::string name;
  nlohmann::ordered_json parameters;
};
// The schema of a named function's arguments: its parameters, or an empty object when it has none.
nlohmann::ordered_json NamedToolCallSchema(const ToolSpec& tool);
// tool_choice "required": [{"name": <one of the tools>, "parameters": <its schema>}, ...], at least
// one call (at most one unless `parallel`), the tools' $defs moved to the root (InvalidArgument
// when two tools define one name differently).
absl::StatusOr<nlohmann::ordered_json> RequiredToolCallSchema(const std::vector<ToolSpec>& tools, bool parallel);

}  // namespace duet::router::openai

// Chat templates: renders the Jinja `chat_template` of a Hugging Face tokenizer_config.json.
//
// A small interpreter for the Jinja subset real templates use (Llama 3/3.1, Qwen2.5/3, Mistral),
// checked byte-for-byte against @huggingface/jinja (tests/chat_template_parity). Rendering follows
// HF: trim_blocks and lstrip_blocks on, one trailing newline of the template dropped.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace duet {

namespace jinja {
struct Node;
}  // namespace jinja

// For models whose tokenizer_config.json has no chat_template (e.g. the bundled tiny model):
// ChatML turns, with an optional generation prompt. With `tools`, a system turn lists them and
// asks for Hermes-style <tool_call>{"name": ..., "arguments": ...}</tool_call> calls (the
// `hermes` tool-call parser reads them); an assistant turn's tool_calls are written that way.
inline constexpr char kFallbackChatTemplate[] =
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' and messages[0]['content'] is string %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- 'You can call these functions (JSON signatures):\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\\n' }}{%- endfor %}"
    "{{- '</tools>\\nTo call one, answer <tool_call>{\"name\": <function name>, \"arguments\": <arguments object>}</tool_call>.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] if message['content'] is string else '') }}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set function = call['function'] if call['function'] is defined else call %}"
    "{{- '<tool_call>\\n{\"name\": ' + (function['name'] | tojson) + ', \"arguments\": ' + (function['arguments'] if function['arguments'] is string else function['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

class ChatTemplate {
 public:
  // Parses once; syntax errors are InvalidArgument naming line and column.
  static absl::StatusOr<ChatTemplate> Parse(std::string source);

  // Renders with the given variables (messages, add_generation_prompt, bos_token, eos_token,
  // tools, ...). Key order of objects is kept (it shows in `tojson`), hence ordered_json; a
  // plain nlohmann::json converts implicitly with sorted keys. Runtime errors (unknown filter,
  // bad operand types, raise_exception(msg)) are InvalidArgument; raise_exception's message
  // is returned verbatim.
  absl::StatusOr<std::string> Render(const nlohmann::ordered_json& context) const;

  const std::string& source() const { return *source_; }

 private:
  struct Program;
  ChatTemplate(std::shared_ptr<const std::string> source, std::shared_ptr<const Program> program)
      : source_(std::move(source)), program_(std::move(program)) {}

  std::shared_ptr<const std::string> source_;
  std::shared_ptr<const Program> program_;
};

struct LoadedChatTemplate {
  ChatTemplate chat_template;
  bool is_fallback = false;  // the model has no template; kFallbackChatTemplate is used
  std::string bos_token;     // empty when the model has none
  std::string eos_token;
};

// Loads chat_template from <model_dir>/tokenizer_config.json: a string, or a list of
// {name, template} from which "default" is taken. Falls back to kFallbackChatTemplate when
// absent. bos/eos tokens may be strings or {"content": ...} objects. A non-empty
// `chat_template_flag` (--chat-template, ReadChatTemplateFlag) replaces the config's template;
// the bos/eos tokens still come from the config where there is one. Errors in the flag's
// template are InvalidArgument (NotFound for a path that cannot be read) starting
// "--chat-template".
absl::StatusOr<LoadedChatTemplate> LoadChatTemplate(const std::string& model_dir,
                                                    const std::string& chat_template_flag = "");

// The template source a --chat-template value gives, as vLLM reads it: the contents of the file
// at `value`; else, when `value` has a character of Jinja's ('{', '}' or a newline), `value`
// itself, its escapes \n \t \r \\ \' \" read as the characters they stand for; else NotFound
// (it looks like a path, and that cannot be read).
absl::StatusOr<std::string> ReadChatTemplateFlag(const std::string& value);

}  // namespace duet

// Flags of the OpenAI-compatible API that `duet router` and `duet serve` share (serve passes
// them on to its router).
#pragma once

#include <string>
#include <vector>

#include "CLI/CLI.hpp"

namespace duet {

// --served-model-name NAME [NAME...], as vLLM's.
inline void AddServedModelNameFlag(CLI::App* cmd, std::vector<std::string>* names) {
  cmd->add_option("--served-model-name", *names,
                  "The model's names: the first in responses and metrics, every one accepted as a request's "
                  "`model` (default: the model directory's base name)")
      ->expected(1, -1)
      ->default_str("");
}

// --enable-auto-tool-choice and --tool-call-parser, as vLLM's.
inline void AddToolCallFlags(CLI::App* cmd, bool* enable_auto_tool_choice, std::string* tool_call_parser) {
  cmd->add_flag("--enable-auto-tool-choice", *enable_auto_tool_choice,
                "Chat completions: tool_choice \"auto\" (also implied by tools alone) parses tool calls from the "
                "output with --tool-call-parser (without it, \"auto\" is a 400, as in vLLM)");
  cmd->add_option("--tool-call-parser", *tool_call_parser,
                  "The tool-call format of the model's output: llama3_json (Llama 3.x JSON) or hermes "
                  "(<tool_call> blocks: Hermes, Qwen, and the bundled model's built-in template)")
      ->check(CLI::IsMember({"llama3_json", "hermes"}));
}

// --chat-template, as vLLM's: a Jinja template file, or the template itself.
inline void AddChatTemplateFlag(CLI::App* cmd, std::string* chat_template) {
  cmd->add_option("--chat-template", *chat_template,
                  "Chat template replacing the model's (tokenizer_config.json's): a Jinja file, or the template "
                  "itself when it has '{', '}' or a newline (\\n, \\t escapes read); checked at start-up")
      ->default_str("");
}

}  // namespace duet

// The gRPC API's chat and tool calls (duet.v1.Chat, GenerateResponse's tool-call fields) in the
// OpenAI protocol's terms, so that Generate templates, constrains and parses exactly as HTTP
// /v1/chat/completions does (router/openai_protocol.h, router/openai_tool_calls.h).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "duet/v1/duet.pb.h"
#include "router/openai_protocol.h"

namespace duet::router {

// The chat as the fields of an OpenAI chat request that openai::ParseChatInput reads (messages,
// tools, tool_choice, parallel_tool_calls, add_generation_prompt, chat_template_kwargs).
// InvalidArgument, naming the field as "chat.<field>", for what the proto lets through and the
// API does not: a message without a role, a tool without a name, parameters or call arguments
// that are not JSON, template kwargs that are not a JSON object, an unknown tool_choice mode.
absl::StatusOr<openai::Json> ChatRequestJson(const v1::Chat& chat);

// ChatRequestJson and openai::ParseChatInput: the chat's prompt and what it asks of its tools
// (a forced call's schema set in `sampling`, and without max_tokens what is left of the context,
// as HTTP chat completions). Errors are InvalidArgument, prefixed "chat: ".
absl::StatusOr<openai::ChatInput> PrepareChat(const v1::Chat& chat, const openai::ProtocolContext& context,
                                              v1::SamplingOptions* sampling);

// The enum of a finish reason's name ("stop", "length", "abort", "tool_calls"); UNSPECIFIED for
// any other.
v1::FinishReason FinishReasonCode(const std::string& name);

// What the router adds to each stream message of one completion on its way to the client: the
// finish reason as an enum, and for a chat that parses tool calls (openai::NewToolCallParser)
// the content, the pieces of calls and, on the last message, every call and finish reason
// "tool_calls" for a completion that made calls and stopped. The fields it owns are cleared first
// (a decode worker has no business setting them).
class ResponseAnnotator {
 public:
  explicit ResponseAnnotator(const openai::ToolCalling& tools, openai::ToolCallIdFn new_id = nullptr);
  // Messages in stream order; the last one is finished.
  void Annotate(v1::GenerateResponse* message);

 private:
  std::unique_ptr<openai::ToolCallParser> parser_;  // null: no tool calls to parse
  openai::ParsedOutput output_;                     // the calls so far
};

}  // namespace duet::router

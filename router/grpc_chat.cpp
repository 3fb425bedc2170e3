#include "router/grpc_chat.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "router/json_depth.h"

namespace duet::router {
namespace {

using openai::Json;

// `text` as JSON; nullopt when it is not JSON or nests too deep.
std::optional<Json> ParseJsonText(const std::string& text) {
  if (!JsonDepthWithin(text, kMaxRequestJsonDepth)) return std::nullopt;
  Json json = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return std::nullopt;
  return json;
}

absl::StatusOr<Json> MessageJson(const v1::ChatMessage& message, const std::string& where) {
  if (message.role().empty()) return absl::InvalidArgumentError(absl::StrCat(where, ".role is required"));
  Json out;
  out["role"] = message.role();
  out["content"] = message.has_content() ? Json(message.content()) : Json(nullptr);
  if (!message.name().empty()) out["name"] = message.name();
  if (!message.tool_call_id().empty()) out["tool_call_id"] = message.tool_call_id();
  if (message.tool_calls_size() > 0) {
    Json calls = Json::array();
    for (int k = 0; k < message.tool_calls_size(); ++k) {
      const v1::ToolCall& call = message.tool_calls(k);
      const std::string at = absl::StrCat(where, ".tool_calls[", k, "]");
      if (call.name().empty()) return absl::InvalidArgumentError(absl::StrCat(at, ".name is required"));
      Json function;
      function["name"] = call.name();
      if (!call.arguments().empty()) {  // empty: no arguments ({})
        if (!ParseJsonText(call.arguments())) {
          return absl::InvalidArgumentError(absl::StrCat(at, ".arguments is not valid JSON"));
        }
        function["arguments"] = call.arguments();
      }
      Json entry;
      if (!call.id().empty()) entry["id"] = call.id();
      entry["type"] = "function";
      entry["function"] = std::move(function);
      calls.push_back(std::move(entry));
    }
    out["tool_calls"] = std::move(calls);
  }
  return out;
}

absl::StatusOr<Json> ToolJson(const v1::Tool& tool, const std::string& where) {
  if (tool.name().empty()) return absl::InvalidArgumentError(absl::StrCat(where, ".name is required"));
  Json function;
  function["name"] = tool.name();
  if (!tool.description().empty()) function["description"] = tool.description();
  if (!tool.parameters().empty()) {
    std::optional<Json> parameters = ParseJsonText(tool.parameters());
    if (!parameters || !parameters->is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".parameters must be a JSON schema (a JSON object)"));
    }
    function["parameters"] = *std::move(parameters);
  }
  Json out;
  out["type"] = "function";
  out["function"] = std::move(function);
  return out;
}

absl::Status SetToolChoice(const v1::ToolChoice& choice, Json* request) {
  switch (choice.choice_case()) {
    case v1::ToolChoice::CHOICE_NOT_SET:
      return absl::OkStatus();
    case v1::ToolChoice::kFunctionName:
      if (choice.function_name().empty()) {
        return absl::InvalidArgumentError("chat.tool_choice.function_name must not be empty");
      }
      (*request)["tool_choice"] = Json{{"type", "function"}, {"function", {{"name", choice.function_name()}}}};
      return absl::OkStatus();
    case v1::ToolChoice::kMode:
      switch (choice.mode()) {
        case v1::ToolChoice::MODE_UNSPECIFIED:
          return absl::OkStatus();
        case v1::ToolChoice::MODE_NONE:
          (*request)["tool_choice"] = "none";
          return absl::OkStatus();
        case v1::ToolChoice::MODE_AUTO:
          (*request)["tool_choice"] = "auto";
          return absl::OkStatus();
        case v1::ToolChoice::MODE_REQUIRED:
          (*request)["tool_choice"] = "required";
          return absl::OkStatus();
        default:
          break;
      }
      return absl::InvalidArgumentError(
          absl::StrCat("chat.tool_choice.mode ", static_cast<int>(choice.mode()), " is not a known mode"));
  }
  return absl::InvalidArgumentError("chat.tool_choice is not a known choice");
}

}  // namespace

absl::StatusOr<Json> ChatRequestJson(const v1::Chat& chat) {
  Json request;
  Json messages = Json::array();
  for (int m = 0; m < chat.messages_size(); ++m) {
    DUET_ASSIGN_OR_RETURN(Json message, MessageJson(chat.messages(m), absl::StrCat("chat.messages[", m, "]")));
    messages.push_back(std::move(message));
  }
  request["messages"] = std::move(messages);
  if (chat.tools_size() > 0) {
    Json tools = Json::array();
    for (int t = 0; t < chat.tools_size(); ++t) {
      DUET_ASSIGN_OR_RETURN(Json tool, ToolJson(chat.tools(t), absl::StrCat("chat.tools[", t, "]")));
      tools.push_back(std::move(tool));
    }
    request["tools"] = std::move(tools);
  }
  DUET_RETURN_IF_ERROR(SetToolChoice(chat.tool_choice(), &request));
  if (chat.has_parallel_tool_calls()) request["parallel_tool_calls"] = chat.parallel_tool_calls();
  if (chat.has_add_generation_prompt()) request["add_generation_prompt"] = chat.add_generation_prompt();
  if (!chat.chat_template_kwargs().empty()) {
    std::optional<Json> kwargs = ParseJsonText(chat.chat_template_kwargs());
    if (!kwargs || !kwargs->is_object()) {
      return absl::InvalidArgumentError("chat.chat_template_kwargs must be a JSON object");
    }
    request["chat_template_kwargs"] = *std::move(kwargs);
  }
  return request;
}

absl::StatusOr<openai::ChatInput> PrepareChat(const v1::Chat& chat, const openai::ProtocolContext& context,
                                              v1::SamplingOptions* sampling) {
  DUET_ASSIGN_OR_RETURN(const Json request, ChatRequestJson(chat));
  absl::StatusOr<openai::ChatInput> input = openai::ParseChatInput(request, context, sampling);
  if (!input.ok()) return absl::Status(input.status().code(), absl::StrCat("chat: ", input.status().message()));
  return input;
}

v1::FinishReason FinishReasonCode(const std::string& name) {
  if (name == "stop") return v1::FINISH_REASON_STOP;
  if (name == "length") return v1::FINISH_REASON_LENGTH;
  if (name == "abort") return v1::FINISH_REASON_ABORT;
  if (name == "tool_calls") return v1::FINISH_REASON_TOOL_CALLS;
  return v1::FINISH_REASON_UNSPECIFIED;
}

ResponseAnnotator::ResponseAnnotator(const openai::ToolCalling& tools, openai::ToolCallIdFn new_id)
    : parser_(openai::NewToolCallParser(tools, std::move(new_id))) {}

void ResponseAnnotator::Annotate(v1::GenerateResponse* message) {
  message->clear_index();
  message->clear_finish_reason_code();
  message->clear_content();
  message->clear_tool_call_deltas();
  message->clear_tool_calls();
  if (parser_ != nullptr) {
    openai::OutputDelta delta;
    parser_->Push(message->text(), &delta);
    if (message->finished()) parser_->Finish(&delta);
    openai::Accumulate(delta, &output_);
    message->set_content(std::move(delta.content));
    for (const openai::OutputDelta::Call& call : delta.calls) {
      v1::ToolCallDelta* piece = message->add_tool_call_deltas();
      piece->set_index(call.index);
      if (call.id) {
        piece->set_id(*call.id);
        piece->set_name(call.name);
      }
      piece->set_arguments(call.arguments);
    }
    if (message->finished()) {
      for (const openai::ToolCall& call : output_.calls) {
        v1::ToolCall* out = message->add_tool_calls();
        out->set_id(call.id);
        out->set_name(call.name);
        out->set_arguments(call.arguments);
      }
      message->set_finish_reason(
          openai::ChatFinishReason(message->finish_reason(), static_cast<int>(output_.calls.size())));
    }
  }
  if (message->finished()) message->set_finish_reason_code(FinishReasonCode(message->finish_reason()));
}

}  // namespace duet::router

#include "router/openai_protocol.h"

#include <chrono>
#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "engine/grammar/structured_output.h"
#include "router/json_depth.h"
#include "router/request_id.h"
#include "rpc/rpc_util.h"

namespace duet::router::openai {
namespace {

// Status payloads that carry the OpenAI error object's `param` and `code` to ToApiError.
constexpr char kParamPayload[] = "duet.router.openai/param";
constexpr char kCodePayload[] = "duet.router.openai/code";
constexpr int kMaxChoices = 1024;  // prompts × n

absl::StatusOr<Json> ParseBody(std::string_view body) {
  if (!JsonDepthWithin(body, kMaxRequestJsonDepth)) {
    return BadRequest(absl::StrCat("JSON nesting deeper than ", kMaxRequestJsonDepth, " levels"));
  }
  Json json = Json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return BadRequest("the request body is not valid JSON");
  if (!json.is_object()) return BadRequest("the request body must be a JSON object");
  return json;
}

absl::Status WithDetails(absl::Status status, std::optional<std::string> param, std::optional<std::string> code) {
  if (param) status.SetPayload(kParamPayload, absl::Cord(*param));
  if (code) status.SetPayload(kCodePayload, absl::Cord(*code));
  return status;
}

std::string TypeName(const Json& v) { return v.type_name(); }

absl::Status WrongType(const std::string& field, const std::string& want, const Json& got) {
  return BadRequest(absl::StrCat("'", field, "' must be ", want, ", got ", TypeName(got)), field);
}

// Field accessors: absent or null leaves `out` unchanged. An error when the type is wrong.
absl::Status GetBool(const Json& j, const char* field, bool* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_boolean()) return WrongType(field, "a boolean", *it);
  *out = it->get<bool>();
  return absl::OkStatus();
}

absl::Status GetInt(const Json& j, const char* field, int64_t min, int64_t max, std::optional<int64_t>* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  int64_t value = 0;
  if (it->is_number_integer()) {
    if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return BadRequest(absl::StrCat("'", field, "' is out of range: ", it->dump()), field);
    }
    value = it->get<int64_t>();
  } else if (it->is_number_float()) {
    const double d = it->get<double>();
    if (!std::isfinite(d) || d != std::floor(d) || std::fabs(d) > 9.0e18) return WrongType(field, "an integer", *it);
    value = static_cast<int64_t>(d);
  } else {
    return WrongType(field, "an integer", *it);
  }
  if (value < min || value > max) {
    return BadRequest(absl::StrCat("'", field, "' must be between ", min, " and ", max, ", got ", value), field);
  }
  *out = value;
  return absl::OkStatus();
}

absl::Status GetNumber(const Json& j, const char* field, std::optional<double>* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number()) return WrongType(field, "a number", *it);
  const double d = it->get<double>();
  if (!std::isfinite(d) || std::fabs(d) > 1e30) {
    return BadRequest(absl::StrCat("'", field, "' is out of range"), field);
  }
  *out = d;
  return absl::OkStatus();
}

absl::Status GetTokenIds(const Json& v, const char* field, std::vector<int32_t>* out) {
  for (const Json& e : v) {
    if (!e.is_number_integer()) return WrongType(field, "a list of integer token ids", v);
    if (e.is_number_unsigned() ? e.get<uint64_t>() > uint64_t{std::numeric_limits<int32_t>::max()}
                               : (e.get<int64_t>() < std::numeric_limits<int32_t>::min() ||
                                  e.get<int64_t>() > std::numeric_limits<int32_t>::max())) {
      return BadRequest(absl::StrCat("'", field, "' has a token id out of range: ", e.dump()), field);
    }
    out->push_back(static_cast<int32_t>(e.get<int64_t>()));
  }
  return absl::OkStatus();
}

// The sampling fields read as numbers (their ranges are the engine's rules: ValidateSampling).
struct FloatSamplingField {
  const char* name;
  void (*set)(v1::SamplingOptions&, float);
};
constexpr FloatSamplingField kFloatSamplingFields[] = {
    {"temperature", [](v1::SamplingOptions& s, float v) { s.set_temperature(v); }},
    {"top_p", [](v1::SamplingOptions& s, float v) { s.set_top_p(v); }},
    {"min_p", [](v1::SamplingOptions& s, float v) { s.set_min_p(v); }},
    {"presence_penalty", [](v1::SamplingOptions& s, float v) { s.set_presence_penalty(v); }},
    {"frequency_penalty", [](v1::SamplingOptions& s, float v) { s.set_frequency_penalty(v); }},
    {"repetition_penalty", [](v1::SamplingOptions& s, float v) { s.set_repetition_penalty(v); }},
};

// The sampling fields, n and seed, onto out->sampling, out->n and out->seed.
absl::Status ParseSampling(const Json& j, const ProtocolContext& context, ParsedRequest* out) {
  v1::SamplingOptions& s = out->sampling;
  std::optional<int64_t> i;
  const int64_t max_int32 = std::numeric_limits<int32_t>::max();
  for (const char* field : {"max_tokens", "max_completion_tokens"}) {
    i.reset();
    DUET_RETURN_IF_ERROR(GetInt(j, field, 1, max_int32, &i));
    if (i) s.set_max_tokens(static_cast<int32_t>(*i));
  }
  i.reset();
  DUET_RETURN_IF_ERROR(GetInt(j, "top_k", -1, max_int32, &i));
  if (i) s.set_top_k(static_cast<int32_t>(*i));
  for (const FloatSamplingField& field : kFloatSamplingFields) {
    std::optional<double> d;
    DUET_RETURN_IF_ERROR(GetNumber(j, field.name, &d));
    if (d) field.set(s, static_cast<float>(*d));
  }
  i.reset();
  DUET_RETURN_IF_ERROR(
      GetInt(j, "seed", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), &i));
  if (i) out->seed = static_cast<uint64_t>(*i);
  i.reset();
  DUET_RETURN_IF_ERROR(GetInt(j, "n", 1, context.max_n, &i));
  if (i) out->n = static_cast<int>(*i);
  bool ignore_eos = false;
  DUET_RETURN_IF_ERROR(GetBool(j, "ignore_eos", &ignore_eos));
  s.set_ignore_eos(ignore_eos);
  DUET_RETURN_IF_ERROR(GetBool(j, "include_stop_str_in_output", &out->include_stop_str_in_output));
  if (auto it = j.find("speculation"); it != j.end() && !it->is_null()) {  // vLLM-style extra field
    if (!it->is_string()) return WrongType("speculation", "one of \"none\", \"lookahead\", \"draft\", \"self\"", *it);
    s.set_speculation(it->get<std::string>());
  }
  return absl::OkStatus();
}

// `stop` (strings) and `stop_token_ids`.
absl::Status ParseStops(const Json& j, v1::SamplingOptions* s) {
  if (auto it = j.find("stop"); it != j.end() && !it->is_null()) {
    if (it->is_string()) {
      if (!it->get_ref<const std::string&>().empty()) s->add_stop(it->get<std::string>());
    } else if (it->is_array()) {
      for (const Json& e : *it) {
        if (!e.is_string()) return WrongType("stop", "a string or a list of strings", *it);
        if (!e.get_ref<const std::string&>().empty()) s->add_stop(e.get<std::string>());
      }
    } else {
      return WrongType("stop", "a string or a list of strings", *it);
    }
  }
  if (auto it = j.find("stop_token_ids"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return WrongType("stop_token_ids", "a list of integers", *it);
    std::vector<int32_t> ids;
    DUET_RETURN_IF_ERROR(GetTokenIds(*it, "stop_token_ids", &ids));
    for (int32_t id : ids) s->add_stop_token_ids(id);
  }
  return absl::OkStatus();
}

// Fields accepted only in the forms that need nothing from Duet: `user` (ignored), `best_of`
// equal to n.
absl::Status CheckUnsupportedFields(const Json& j, const ProtocolContext& context, int n) {
  if (auto it = j.find("user"); it != j.end() && !it->is_null() && !it->is_string()) {
    return WrongType("user", "a string", *it);
  }
  std::optional<int64_t> best_of;
  DUET_RETURN_IF_ERROR(GetInt(j, "best_of", 1, context.max_n, &best_of));
  if (best_of && *best_of != n && *best_of != 1) return BadRequest("'best_of' other than n is not supported", "best_of");
  return absl::OkStatus();
}

// OpenAI's `logit_bias`: {"<token id>": bias}, each bias clamped to [-100, 100] (as vLLM); ids
// must be in the vocabulary.
absl::Status ParseLogitBias(const Json& j, const ProtocolContext& context, v1::SamplingOptions* s) {
  auto it = j.find("logit_bias");
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_object()) return WrongType("logit_bias", "an object mapping token ids to biases", *it);
  const int64_t vocab = context.tokenizer != nullptr ? context.tokenizer->vocab_size() : 0;
  for (const auto& [key, value] : it->items()) {
    int64_t id = -1;
    if (!absl::SimpleAtoi(key, &id) || id < 0 || id > std::numeric_limits<int32_t>::max() || (vocab > 0 && id >= vocab)) {
      return BadRequest(absl::StrCat("'logit_bias' key '", key.substr(0, 32), "' is not a token id of the vocabulary",
                                     vocab > 0 ? absl::StrCat(" (vocab size ", vocab, ")") : ""),
                        "logit_bias");
    }
    if (!value.is_number() || !std::isfinite(value.get<double>())) {
      return BadRequest(absl::StrCat("'logit_bias' values must be numbers, got ", value.type_name(), " for ", key),
                        "logit_bias");
    }
    (*s->mutable_logit_bias())[static_cast<int32_t>(id)] =
        static_cast<float>(std::clamp(value.get<double>(), -100.0, 100.0));
  }
  return absl::OkStatus();
}

// vLLM's `cache_salt`: prefix-cache sharing only among requests with the same salt (a non-empty
// string of at most 256 bytes).
absl::Status ParseCacheSalt(const Json& j, v1::SamplingOptions* s) {
  auto it = j.find("cache_salt");
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_string() || it->get_ref<const std::string&>().empty()) {
    return BadRequest("'cache_salt' must be a non-empty string", "cache_salt");
  }
  const std::string& salt = it->get_ref<const std::string&>();
  if (salt.size() > kMaxCacheSaltBytes) {
    return BadRequest(absl::StrCat("'cache_salt' is ", salt.size(), " bytes long; at most ", kMaxCacheSaltBytes,
                                   " are allowed"),
                      "cache_salt");
  }
  s->set_cache_salt(salt);
  return absl::OkStatus();
}

// The legacy function-calling fields (OpenAI's deprecated `functions` / `function_call`), which
// vLLM does not take either: refused, naming the field.
absl::Status RejectLegacyFunctions(const Json& j) {
  for (const char* legacy : {"functions", "function_call"}) {
    if (auto it = j.find(legacy); it != j.end() && !it->is_null()) {
      return BadRequest(absl::StrCat("'", legacy, "' is not supported: use 'tools' and 'tool_choice'"), legacy);
    }
  }
  return absl::OkStatus();
}

// Completions have no tools: a request that asks for them is refused rather than answered with
// unconstrained text. (tool_choice "none" and an empty tools list ask for nothing.)
absl::Status RejectToolCalling(const Json& j) {
  if (auto it = j.find("tools"); it != j.end() && !it->is_null() && !(it->is_array() && it->empty())) {
    return BadRequest("'tools' is only supported in chat completions", "tools");
  }
  if (auto it = j.find("tool_choice"); it != j.end() && !it->is_null() && !(it->is_string() && *it == "none")) {
    return BadRequest("'tool_choice' is only supported in chat completions", "tool_choice");
  }
  return RejectLegacyFunctions(j);
}

// A chat request's `tools` (function tools: name, optional description and parameters schema).
absl::StatusOr<std::vector<ToolSpec>> ParseToolList(const Json& tools) {
  if (!tools.is_array()) return WrongType("tools", "a list of tools", tools);
  std::vector<ToolSpec> out;
  for (size_t i = 0; i < tools.size(); ++i) {
    const Json& tool = tools[i];
    const std::string where = absl::StrCat("tools[", i, "]");
    if (!tool.is_object()) return WrongType(where, "an object", tool);
    if (auto type = tool.find("type"); type != tool.end() && !type->is_null() && *type != "function") {
      return BadRequest(absl::StrCat("'", where, ".type' must be \"function\" (the only tool type)"), "tools");
    }
    auto function = tool.find("function");
    if (function == tool.end() || !function->is_object()) {
      return BadRequest(absl::StrCat("'", where, ".function' must be an object"), "tools");
    }
    auto name = function->find("name");
    if (name == function->end() || !name->is_string() || name->get_ref<const std::string&>().empty()) {
      return BadRequest(absl::StrCat("'", where, ".function.name' must be a non-empty string"), "tools");
    }
    if (auto d = function->find("description"); d != function->end() && !d->is_null() && !d->is_string()) {
      return BadRequest(absl::StrCat("'", where, ".function.description' must be a string"), "tools");
    }
    ToolSpec spec{name->get<std::string>(), nullptr};
    if (auto p = function->find("parameters"); p != function->end() && !p->is_null()) {
      if (!p->is_object()) return BadRequest(absl::StrCat("'", where, ".function.parameters' must be an object"), "tools");
      spec.parameters = *p;
    }
    out.push_back(std::move(spec));
  }
  return out;
}

// `tools`, `tool_choice` and `parallel_tool_calls` of a chat request, with vLLM's rules: tools
// without tool_choice mean "auto"; "auto" needs the server's tool-call parser; "required" and a
// named function are forced through the grammar engine (so they take no other structured-output
// constraint). Call after ParseStructuredOutput.
absl::Status ParseTools(const Json& j, const ProtocolContext& context, v1::SamplingOptions* sampling,
                        ToolCalling* out) {
  DUET_RETURN_IF_ERROR(RejectLegacyFunctions(j));
  std::vector<ToolSpec> tools;
  bool tools_given = false;
  if (auto it = j.find("tools"); it != j.end() && !it->is_null()) {
    DUET_ASSIGN_OR_RETURN(tools, ParseToolList(*it));
    tools_given = true;
  }
  DUET_RETURN_IF_ERROR(GetBool(j, "parallel_tool_calls", &out->parallel));
  auto choice = j.find("tool_choice");
  const char* kChoices = "\"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}";
  if (choice == j.end() || choice->is_null()) {
    out->choice = tools.empty() ? ToolChoice::kNone : ToolChoice::kAuto;
  } else if (choice->is_string()) {
    const std::string& c = choice->get_ref<const std::string&>();
    if (c == "none") {
      out->choice = ToolChoice::kNone;
    } else if (c == "auto" || c == "required") {
      if (!tools_given) return BadRequest("When using `tool_choice`, `tools` must be set.", "tool_choice");
      // Nothing to call: as "none" (OpenAI's behaviour for "required" with no tools).
      out->choice = tools.empty() ? ToolChoice::kNone : c == "auto" ? ToolChoice::kAuto : ToolChoice::kRequired;
    } else {
      return BadRequest(absl::StrCat("'tool_choice' must be ", kChoices, ", got \"", c, "\""), "tool_choice");
    }
  } else if (choice->is_object()) {
    const Json function = choice->value("function", Json());
    const Json name = function.is_object() ? function.value("name", Json()) : Json();
    if (!name.is_string() || name.get_ref<const std::string&>().empty()) {
      return BadRequest(absl::StrCat("'tool_choice' must be ", kChoices), "tool_choice");
    }
    if (!tools_given) return BadRequest("When using `tool_choice`, `tools` must be set.", "tool_choice");
    out->name = name.get<std::string>();
    if (std::none_of(tools.begin(), tools.end(), [&](const ToolSpec& t) { return t.name == out->name; })) {
      return BadRequest(absl::StrCat("the tool '", out->name, "' in `tool_choice` is not one of `tools`"),
                        "tool_choice");
    }
    out->choice = ToolChoice::kNamed;
  } else {
    return WrongType("tool_choice", kChoices, *choice);
  }
  if (out->choice == ToolChoice::kAuto) {
    if (!context.auto_tool_call_format) {
      return BadRequest("\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set",
                        "tool_choice");
    }
    out->format = context.auto_tool_call_format;
  }
  if (out->choice != ToolChoice::kRequired && out->choice != ToolChoice::kNamed) return absl::OkStatus();
  if (sampling->has_structured_output()) {
    return BadRequest("'tool_choice' \"required\" or a named function forces the output's form and cannot be "
                      "combined with response_format or guided_*",
                      "tool_choice");
  }
  Json schema;
  if (out->choice == ToolChoice::kNamed) {
    schema = NamedToolCallSchema(*std::find_if(tools.begin(), tools.end(),
                                               [&](const ToolSpec& t) { return t.name == out->name; }));
  } else {
    absl::StatusOr<Json> required = RequiredToolCallSchema(tools, out->parallel);
    if (!required.ok()) return BadRequest(required.status().message(), "tools");
    schema = *std::move(required);
  }
  v1::SamplingOptions forced;
  forced.mutable_structured_output()->set_json_schema(schema.dump(-1, ' ', false, Json::error_handler_t::replace));
  absl::StatusOr<SamplingParams> converted = rpc::ToSamplingParams(forced);
  if (!converted.ok()) return BadRequest(converted.status().message(), "tools");
  if (absl::StatusOr<std::shared_ptr<const grammar::Grammar>> g = grammar::BuildGrammar(converted->structured_output);
      !g.ok()) {
    return BadRequest(absl::StrCat("tools: the parameters cannot be enforced: ", g.status().message()), "tools");
  }
  *sampling->mutable_structured_output() = forced.structured_output();
  return absl::OkStatus();
}

// An assistant message's tool_calls as chat templates expect them (as vLLM and Hugging Face pass
// them): each call's `arguments`, a JSON string in the API, as the JSON value it holds.
absl::Status NormalizeToolCalls(const std::string& where, Json* message) {
  auto calls = message->find("tool_calls");
  if (calls == message->end() || calls->is_null()) return absl::OkStatus();
  const std::string field = where + ".tool_calls";
  if (!calls->is_array()) return WrongType(field, "a list of tool calls", *calls);
  for (size_t k = 0; k < calls->size(); ++k) {
    Json& call = (*calls)[k];
    const std::string at = absl::StrCat(field, "[", k, "]");
    if (!call.is_object()) return WrongType(at, "an object", call);
    auto function = call.find("function");
    if (function == call.end() || !function->is_object()) {
      return BadRequest(absl::StrCat("'", at, ".function' must be an object"), field);
    }
    auto name = function->find("name");
    if (name == function->end() || !name->is_string()) {
      return BadRequest(absl::StrCat("'", at, ".function.name' must be a string"), field);
    }
    auto arguments = function->find("arguments");
    if (arguments == function->end() || arguments->is_null()) {
      (*function)["arguments"] = Json::object();
    } else if (arguments->is_string()) {
      const std::string& text = arguments->get_ref<const std::string&>();
      Json value = JsonDepthWithin(text, kMaxRequestJsonDepth) ? Json::parse(text, nullptr, /*allow_exceptions=*/false)
                                                    : Json(Json::value_t::discarded);
      if (value.is_discarded()) {
        return BadRequest(absl::StrCat("'", at, ".function.arguments' is not valid JSON"), field);
      }
      *arguments = std::move(value);
    } else if (!arguments->is_object()) {
      return WrongType(at + ".function.arguments", "a JSON string", *arguments);
    }
  }
  return absl::OkStatus();
}

// One constraint of structured outputs (`field` names it in errors) onto `s`.
absl::Status SetConstraint(const std::string& field, const std::string& kind, const Json& value,
                           v1::StructuredOutput* s) {
  if (kind == "json") {
    if (value.is_string()) {
      s->set_json_schema(value.get<std::string>());
    } else if (value.is_object() || value.is_boolean()) {
      s->set_json_schema(value.dump());
    } else {
      return WrongType(field, "a JSON schema (an object, or a string holding one)", value);
    }
  } else if (kind == "json_object") {
    if (!value.is_boolean()) return WrongType(field, "a boolean", value);
    if (!value.get<bool>()) return absl::OkStatus();
    s->set_json_object(true);
  } else if (kind == "regex" || kind == "grammar") {
    if (!value.is_string()) return WrongType(field, "a string", value);
    kind == "regex" ? s->set_regex(value.get<std::string>()) : s->set_grammar(value.get<std::string>());
  } else if (kind == "choice") {
    if (!value.is_array() || value.empty()) return WrongType(field, "a non-empty list of strings", value);
    for (const Json& c : value) {
      if (!c.is_string()) return WrongType(field, "a non-empty list of strings", value);
      s->mutable_choice()->add_choices(c.get<std::string>());
    }
  }
  return absl::OkStatus();
}

// Structured outputs, from OpenAI's `response_format` or vLLM's `guided_json`, `guided_regex`,
// `guided_choice`, `guided_grammar` (and `structured_outputs`, vLLM's newer spelling); at most
// one constraint. The grammar is built here so that a bad schema, regex or grammar is a 400
// naming the field before anything runs.
absl::Status ParseStructuredOutput(const Json& j, v1::SamplingOptions* sampling) {
  v1::StructuredOutput s;
  std::vector<std::string> given;
  auto set = [&](const std::string& field, const std::string& kind, const Json& value) -> absl::Status {
    v1::StructuredOutput one;
    DUET_RETURN_IF_ERROR(SetConstraint(field, kind, value, &one));
    if (one.constraint_case() == v1::StructuredOutput::CONSTRAINT_NOT_SET) return absl::OkStatus();
    given.push_back(field);
    s = std::move(one);
    return absl::OkStatus();
  };
  if (auto it = j.find("response_format"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return WrongType("response_format", "an object", *it);
    auto type = it->find("type");
    if (type == it->end() || !type->is_string()) {
      return BadRequest("'response_format.type' must be \"text\", \"json_object\" or \"json_schema\"",
                        "response_format");
    }
    const std::string t = type->get<std::string>();
    if (t == "json_object") {
      DUET_RETURN_IF_ERROR(set("response_format", "json_object", true));
    } else if (t == "json_schema") {
      auto js = it->find("json_schema");
      if (js == it->end() || !js->is_object()) {
        return BadRequest("'response_format.json_schema' must be an object with a 'schema'", "response_format");
      }
      auto schema = js->find("schema");
      if (schema == js->end() || schema->is_null()) {
        return BadRequest("'response_format.json_schema.schema' is required", "response_format");
      }
      if (auto strict = js->find("strict"); strict != js->end() && !strict->is_null() && !strict->is_boolean()) {
        return WrongType("response_format.json_schema.strict", "a boolean", *strict);
      }
      // strict or not, the output follows the schema exactly.
      DUET_RETURN_IF_ERROR(set("response_format", "json", *schema));
    } else if (t != "text") {
      return BadRequest(absl::StrCat("'response_format.type' \"", t,
                                     "\" is not supported (text, json_object and json_schema are)"),
                        "response_format");
    }
  }
  for (const auto& [field, kind] : std::vector<std::pair<std::string, std::string>>{
           {"guided_json", "json"}, {"guided_regex", "regex"}, {"guided_choice", "choice"}, {"guided_grammar", "grammar"}}) {
    if (auto it = j.find(field); it != j.end() && !it->is_null()) DUET_RETURN_IF_ERROR(set(field, kind, *it));
  }
  if (auto it = j.find("structured_outputs"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return WrongType("structured_outputs", "an object", *it);
    for (const auto& [key, value] : it->items()) {
      if (value.is_null()) continue;
      const std::string field = absl::StrCat("structured_outputs.", key);
      if (key == "json" || key == "regex" || key == "choice" || key == "grammar" || key == "json_object") {
        DUET_RETURN_IF_ERROR(set(field, key, value));
      } else if (key != "disable_fallback" && key != "disable_any_whitespace" && key != "disable_additional_properties") {
        return BadRequest(absl::StrCat("'", field, "' is not supported"), field);
      }
    }
  }
  if (auto it = j.find("guided_whitespace_pattern"); it != j.end() && !it->is_null()) {
    return BadRequest("'guided_whitespace_pattern' is not supported", "guided_whitespace_pattern");
  }
  if (auto it = j.find("guided_decoding_backend"); it != j.end() && !it->is_null() && !it->is_string()) {
    return WrongType("guided_decoding_backend", "a string", *it);  // any backend name: Duet has one
  }
  if (given.size() > 1) {
    return BadRequest(absl::StrCat("only one structured-output constraint may be given, got ", absl::StrJoin(given, ", ")),
                      given[1]);
  }
  if (given.empty()) return absl::OkStatus();
  absl::StatusOr<SamplingParams> converted = [&] {
    v1::SamplingOptions only;
    *only.mutable_structured_output() = s;
    return rpc::ToSamplingParams(only);
  }();
  if (!converted.ok()) return BadRequest(converted.status().message(), given[0]);
  if (absl::StatusOr<std::shared_ptr<const grammar::Grammar>> g = grammar::BuildGrammar(converted->structured_output);
      !g.ok()) {
    return BadRequest(absl::StrCat(given[0], ": ", g.status().message()), given[0]);
  }
  *sampling->mutable_structured_output() = std::move(s);
  return absl::OkStatus();
}

// `stream` and `stream_options`.
absl::Status ParseStreaming(const Json& j, ParsedRequest* out) {
  DUET_RETURN_IF_ERROR(GetBool(j, "stream", &out->stream));
  if (auto it = j.find("stream_options"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return WrongType("stream_options", "an object", *it);
    if (!out->stream) {
      return BadRequest("'stream_options' can only be given when 'stream' is true", "stream_options");
    }
    DUET_RETURN_IF_ERROR(GetBool(*it, "include_usage", &out->include_usage));
  }
  return absl::OkStatus();
}

// vLLM's `prompt_logprobs` (after `stream`): 0 to max_logprobs, not with streaming (as vLLM,
// which takes 0 there and returns nothing).
absl::Status ParsePromptLogprobs(const Json& j, const ProtocolContext& context, ParsedRequest* out) {
  std::optional<int64_t> k;
  DUET_RETURN_IF_ERROR(GetInt(j, "prompt_logprobs", 0, context.max_logprobs, &k));
  if (!k) return absl::OkStatus();
  if (out->stream) {
    if (*k == 0) return absl::OkStatus();
    return BadRequest("'prompt_logprobs' are not available when 'stream' is true", "prompt_logprobs");
  }
  out->prompt_logprobs = static_cast<int>(*k);
  out->sampling.set_prompt_logprobs(static_cast<int32_t>(*k));
  return absl::OkStatus();
}

// The fields both endpoints share, checked in this order (the first bad one is the error).
absl::Status ParseCommon(const Json& j, const ProtocolContext& context, ParsedRequest* out) {
  DUET_RETURN_IF_ERROR(CheckModel(j, context));
  out->model = context.model_name;
  DUET_RETURN_IF_ERROR(ParseSampling(j, context, out));
  DUET_RETURN_IF_ERROR(ParseStops(j, &out->sampling));
  DUET_RETURN_IF_ERROR(CheckUnsupportedFields(j, context, out->n));
  DUET_RETURN_IF_ERROR(ParseLogitBias(j, context, &out->sampling));
  DUET_RETURN_IF_ERROR(ParseCacheSalt(j, &out->sampling));
  if (!out->chat) DUET_RETURN_IF_ERROR(RejectToolCalling(j));
  DUET_RETURN_IF_ERROR(ParseStructuredOutput(j, &out->sampling));
  DUET_RETURN_IF_ERROR(ParseStreaming(j, out));
  DUET_RETURN_IF_ERROR(ParsePromptLogprobs(j, context, out));
  if (auto it = j.find("request_id"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) return WrongType("request_id", "a string", *it);
    const std::string& id = it->get_ref<const std::string&>();
    if (absl::Status s = CheckRequestIdLength(id); !s.ok()) return BadRequest(s.message(), "request_id");
    if (!id.empty()) out->request_id = id;
  }
  out->created = UnixSecondsNow();
  return absl::OkStatus();
}

// The sampling fields' ranges (the engine's own rules), as a 400.
absl::Status ValidateSampling(const ParsedRequest& request) {
  v1::SamplingOptions sampling = request.sampling;
  if (request.seed) sampling.set_seed(*request.seed);
  absl::StatusOr<SamplingParams> params = rpc::ToSamplingParams(sampling);
  if (!params.ok()) return BadRequest(std::string(params.status().message()));
  return absl::OkStatus();
}

void ClampLogprob(Json* out, float value) {
  *out = std::isfinite(value) ? static_cast<double>(value) : -9999.0;
}

Json Bytes(const std::string& s) {
  Json bytes = Json::array();
  for (unsigned char c : s) bytes.push_back(static_cast<int>(c));
  return bytes;
}

}  // namespace

absl::Status BadRequest(absl::string_view message, std::optional<std::string> param) {
  return WithDetails(absl::InvalidArgumentError(message), std::move(param), std::nullopt);
}

absl::Status NotFound(absl::string_view message, std::optional<std::string> code, std::optional<std::string> param) {
  return WithDetails(absl::NotFoundError(message), std::move(param), std::move(code));
}

ApiError ToApiError(const absl::Status& status) {
  ApiError e;
  e.message = std::string(status.message());
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kOutOfRange:
      e.status = 400;
      break;
    case absl::StatusCode::kNotFound:
      e.status = 404;
      break;
    case absl::StatusCode::kResourceExhausted:
      e.status = 429;
      e.type = "rate_limit_error";
      e.code = "rate_limit_exceeded";
      break;
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kPermissionDenied:
      e.status = 401;
      e.type = "authentication_error";
      e.code = "invalid_api_key";
      break;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
      e.status = 503;
      e.type = "service_unavailable";
      break;
    default:
      e.status = 500;
      e.type = "server_error";
      break;
  }
  if (absl::optional<absl::Cord> param = status.GetPayload(kParamPayload)) e.param = std::string(*param);
  if (absl::optional<absl::Cord> code = status.GetPayload(kCodePayload)) e.code = std::string(*code);
  return e;
}

std::string ErrorBody(const ApiError& error) {
  Json inner;
  inner["message"] = error.message;
  inner["type"] = error.type;
  inner["param"] = error.param ? Json(*error.param) : Json(nullptr);
  inner["code"] = error.code ? Json(*error.code) : Json(nullptr);
  Json out;
  out["error"] = std::move(inner);
  return out.dump(-1, ' ', false, Json::error_handler_t::replace);
}

ApiError FromGrpc(const grpc::Status& status) {
  ApiError e = ToApiError(rpc::FromGrpc(status));
  if (e.status == 400 && absl::StrContains(e.message, "maximum context length")) e.code = "context_length_exceeded";
  if (e.message.empty()) e.message = absl::StrCat("request failed (gRPC code ", status.error_code(), ")");
  return e;
}

absl::Status CheckModel(const Json& j, const ProtocolContext& context) {
  auto it = j.find("model");
  if (it == j.end() || it->is_null()) return absl::OkStatus();  // vLLM: the served model
  if (!it->is_string()) return WrongType("model", "a string", *it);
  const std::string& model = it->get_ref<const std::string&>();
  if (model != context.model_name &&
      std::find(context.model_aliases.begin(), context.model_aliases.end(), model) == context.model_aliases.end()) {
    return NotFound(absl::StrCat("The model `", it->get<std::string>(), "` does not exist."), "model_not_found",
                    "model");
  }
  return absl::OkStatus();
}

int64_t UnixSecondsNow() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

absl::StatusOr<ParsedRequest> ParseCompletionRequest(std::string_view body, const ProtocolContext& context) {
  DUET_ASSIGN_OR_RETURN(const Json j, ParseBody(body));
  ParsedRequest out;
  DUET_RETURN_IF_ERROR(ParseCommon(j, context, &out));
  auto it = j.find("prompt");
  if (it == j.end() || it->is_null()) return BadRequest("'prompt' is required", "prompt");
  const char* kPromptTypes = "a string, a list of strings, a list of token ids or a list of lists of token ids";
  if (it->is_string()) {
    out.prompts.push_back({true, it->get<std::string>(), {}});
  } else if (it->is_array()) {
    if (it->empty()) return BadRequest("'prompt' is an empty list", "prompt");
    const Json& first = it->front();
    if (first.is_string()) {
      for (const Json& e : *it) {
        if (!e.is_string()) return WrongType("prompt", kPromptTypes, *it);
        out.prompts.push_back({true, e.get<std::string>(), {}});
      }
    } else if (first.is_number_integer()) {
      PromptInput p;
      DUET_RETURN_IF_ERROR(GetTokenIds(*it, "prompt", &p.token_ids));
      out.prompts.push_back(std::move(p));
    } else if (first.is_array()) {
      for (const Json& e : *it) {
        if (!e.is_array()) return WrongType("prompt", kPromptTypes, *it);
        if (e.empty()) return BadRequest("'prompt' has an empty list of token ids", "prompt");
        PromptInput p;
        DUET_RETURN_IF_ERROR(GetTokenIds(e, "prompt", &p.token_ids));
        out.prompts.push_back(std::move(p));
      }
    } else {
      return WrongType("prompt", kPromptTypes, *it);
    }
  } else {
    return WrongType("prompt", kPromptTypes, *it);
  }
  DUET_RETURN_IF_ERROR(GetBool(j, "echo", &out.echo));
  if (auto lp = j.find("logprobs"); lp != j.end() && !lp->is_null()) {
    if (lp->is_boolean()) return WrongType("logprobs", "an integer", *lp);
    std::optional<int64_t> n;
    DUET_RETURN_IF_ERROR(GetInt(j, "logprobs", 0, context.max_logprobs, &n));
    out.logprobs = static_cast<int>(*n);
    out.sampling.set_logprobs(out.logprobs.value());
  }
  // The echoed prompt's tokens get logprobs too (vLLM: prompt_logprobs defaults to logprobs).
  if (out.echo && out.logprobs && !out.sampling.has_prompt_logprobs()) out.sampling.set_prompt_logprobs(*out.logprobs);
  if (auto sx = j.find("suffix"); sx != j.end() && !sx->is_null()) {
    return BadRequest("'suffix' is not supported", "suffix");
  }
  if (static_cast<int64_t>(out.prompts.size()) * out.n > kMaxChoices) {
    return BadRequest(absl::StrCat("too many choices: ", out.prompts.size(), " prompts × n=", out.n, " is over ",
                                   kMaxChoices));
  }
  DUET_RETURN_IF_ERROR(ValidateSampling(out));
  return out;
}

absl::StatusOr<std::string> RenderChat(const Json& j, const ProtocolContext& context) {
  if (context.chat == nullptr) return BadRequest("this model has no chat template");
  auto it = j.find("messages");
  if (it == j.end() || it->is_null()) return BadRequest("'messages' is required", "messages");
  if (!it->is_array()) return WrongType("messages", "a list of messages", *it);
  if (it->empty()) return BadRequest("'messages' is an empty list", "messages");
  Json messages = Json::array();
  for (size_t m = 0; m < it->size(); ++m) {
    const Json& message = (*it)[m];
    const std::string where = absl::StrCat("messages[", m, "]");
    if (!message.is_object()) return WrongType(where, "an object", message);
    auto role = message.find("role");
    if (role == message.end() || !role->is_string()) {
      return BadRequest(absl::StrCat("'", where, ".role' must be a string"), where + ".role");
    }
    Json copy = message;
    DUET_RETURN_IF_ERROR(NormalizeToolCalls(where, &copy));
    auto content = message.find("content");
    if (content == message.end() || content->is_null()) {
      copy["content"] = nullptr;
    } else if (content->is_string()) {
      // as is
    } else if (content->is_array()) {
      std::vector<std::string> texts;
      for (const Json& part : *content) {
        if (!part.is_object() || !part.contains("type") || !part["type"].is_string()) {
          return BadRequest(absl::StrCat("'", where, ".content' parts must be objects with a 'type'"),
                            where + ".content");
        }
        if (part["type"] != "text") {
          return BadRequest(absl::StrCat("content part type '", part["type"].get<std::string>(),
                                         "' is not supported (only 'text')"),
                            where + ".content");
        }
        auto text = part.find("text");
        if (text == part.end() || !text->is_string()) {
          return BadRequest(absl::StrCat("'", where, ".content' text parts need a string 'text'"), where + ".content");
        }
        texts.push_back(text->get<std::string>());
      }
      copy["content"] = absl::StrJoin(texts, "\n");
    } else {
      return WrongType(where + ".content", "a string or a list of content parts", *content);
    }
    messages.push_back(std::move(copy));
  }
  bool add_generation_prompt = true;
  DUET_RETURN_IF_ERROR(GetBool(j, "add_generation_prompt", &add_generation_prompt));
  Json variables;
  variables["messages"] = std::move(messages);
  variables["add_generation_prompt"] = add_generation_prompt;
  variables["bos_token"] = context.chat->bos_token;
  variables["eos_token"] = context.chat->eos_token;
  if (auto tools = j.find("tools"); tools != j.end() && !tools->is_null()) {
    if (!tools->is_array()) return WrongType("tools", "a list", *tools);
    variables["tools"] = *tools;
  }
  if (auto kwargs = j.find("chat_template_kwargs"); kwargs != j.end() && !kwargs->is_null()) {
    if (!kwargs->is_object()) return WrongType("chat_template_kwargs", "an object", *kwargs);
    for (auto& [key, value] : kwargs->items()) {
      if (key != "messages") variables[key] = value;
    }
  }
  absl::StatusOr<std::string> rendered = context.chat->chat_template.Render(variables);
  if (!rendered.ok()) {
    return BadRequest(absl::StrCat("chat template: ", rendered.status().message()), "messages");
  }
  return *std::move(rendered);
}

absl::StatusOr<ChatInput> ParseChatInput(const Json& j, const ProtocolContext& context, v1::SamplingOptions* sampling) {
  ChatInput out;
  DUET_RETURN_IF_ERROR(ParseTools(j, context, sampling, &out.tools));
  DUET_ASSIGN_OR_RETURN(const std::string prompt, RenderChat(j, context));
  if (context.tokenizer == nullptr) return BadRequest("chat needs a tokenizer");
  out.prompt_token_ids = context.tokenizer->Encode(prompt, /*add_special_tokens=*/false);
  if (out.prompt_token_ids.empty()) return BadRequest("the chat prompt has no tokens", "messages");
  if (!sampling->has_max_tokens()) {
    // vLLM: what is left of the context.
    const int64_t left = context.max_model_len - static_cast<int64_t>(out.prompt_token_ids.size());
    sampling->set_max_tokens(static_cast<int32_t>(std::clamp<int64_t>(left, 1, std::numeric_limits<int32_t>::max())));
  }
  return out;
}

absl::StatusOr<ParsedRequest> ParseChatRequest(std::string_view body, const ProtocolContext& context) {
  DUET_ASSIGN_OR_RETURN(const Json j, ParseBody(body));
  ParsedRequest out;
  out.chat = true;
  DUET_RETURN_IF_ERROR(ParseCommon(j, context, &out));
  bool logprobs = false;
  DUET_RETURN_IF_ERROR(GetBool(j, "logprobs", &logprobs));
  std::optional<int64_t> top;
  DUET_RETURN_IF_ERROR(GetInt(j, "top_logprobs", 0, context.max_logprobs, &top));
  if (top && !logprobs) {
    return BadRequest("'top_logprobs' needs 'logprobs' set to true", "top_logprobs");
  }
  if (logprobs) {
    out.logprobs = static_cast<int>(top.value_or(0));
    out.sampling.set_logprobs(*out.logprobs);
  }
  DUET_ASSIGN_OR_RETURN(ChatInput chat, ParseChatInput(j, context, &out.sampling));
  out.tools = std::move(chat.tools);
  PromptInput input;
  input.token_ids = std::move(chat.prompt_token_ids);
  out.prompts.push_back(std::move(input));
  DUET_RETURN_IF_ERROR(ValidateSampling(out));
  return out;
}

absl::StatusOr<Json> Tokenize(std::string_view body, const ProtocolContext& context) {
  DUET_ASSIGN_OR_RETURN(const Json j, ParseBody(body));
  DUET_RETURN_IF_ERROR(CheckModel(j, context));
  if (context.tokenizer == nullptr) return BadRequest("no tokenizer");
  std::vector<int32_t> ids;
  if (j.contains("messages")) {
    bool add_special_tokens = false;
    DUET_RETURN_IF_ERROR(GetBool(j, "add_special_tokens", &add_special_tokens));
    DUET_ASSIGN_OR_RETURN(const std::string prompt, RenderChat(j, context));
    ids = context.tokenizer->Encode(prompt, add_special_tokens);
  } else {
    auto it = j.find("prompt");
    if (it == j.end() || it->is_null()) return BadRequest("'prompt' or 'messages' is required", "prompt");
    if (!it->is_string()) return WrongType("prompt", "a string", *it);
    bool add_special_tokens = true;
    DUET_RETURN_IF_ERROR(GetBool(j, "add_special_tokens", &add_special_tokens));
    ids = context.tokenizer->Encode(it->get_ref<const std::string&>(), add_special_tokens);
  }
  bool return_token_strs = false;
  DUET_RETURN_IF_ERROR(GetBool(j, "return_token_strs", &return_token_strs));
  Json out;
  out["count"] = ids.size();
  out["max_model_len"] = context.max_model_len;
  out["tokens"] = ids;
  if (return_token_strs) {
    Json strs = Json::array();
    for (int32_t id : ids) strs.push_back(context.tokenizer->IdToToken(id).value_or(""));
    out["token_strs"] = std::move(strs);
  } else {
    out["token_strs"] = nullptr;
  }
  return out;
}

absl::StatusOr<Json> Detokenize(std::string_view body, const ProtocolContext& context) {
  DUET_ASSIGN_OR_RETURN(const Json j, ParseBody(body));
  DUET_RETURN_IF_ERROR(CheckModel(j, context));
  if (context.tokenizer == nullptr) return BadRequest("no tokenizer");
  auto it = j.find("tokens");
  if (it == j.end() || it->is_null()) return BadRequest("'tokens' is required", "tokens");
  if (!it->is_array()) return WrongType("tokens", "a list of integers", *it);
  std::vector<int32_t> ids;
  DUET_RETURN_IF_ERROR(GetTokenIds(*it, "tokens", &ids));
  for (int32_t id : ids) {
    if (id < 0 || id >= context.tokenizer->vocab_size()) {
      return BadRequest(absl::StrCat("token id ", id, " is out of vocabulary (vocab size ",
                                     context.tokenizer->vocab_size(), ")"),
                        "tokens");
    }
  }
  Json out;
  out["prompt"] = context.tokenizer->Decode(ids, /*skip_special_tokens=*/false);
  return out;
}

// --- responses ---

Json UsageJson(int prompt_tokens, int completion_tokens) {
  Json usage;
  usage["prompt_tokens"] = prompt_tokens;
  usage["completion_tokens"] = completion_tokens;
  usage["total_tokens"] = prompt_tokens + completion_tokens;
  // Prefix-cache hits are not reported to the router yet: unknown, not 0.
  usage["prompt_tokens_details"] = nullptr;
  return usage;
}

Json StopReason(const v1::SamplingOptions& sampling, const Tokenizer* tokenizer, const std::vector<int32_t>& token_ids) {
  if (token_ids.empty()) return nullptr;
  // A stop token is the last token (in token_ids, not in the text).
  const int32_t last = token_ids.back();
  if (std::find(sampling.stop_token_ids().begin(), sampling.stop_token_ids().end(), last) !=
      sampling.stop_token_ids().end()) {
    return last;
  }
  if (sampling.stop().empty() || tokenizer == nullptr) return nullptr;
  // The engine cut the text where the first stop string began; the output's tokens still hold it.
  const std::string decoded = tokenizer->Decode(token_ids, /*skip_special_tokens=*/true);
  size_t best = std::string::npos;
  Json reason = nullptr;
  for (const std::string& stop : sampling.stop()) {
    const size_t at = decoded.find(stop);
    if (at < best) {
      best = at;
      reason = stop;
    }
  }
  return reason;
}

std::string TokenString(const Tokenizer* tokenizer, int32_t id) {
  if (tokenizer == nullptr) return absl::StrCat("token_id:", id);
  return tokenizer->Decode(absl::MakeConstSpan(&id, 1), /*skip_special_tokens=*/false);
}

Json CompletionLogprobs(const Tokenizer* tokenizer, const std::vector<int32_t>& ids,
                        const std::vector<v1::TokenLogprobs>& logprobs, size_t* offset, size_t num_unscored) {
  Json tokens = Json::array(), token_logprobs = Json::array(), top_logprobs = Json::array(),
       text_offset = Json::array();
  for (size_t k = 0; k < ids.size() && k < logprobs.size() + num_unscored; ++k) {
    const std::string token = TokenString(tokenizer, ids[k]);
    tokens.push_back(token);
    text_offset.push_back(*offset);
    *offset += token.size();
    if (k < num_unscored) {
      token_logprobs.push_back(nullptr);
      top_logprobs.push_back(nullptr);
      continue;
    }
    const v1::TokenLogprobs& scored = logprobs[k - num_unscored];
    Json lp;
    ClampLogprob(&lp, scored.logprob());
    token_logprobs.push_back(lp);
    Json top = Json::object();
    for (const v1::TopLogprob& t : scored.top()) {
      Json v;
      ClampLogprob(&v, t.logprob());
      top[TokenString(tokenizer, t.token_id())] = v;
    }
    top_logprobs.push_back(std::move(top));
  }
  Json out;
  out["tokens"] = std::move(tokens);
  out["token_logprobs"] = std::move(token_logprobs);
  out["top_logprobs"] = std::move(top_logprobs);
  out["text_offset"] = std::move(text_offset);
  return out;
}

Json PromptLogprobsJson(const Tokenizer* tokenizer, const std::vector<int32_t>& prompt_ids,
                        const std::vector<v1::TokenLogprobs>& logprobs) {
  auto entry = [&](float logprob, int32_t rank, int32_t id) {
    Json e;
    ClampLogprob(&e["logprob"], logprob);
    e["rank"] = rank;
    e["decoded_token"] = TokenString(tokenizer, id);
    return e;
  };
  Json out = Json::array();
  if (prompt_ids.empty()) return out;
  out.push_back(nullptr);  // the first token is not predicted
  for (size_t i = 0; i < logprobs.size() && i + 1 < prompt_ids.size(); ++i) {
    const int32_t id = prompt_ids[i + 1];
    const v1::TokenLogprobs& lp = logprobs[i];
    Json position = Json::object();
    position[std::to_string(id)] = entry(lp.logprob(), lp.rank(), id);
    for (int t = 0; t < lp.top_size(); ++t) {
      if (lp.top(t).token_id() == id) continue;  // its own entry, already first
      position[std::to_string(lp.top(t).token_id())] = entry(lp.top(t).logprob(), t + 1, lp.top(t).token_id());
    }
    out.push_back(std::move(position));
  }
  return out;
}

Json ChatLogprobs(const Tokenizer* tokenizer, const std::vector<int32_t>& ids,
                  const std::vector<v1::TokenLogprobs>& logprobs, int top_n) {
  Json content = Json::array();
  for (size_t k = 0; k < ids.size() && k < logprobs.size(); ++k) {
    Json entry;
    const std::string token = TokenString(tokenizer, ids[k]);
    entry["token"] = token;
    ClampLogprob(&entry["logprob"], logprobs[k].logprob());
    entry["bytes"] = Bytes(token);
    Json top = Json::array();
    for (int t = 0; t < logprobs[k].top_size() && t < top_n; ++t) {
      Json item;
      const std::string s = TokenString(tokenizer, logprobs[k].top(t).token_id());
      item["token"] = s;
      ClampLogprob(&item["logprob"], logprobs[k].top(t).logprob());
      item["bytes"] = Bytes(s);
      top.push_back(std::move(item));
    }
    entry["top_logprobs"] = std::move(top);
    content.push_back(std::move(entry));
  }
  Json out;
  out["content"] = std::move(content);
  return out;
}

namespace {
Json Header(const std::string& id, const char* object, const ParsedRequest& request) {
  Json out;
  out["id"] = id;
  out["object"] = object;
  out["created"] = request.created;
  out["model"] = request.model;
  return out;
}

// prompt tokens counted once per prompt; completion tokens of every choice.
Json TotalUsage(const ParsedRequest& request, const std::vector<ChoiceResult>& choices) {
  int prompt = 0, completion = 0;
  for (const ChoiceResult& c : choices) {
    if (c.index % request.n == 0) prompt += c.prompt_tokens;
    completion += c.completion_tokens;
  }
  return UsageJson(prompt, completion);
}
}  // namespace

Json CompletionResponse(const std::string& id, const ParsedRequest& request, const Tokenizer* tokenizer,
                        const std::vector<ChoiceResult>& choices, const std::vector<std::string>& echo_prefix) {
  Json out = Header(id, "text_completion", request);
  Json list = Json::array();
  for (const ChoiceResult& c : choices) {
    const size_t prompt = static_cast<size_t>(c.index / request.n);
    const std::string prefix = request.echo && prompt < echo_prefix.size() ? echo_prefix[prompt] : "";
    Json choice;
    choice["index"] = c.index;
    choice["text"] = prefix + c.text;
    if (request.logprobs && request.echo) {
      // The echoed prompt's tokens, then the output's, offsets counted from the first (as vLLM).
      std::vector<int32_t> ids = c.prompt_token_ids;
      ids.insert(ids.end(), c.token_ids.begin(), c.token_ids.end());
      std::vector<v1::TokenLogprobs> logprobs = c.prompt_logprobs;
      logprobs.insert(logprobs.end(), c.logprobs.begin(), c.logprobs.end());
      size_t offset = 0;
      choice["logprobs"] = CompletionLogprobs(tokenizer, ids, logprobs, &offset, /*num_unscored=*/1);
    } else if (request.logprobs) {
      size_t offset = prefix.size();
      choice["logprobs"] = CompletionLogprobs(tokenizer, c.token_ids, c.logprobs, &offset);
    } else {
      choice["logprobs"] = nullptr;
    }
    choice["finish_reason"] = c.finish_reason.empty() ? Json(nullptr) : Json(c.finish_reason);
    choice["stop_reason"] = c.stop_reason;
    if (request.prompt_logprobs) {
      choice["prompt_logprobs"] = PromptLogprobsJson(tokenizer, c.prompt_token_ids, c.prompt_logprobs);
    }
    list.push_back(std::move(choice));
  }
  out["choices"] = std::move(list);
  out["usage"] = TotalUsage(request, choices);
  return out;
}

Json ChatResponse(const std::string& id, const ParsedRequest& request, const Tokenizer* tokenizer,
                  const std::vector<ChoiceResult>& choices) {
  Json out = Header(id, "chat.completion", request);
  Json list = Json::array();
  for (const ChoiceResult& c : choices) {
    Json choice;
    choice["index"] = c.index;
    Json message;
    message["role"] = "assistant";
    std::string finish_reason = c.finish_reason;
    if (std::unique_ptr<ToolCallParser> parser = NewToolCallParser(request.tools)) {
      const ParsedOutput parsed = ParseToolCalls(*parser, c.text);
      message["content"] = parsed.calls.empty() || !parsed.content.empty() ? Json(parsed.content) : Json(nullptr);
      if (!parsed.calls.empty()) {
        Json calls = Json::array();
        for (const ToolCall& call : parsed.calls) calls.push_back(ToolCallJson(call));
        message["tool_calls"] = std::move(calls);
      }
      finish_reason = ChatFinishReason(finish_reason, static_cast<int>(parsed.calls.size()));
    } else {
      message["content"] = c.text;
    }
    choice["message"] = std::move(message);
    choice["logprobs"] = request.logprobs ? ChatLogprobs(tokenizer, c.token_ids, c.logprobs, *request.logprobs)
                                          : Json(nullptr);
    choice["finish_reason"] = finish_reason.empty() ? Json(nullptr) : Json(finish_reason);
    choice["stop_reason"] = c.stop_reason;
    list.push_back(std::move(choice));
  }
  out["choices"] = std::move(list);
  out["usage"] = TotalUsage(request, choices);
  // vLLM: the prompt's, once for the response (every choice has the same prompt).
  if (request.prompt_logprobs) {
    out["prompt_logprobs"] = choices.empty() ? Json(nullptr)
                                             : PromptLogprobsJson(tokenizer, choices[0].prompt_token_ids,
                                                                  choices[0].prompt_logprobs);
  }
  return out;
}

Json CompletionChunk(const std::string& id, const ParsedRequest& request, const ChunkChoice& c) {
  Json out = Header(id, "text_completion", request);
  Json choice;
  choice["index"] = c.index;
  choice["text"] = c.content.value_or("");
  choice["logprobs"] = c.logprobs;
  choice["finish_reason"] = c.finish_reason ? Json(*c.finish_reason) : Json(nullptr);
  if (c.finish_reason) choice["stop_reason"] = c.stop_reason;
  out["choices"] = Json::array({std::move(choice)});
  if (request.include_usage) out["usage"] = nullptr;
  return out;
}

Json ChatChunk(const std::string& id, const ParsedRequest& request, const ChunkChoice& c) {
  Json out = Header(id, "chat.completion.chunk", request);
  Json choice;
  choice["index"] = c.index;
  Json delta = Json::object();
  if (c.role) delta["role"] = "assistant";
  if (c.content) delta["content"] = *c.content;
  if (!c.tool_calls.empty()) {
    Json calls = Json::array();
    for (const OutputDelta::Call& call : c.tool_calls) calls.push_back(ToolCallDeltaJson(call));
    delta["tool_calls"] = std::move(calls);
  }
  choice["delta"] = std::move(delta);
  choice["logprobs"] = c.logprobs;
  choice["finish_reason"] = c.finish_reason ? Json(*c.finish_reason) : Json(nullptr);
  if (c.finish_reason) choice["stop_reason"] = c.stop_reason;
  out["choices"] = Json::array({std::move(choice)});
  if (request.include_usage) out["usage"] = nullptr;
  return out;
}

Json ToolCallDeltaJson(const OutputDelta::Call& call) {
  Json out;
  out["index"] = call.index;
  Json function;
  if (call.id) {
    out["id"] = *call.id;
    out["type"] = "function";
    function["name"] = call.name;
  }
  function["arguments"] = call.arguments;
  out["function"] = std::move(function);
  return out;
}

Json ToolCallJson(const ToolCall& call) {
  Json out;
  out["id"] = call.id;
  out["type"] = "function";
  Json function;
  function["name"] = call.name;
  function["arguments"] = call.arguments;
  out["function"] = std::move(function);
  return out;
}

std::string ChatFinishReason(const std::string& finish_reason, int num_tool_calls) {
  return num_tool_calls > 0 && finish_reason == "stop" ? "tool_calls" : finish_reason;
}

std::unique_ptr<ToolCallParser> NewToolCallParser(const ToolCalling& tools, ToolCallIdFn new_id) {
  switch (tools.choice) {
    case ToolChoice::kNone:
      return nullptr;
    case ToolChoice::kAuto:
      return tools.format ? NewAutoToolCallParser(*tools.format, tools.parallel ? std::numeric_limits<int>::max() : 1,
                                                  std::move(new_id))
                          : nullptr;
    case ToolChoice::kRequired:
      return NewRequiredToolCallParser(std::move(new_id));
    case ToolChoice::kNamed:
      return NewNamedToolCallParser(tools.name, std::move(new_id));
  }
  return nullptr;
}

Json UsageChunk(const std::string& id, const ParsedRequest& request, int prompt_tokens, int completion_tokens) {
  Json out = Header(id, request.chat ? "chat.completion.chunk" : "text_completion", request);
  out["choices"] = Json::array();
  out["usage"] = UsageJson(prompt_tokens, completion_tokens);
  return out;
}

std::string SseEvent(const Json& json) {
  return absl::StrCat("data: ", json.dump(-1, ' ', false, Json::error_handler_t::replace), "\n\n");
}

std::string NewId(std::string_view prefix) { return std::string(prefix) + RandomHex(16); }

}  // namespace duet::router::openai

#include "router/openai_tool_calls.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "router/json_depth.h"
#include "router/request_id.h"

namespace duet::router::openai {
namespace {

using Json = nlohmann::ordered_json;

constexpr int kMaxCallDepth = 64;  // deeper JSON is not taken for a call
constexpr std::string_view kPythonTag = "<|python_tag|>";
constexpr std::string_view kHermesOpen = "<tool_call>";
constexpr std::string_view kHermesClose = "</tool_call>";

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

std::string_view Trimmed(std::string_view s) {
  while (!s.empty() && IsSpace(s.front())) s.remove_prefix(1);
  while (!s.empty() && IsSpace(s.back())) s.remove_suffix(1);
  return s;
}

// The length of the longest suffix of `text` that is a proper prefix of `token`.
size_t PartialSuffix(std::string_view text, std::string_view token) {
  for (size_t n = std::min(text.size(), token.size() - 1); n > 0; --n) {
    if (text.substr(text.size() - n) == token.substr(0, n)) return n;
  }
  return 0;
}

struct CallText {
  std::string name;
  std::string arguments;
};

// {"name": "<non-empty>", "parameters" or "arguments": {...}} → its name and arguments as JSON
// text; nullopt for anything else. Arguments given as a string holding a JSON object are taken.
std::optional<CallText> CallOf(std::string_view text) {
  text = Trimmed(text);
  if (text.empty() || text.front() != '{' || !JsonDepthWithin(text, kMaxCallDepth)) return std::nullopt;
  const Json j = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return std::nullopt;
  auto name = j.find("name");
  if (name == j.end() || !name->is_string() || name->get_ref<const std::string&>().empty()) return std::nullopt;
  for (const char* key : {"parameters", "arguments"}) {
    auto args = j.find(key);
    if (args == j.end()) continue;
    if (args->is_object()) {
      return CallText{name->get<std::string>(), args->dump(-1, ' ', false, Json::error_handler_t::replace)};
    }
    if (args->is_string()) {
      const std::string& s = args->get_ref<const std::string&>();
      if (!JsonDepthWithin(s, kMaxCallDepth)) return std::nullopt;
      const Json parsed = Json::parse(s, nullptr, /*allow_exceptions=*/false);
      if (parsed.is_object()) return CallText{name->get<std::string>(), parsed.dump(-1, ' ', false, Json::error_handler_t::replace)};
    }
    return std::nullopt;
  }
  return std::nullopt;
}

// A sequence of call objects: Llama 3's (optional tag, objects separated by ';') or the forced
// array ("[", objects separated by ',', "]"). `raw_` holds the text since the last call (or the
// start): on a failure it all becomes content.
class JsonSequenceParser final : public ToolCallParser {
 public:
  struct Syntax {
    std::string_view tag;  // may precede the first object
    char open = 0;         // 0: none
    char separator = ';';
    char close = 0;                   // 0: none
    bool separator_optional = false;  // objects may follow each other without one
  };

  JsonSequenceParser(Syntax syntax, int max_calls, ToolCallIdFn new_id)
      : ToolCallParser(std::move(new_id)), syntax_(syntax), max_calls_(max_calls) {}

  void Push(std::string_view text, OutputDelta* out) override {
    if (state_ == State::kContent) {
      out->content += text;
      return;
    }
    raw_ += text;
    Scan(out);
  }

  void Finish(OutputDelta* out) override {
    switch (state_) {
      case State::kContent:
        return;
      case State::kLeading:
      case State::kInObject:
        // An unfinished or absent first object; or one cut short.
        return Fail(out);
      case State::kObjectStart:
        // Only whitespace (and a tag) since the last call, or since "[" / the tag with none.
        if (num_calls() == 0) return Fail(out);
        raw_.clear();
        return;
      case State::kAfterObject:
      case State::kDone:
      case State::kAfterLimit:
        raw_.clear();  // separators and whitespace after the calls
        return;
    }
  }

 private:
  // kAfterLimit: max_calls calls made; whitespace after the last is dropped, the rest is content.
  enum class State { kLeading, kObjectStart, kInObject, kAfterObject, kDone, kAfterLimit, kContent };

  void Scan(OutputDelta* out) {
    while (pos_ < raw_.size() && state_ != State::kContent) {
      const char c = raw_[pos_];
      switch (state_) {
        case State::kLeading:
          if (IsSpace(c)) {
            ++pos_;
          } else if (!syntax_.tag.empty() && c == syntax_.tag.front()) {
            const std::string_view rest = std::string_view(raw_).substr(pos_);
            if (rest.size() < syntax_.tag.size()) {
              if (syntax_.tag.substr(0, rest.size()) != rest) return Fail(out);
              return;  // maybe the tag: wait for more
            }
            if (rest.substr(0, syntax_.tag.size()) != syntax_.tag) return Fail(out);
            pos_ += syntax_.tag.size();
            state_ = State::kObjectStart;
          } else if (syntax_.open != 0) {
            if (c != syntax_.open) return Fail(out);
            ++pos_;
            state_ = State::kObjectStart;
          } else {
            state_ = State::kObjectStart;  // the object's '{' is looked at there
          }
          break;
        case State::kObjectStart:
          if (IsSpace(c)) {
            ++pos_;
          } else if (c == '{') {
            object_start_ = pos_++;
            depth_ = 1;
            in_string_ = escaped_ = false;
            state_ = State::kInObject;
          } else {
            return Fail(out);
          }
          break;
        case State::kInObject:
          ++pos_;
          if (in_string_) {
            if (escaped_) {
              escaped_ = false;
            } else if (c == '\\') {
              escaped_ = true;
            } else if (c == '"') {
              in_string_ = false;
            }
          } else if (c == '"') {
            in_string_ = true;
          } else if (c == '{' || c == '[') {
            if (++depth_ > kMaxCallDepth) return Fail(out);
          } else if (c == '}' || c == ']') {
            if (--depth_ == 0) {
              std::optional<CallText> call = CallOf(std::string_view(raw_).substr(object_start_, pos_ - object_start_));
              if (!call) return Fail(out);
              StartCall(std::move(call->name), std::move(call->arguments), out);
              raw_.erase(0, pos_);
              pos_ = 0;
              state_ = num_calls() >= max_calls_ ? State::kAfterLimit : State::kAfterObject;
            }
          }
          break;
        case State::kAfterObject:
          if (IsSpace(c)) {
            ++pos_;
          } else if (c == syntax_.separator) {
            ++pos_;
            state_ = State::kObjectStart;
          } else if (syntax_.close != 0 && c == syntax_.close) {
            ++pos_;
            state_ = State::kDone;
          } else if (syntax_.separator_optional && c == '{') {
            state_ = State::kObjectStart;
          } else {
            return Fail(out);
          }
          break;
        case State::kDone:
        case State::kAfterLimit:
          if (!IsSpace(c)) {
            raw_.erase(0, pos_);  // the whitespace after the calls
            return Fail(out);
          }
          ++pos_;
          break;
        case State::kContent:
          break;
      }
    }
  }

  // What is held is not (the rest of) a call: it is content, and so is all that follows.
  void Fail(OutputDelta* out) {
    out->content += raw_;
    raw_.clear();
    pos_ = 0;
    state_ = State::kContent;
  }

  const Syntax syntax_;
  const int max_calls_;
  State state_ = State::kLeading;
  std::string raw_;
  size_t pos_ = 0;  // raw_[0, pos_) is scanned
  size_t object_start_ = 0;
  int depth_ = 0;
  bool in_string_ = false;
  bool escaped_ = false;
};

// Hermes / Qwen: <tool_call>{...}</tool_call> blocks in the text.
class HermesParser final : public ToolCallParser {
 public:
  HermesParser(int max_calls, ToolCallIdFn new_id) : ToolCallParser(std::move(new_id)), max_calls_(max_calls) {}

  void Push(std::string_view text, OutputDelta* out) override {
    buf_ += text;
    Scan(out);
  }

  void Finish(OutputDelta* out) override {
    if (in_call_) {
      // An unclosed last block: a call if its JSON is complete.
      if (std::optional<CallText> call = CallOf(buf_)) {
        StartCall(std::move(call->name), std::move(call->arguments), out);
      } else {
        Content(absl::StrCat(ws_before_call_, std::string(kHermesOpen), buf_), out);
      }
    } else {
      Content(buf_, out);  // held whitespace or a tag's beginning: content after all
    }
    buf_.clear();
    ws_before_call_.clear();
    in_call_ = false;
  }

 private:
  void Scan(OutputDelta* out) {
    for (;;) {
      if (in_call_) {
        const size_t close = buf_.find(kHermesClose);
        if (close == std::string::npos) return;
        const std::string inner = buf_.substr(0, close);
        buf_.erase(0, close + kHermesClose.size());
        in_call_ = false;
        if (std::optional<CallText> call = CallOf(inner)) {
          StartCall(std::move(call->name), std::move(call->arguments), out);
          after_call_ = true;
        } else {
          Content(absl::StrCat(ws_before_call_, std::string(kHermesOpen), inner, std::string(kHermesClose)), out);
        }
        ws_before_call_.clear();
        continue;
      }
      const size_t open = num_calls() < max_calls_ ? buf_.find(kHermesOpen) : std::string::npos;
      if (open != std::string::npos) {
        // The text before the block, less its trailing whitespace (held until the block is known).
        std::string_view before = std::string_view(buf_).substr(0, open);
        size_t text_end = before.size();
        while (text_end > 0 && IsSpace(before[text_end - 1])) --text_end;
        Content(before.substr(0, text_end), out);
        ws_before_call_ = std::string(before.substr(text_end));
        buf_.erase(0, open + kHermesOpen.size());
        in_call_ = true;
        continue;
      }
      // No block (yet): emit all but a possible tag's beginning and the whitespace before it.
      const size_t partial = num_calls() < max_calls_ ? PartialSuffix(buf_, kHermesOpen) : 0;
      size_t emit = buf_.size() - partial;
      while (emit > 0 && IsSpace(buf_[emit - 1])) --emit;
      Content(std::string_view(buf_).substr(0, emit), out);
      buf_.erase(0, emit);
      return;
    }
  }

  // Content, less whitespace right after a call.
  void Content(std::string_view text, OutputDelta* out) {
    if (after_call_) {
      while (!text.empty() && IsSpace(text.front())) text.remove_prefix(1);
      if (text.empty()) return;
      after_call_ = false;
    }
    out->content += text;
  }

  const int max_calls_;
  std::string buf_;             // not in a block: held text; in one: what follows <tool_call>
  bool in_call_ = false;
  std::string ws_before_call_;  // whitespace before the open block (content if the block is not a call)
  bool after_call_ = false;     // nothing but whitespace since the last call
};

// A named function: every byte of the output is its arguments.
class NamedParser final : public ToolCallParser {
 public:
  NamedParser(std::string name, ToolCallIdFn new_id) : ToolCallParser(std::move(new_id)), name_(std::move(name)) {}

  void Push(std::string_view text, OutputDelta* out) override {
    if (text.empty()) return;
    if (num_calls() == 0) {
      StartCall(name_, std::string(text), out);
    } else {
      out->calls.push_back({0, std::nullopt, "", std::string(text)});
    }
  }
  void Finish(OutputDelta* out) override {
    if (num_calls() == 0) StartCall(name_, "", out);
  }

 private:
  const std::string name_;
};

// Moves `schema`'s $defs / definitions into `defs`.
absl::Status HoistDefinitions(Json* schema, Json* defs) {
  for (const char* key : {"$defs", "definitions"}) {
    auto it = schema->find(key);
    if (it == schema->end()) continue;
    if (!it->is_object()) return absl::InvalidArgumentError(absl::StrCat("tool parameters: '", key, "' must be an object"));
    Json& into = (*defs)[key];
    for (auto& [name, def] : it->items()) {
      if (into.contains(name) && into[name] != def) {
        return absl::InvalidArgumentError(
            absl::StrCat("tool parameters: '", key, "/", name, "' is defined differently by two tools"));
      }
      into[name] = def;
    }
    schema->erase(it);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ToolCallFormat> ParseToolCallFormat(std::string_view name) {
  for (ToolCallFormat f : {ToolCallFormat::kLlama3Json, ToolCallFormat::kHermes}) {
    if (name == ToolCallFormatName(f)) return f;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("tool call parser must be llama3_json or hermes, got '", std::string(name), "'"));
}

const char* ToolCallFormatName(ToolCallFormat format) {
  switch (format) {
    case ToolCallFormat::kLlama3Json: return "llama3_json";
    case ToolCallFormat::kHermes: return "hermes";
  }
  return "";
}

ToolCallParser::ToolCallParser(ToolCallIdFn new_id)
    : new_id_(new_id ? std::move(new_id) : [] { return absl::StrCat("chatcmpl-tool-", RandomHex(16)); }) {}

void ToolCallParser::StartCall(std::string name, std::string arguments, OutputDelta* out) {
  out->calls.push_back({num_calls_++, new_id_(), std::move(name), std::move(arguments)});
}

std::unique_ptr<ToolCallParser> NewAutoToolCallParser(ToolCallFormat format, int max_calls, ToolCallIdFn new_id) {
  max_calls = std::max(1, max_calls);
  if (format == ToolCallFormat::kHermes) return std::make_unique<HermesParser>(max_calls, std::move(new_id));
  return std::make_unique<JsonSequenceParser>(
      JsonSequenceParser::Syntax{kPythonTag, 0, ';', 0, /*separator_optional=*/true}, max_calls, std::move(new_id));
}

std::unique_ptr<ToolCallParser> NewRequiredToolCallParser(ToolCallIdFn new_id) {
  return std::make_unique<JsonSequenceParser>(JsonSequenceParser::Syntax{"", '[', ',', ']', false},
                                              std::numeric_limits<int>::max(), std::move(new_id));
}

std::unique_ptr<ToolCallParser> NewNamedToolCallParser(std::string name, ToolCallIdFn new_id) {
  return std::make_unique<NamedParser>(std::move(name), std::move(new_id));
}

void Accumulate(const OutputDelta& delta, ParsedOutput* out) {
  out->content += delta.content;
  for (const OutputDelta::Call& call : delta.calls) {
    if (call.index >= static_cast<int>(out->calls.size())) {
      out->calls.resize(static_cast<size_t>(call.index) + 1);
      out->calls[static_cast<size_t>(call.index)].id = call.id.value_or("");
      out->calls[static_cast<size_t>(call.index)].name = call.name;
    }
    out->calls[static_cast<size_t>(call.index)].arguments += call.arguments;
  }
}

ParsedOutput ParseToolCalls(ToolCallParser& parser, std::string_view text) {
  OutputDelta delta;
  parser.Push(text, &delta);
  parser.Finish(&delta);
  ParsedOutput out;
  Accumulate(delta, &out);
  return out;
}

Json NamedToolCallSchema(const ToolSpec& tool) {
  if (tool.parameters.is_object() && !tool.parameters.empty()) return tool.parameters;
  return Json{{"type", "object"}, {"properties", Json::object()}, {"additionalProperties", false}};
}

absl::StatusOr<Json> RequiredToolCallSchema(const std::vector<ToolSpec>& tools, bool parallel) {
  Json alternatives = Json::array();
  Json defs = Json::object();
  for (const ToolSpec& tool : tools) {
    Json parameters = NamedToolCallSchema(tool);
    if (absl::Status s = HoistDefinitions(&parameters, &defs); !s.ok()) return s;
    Json properties;
    properties["name"] = Json{{"type", "string"}, {"enum", Json::array({tool.name})}};
    properties["parameters"] = std::move(parameters);
    alternatives.push_back(Json{{"type", "object"},
                                {"properties", std::move(properties)},
                                {"required", Json::array({"name", "parameters"})},
                                {"additionalProperties", false}});
  }
  Json schema{{"type", "array"}, {"minItems", 1}};
  if (!parallel) schema["maxItems"] = 1;
  schema["items"] = Json{{"anyOf", std::move(alternatives)}};
  for (auto& [key, value] : defs.items()) schema[key] = value;
  return schema;
}

}  // namespace duet::router::openai

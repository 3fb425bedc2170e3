#include "frontend/chat_template/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "frontend/chat_template/chat_template_eval.h"
#include "frontend/chat_template/chat_template_parser.h"

namespace duet {

struct ChatTemplate::Program {
  jinja::Body body;
};

absl::StatusOr<ChatTemplate> ChatTemplate::Parse(std::string source) {
  auto shared_source = std::make_shared<const std::string>(std::move(source));
  absl::StatusOr<jinja::Body> body = jinja::ParseTemplate(*shared_source);
  if (!body.ok()) return body.status();
  auto program = std::make_shared<Program>();
  program->body = *std::move(body);
  return ChatTemplate(std::move(shared_source), std::move(program));
}

absl::StatusOr<std::string> ChatTemplate::Render(const nlohmann::ordered_json& context) const {
  return jinja::Render(program_->body, *source_, context);
}

namespace {

// A special token in tokenizer_config.json: a string, or an AddedToken object with "content".
std::string TokenString(const nlohmann::ordered_json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return "";
}

}  // namespace

absl::StatusOr<std::string> ReadChatTemplateFlag(const std::string& value) {
  std::error_code ec;
  if (std::filesystem::is_regular_file(value, ec)) {
    std::ifstream file(value, std::ios::binary);
    std::stringstream contents;
    contents << file.rdbuf();
    if (!file) return absl::NotFoundError(absl::StrCat("--chat-template: cannot read ", value));
    return contents.str();
  }
  if (value.find_first_of("{}\n") == std::string::npos) {
    return absl::NotFoundError(absl::StrCat("--chat-template: '", value,
                                            "' looks like a file path, but there is no readable file there"));
  }
  constexpr std::string_view kEscaped = "ntr\\'\"", kMeaning = "\n\t\r\\'\"";
  std::string source;
  for (size_t i = 0; i < value.size(); ++i) {
    const char c = value[i];
    const char next = i + 1 < value.size() ? value[i + 1] : '\0';
    const size_t escape = c == '\\' ? kEscaped.find(next) : std::string_view::npos;
    if (escape == std::string_view::npos) {
      source.push_back(c);
    } else {
      source.push_back(kMeaning[escape]);
      ++i;
    }
  }
  return source;
}

absl::StatusOr<LoadedChatTemplate> LoadChatTemplate(const std::string& model_dir,
                                                    const std::string& chat_template_flag) {
  std::string path = model_dir + "/tokenizer_config.json";
  std::ifstream file(path);
  nlohmann::ordered_json config = nlohmann::ordered_json::object();
  if (file) {
    std::stringstream contents;
    contents << file.rdbuf();
    config = nlohmann::ordered_json::parse(contents.str(), nullptr, /*allow_exceptions=*/false);
    if (config.is_discarded() || !config.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
    }
  } else if (chat_template_flag.empty()) {
    return absl::NotFoundError(absl::StrCat("cannot open ", path));
  }
  std::string source;
  bool is_fallback = false;
  auto it = config.find("chat_template");
  if (!chat_template_flag.empty()) {
    absl::StatusOr<std::string> flag_source = ReadChatTemplateFlag(chat_template_flag);
    if (!flag_source.ok()) return flag_source.status();
    source = *std::move(flag_source);
    path = "--chat-template";
  } else if (it == config.end() || it->is_null()) {
    source = kFallbackChatTemplate;
    is_fallback = true;
  } else if (it->is_string()) {
    source = it->get<std::string>();
  } else if (it->is_array()) {
    for (const auto& entry : *it) {
      if (entry.is_object() && entry.value("name", "") == "default" && entry.contains("template") &&
          entry["template"].is_string()) {
        source = entry["template"].get<std::string>();
      }
    }
    if (source.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no \"default\" chat_template"));
  } else {
    return absl::InvalidArgumentError(absl::StrCat(path, ": chat_template must be a string or a list"));
  }
  absl::StatusOr<ChatTemplate> parsed = ChatTemplate::Parse(std::move(source));
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", parsed.status().message()));
  }
  return LoadedChatTemplate{*std::move(parsed), is_fallback, TokenString(config, "bos_token"),
                            TokenString(config, "eos_token")};
}

}  // namespace duet

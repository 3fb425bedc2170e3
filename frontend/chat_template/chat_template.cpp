#include "frontend/chat_template/chat_template.h"

#include <fstream>
#include <sstream>
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

absl::StatusOr<LoadedChatTemplate> LoadChatTemplate(const std::string& model_dir) {
  std::string path = model_dir + "/tokenizer_config.json";
  std::ifstream file(path);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream contents;
  contents << file.rdbuf();
  nlohmann::ordered_json config = nlohmann::ordered_json::parse(contents.str(), nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  }
  std::string source;
  bool is_fallback = false;
  auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) {
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

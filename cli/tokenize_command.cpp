// `duet tokenize`: {"text"[, "add_special_tokens"]} → {"ids"} per line, the same ids as Hugging
// Face `tokenizers` (special tokens are not added unless asked).

#include "cli/commands.h"
#include "cli/jsonl.h"
#include "common/logging.h"

namespace duet {

int RunTokenize(const TokenizeOptions& options) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromModelDir(options.model_dir);
  if (!tokenizer.ok()) {
    DUET_LOG(ERROR) << tokenizer.status().message();
    return 1;
  }
  absl::StatusOr<std::vector<nlohmann::json>> rows = ReadJsonl(options.input_path);
  if (!rows.ok()) {
    DUET_LOG(ERROR) << rows.status().message();
    return 2;
  }
  std::vector<nlohmann::json> out;
  for (size_t i = 0; i < rows->size(); ++i) {
    const nlohmann::json& row = (*rows)[i];
    auto text = row.find("text");
    auto special = row.find("add_special_tokens");
    if (text == row.end() || !text->is_string() || (special != row.end() && !special->is_boolean())) {
      DUET_LOG(ERROR) << options.input_path << ": line " << i + 1
                      << ": need a string 'text' (and optional boolean 'add_special_tokens')";
      return 2;
    }
    const bool add_special = special != row.end() && special->get<bool>();
    out.push_back({{"ids", (*tokenizer)->Encode(text->get<std::string>(), add_special)}});
  }
  if (absl::Status s = WriteJsonl(options.output_path, out); !s.ok()) {
    DUET_LOG(ERROR) << s.message();
    return 1;
  }
  return 0;
}

}  // namespace duet

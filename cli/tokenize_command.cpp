// `duet tokenize`: {"text"[, "add_special_tokens"]} → {"ids"} per line, the same ids as Hugging
// Face `tokenizers` (special tokens are not added unless asked).
#include <cstdio>

#include "cli/commands.h"
#include "cli/jsonl.h"

namespace duet {

int RunTokenize(const TokenizeOptions& options) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromModelDir(options.model_dir);
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "duet tokenize: %s\n", std::string(tokenizer.status().message()).c_str());
    return 1;
  }
  absl::StatusOr<std::vector<nlohmann::json>> rows = ReadJsonl(options.input_path);
  if (!rows.ok()) {
    std::fprintf(stderr, "duet tokenize: %s\n", std::string(rows.status().message()).c_str());
    return 2;
  }
  std::vector<nlohmann::json> out;
  for (size_t i = 0; i < rows->size(); ++i) {
    const nlohmann::json& row = (*rows)[i];
    auto text = row.find("text");
    auto special = row.find("add_special_tokens");
    if (text == row.end() || !text->is_string() || (special != row.end() && !special->is_boolean())) {
      std::fprintf(stderr, "duet tokenize: %s: line %zu: need a string 'text' (and optional boolean 'add_special_tokens')\n",
                   options.input_path.c_str(), i + 1);
      return 2;
    }
    const bool add_special = special != row.end() && special->get<bool>();
    out.push_back({{"ids", (*tokenizer)->Encode(text->get<std::string>(), add_special)}});
  }
  if (absl::Status s = WriteJsonl(options.output_path, out); !s.ok()) {
    std::fprintf(stderr, "duet tokenize: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}

}  // namespace duet

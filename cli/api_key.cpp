#include "cli/api_key.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace duet {

absl::StatusOr<std::string> LoadApiKey(const std::string& flag_value, const std::string& file) {
  if (!flag_value.empty() && !file.empty()) {
    return absl::InvalidArgumentError("give --api-key or --api-key-file, not both");
  }
  if (!flag_value.empty()) return flag_value;
  if (file.empty()) {
    const char* env = std::getenv(kApiKeyEnv);
    return std::string(env != nullptr ? absl::StripAsciiWhitespace(env) : "");
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read the API key file ", file));
  std::stringstream text;
  text << in.rdbuf();
  std::string key(absl::StripAsciiWhitespace(text.str()));
  if (key.empty()) return absl::InvalidArgumentError(absl::StrCat("the API key file ", file, " is empty"));
  return key;
}

}  // namespace duet

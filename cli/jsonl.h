// Reading and writing JSON Lines files for the offline commands.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace duet {

// Parses every non-blank line as a JSON object. Errors name the file and line.
absl::StatusOr<std::vector<nlohmann::json>> ReadJsonl(const std::string& path);
absl::Status WriteJsonl(const std::string& path, const std::vector<nlohmann::json>& rows);

}  // namespace duet

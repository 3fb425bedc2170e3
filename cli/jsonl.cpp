#include "cli/jsonl.h"

#include <fstream>

#include "absl/strings/str_cat.h"

namespace duet {

absl::StatusOr<std::vector<nlohmann::json>> ReadJsonl(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::vector<nlohmann::json> rows;
  std::string line;
  for (int line_no = 1; std::getline(in, line); ++line_no) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json row = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (row.is_discarded()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", line_no, ": not valid JSON"));
    }
    if (!row.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", line_no, ": expected a JSON object"));
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

absl::Status WriteJsonl(const std::string& path, const std::vector<nlohmann::json>& rows) {
  std::ofstream out(path);
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  for (const nlohmann::json& row : rows) {
    out << row.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
  }
  out.flush();
  if (!out) return absl::DataLossError(absl::StrCat("error writing ", path));
  return absl::OkStatus();
}

}  // namespace duet

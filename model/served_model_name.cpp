#include "model/served_model_name.h"

#include <filesystem>

namespace duet {

std::string ServedModelName(const std::string& served_model_name, const std::string& model_dir) {
  if (!served_model_name.empty()) return served_model_name;
  std::filesystem::path path(model_dir);
  if (!path.has_filename()) path = path.parent_path();
  return path.filename().string();
}

}  // namespace duet

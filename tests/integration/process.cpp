#include "tests/integration/process.h"

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

namespace duet::testing {

std::string MakeTempDir(const std::string& prefix) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::filesystem::path root = base ? base : std::filesystem::temp_directory_path();
  std::random_device rd;
  std::filesystem::path dir = root / (prefix + "-" + std::to_string(rd()) + std::to_string(rd()));
  std::filesystem::create_directories(dir);
  return dir.string();
}

int RunCommand(const std::string& command, const std::string& log_path) {
  const std::string full = command + " 2>" + log_path;
  const int status = std::system(full.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteJsonlFile(const std::string& path, const std::vector<nlohmann::json>& rows) {
  std::ofstream out(path);
  for (const auto& r : rows) out << r.dump() << "\n";
}

std::vector<nlohmann::json> ReadJsonlFile(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> rows;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) rows.push_back(nlohmann::json::parse(line));
  }
  return rows;
}

namespace {
std::string EnvOr(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : fallback;
}
}  // namespace

std::string DuetBinary() { return EnvOr("DUET_BIN_DIR", DUET_BIN_DIR) + "/duet"; }
std::string ModelsDir() { return EnvOr("DUET_MODELS_DIR", DUET_MODELS_DIR); }

}  // namespace duet::testing

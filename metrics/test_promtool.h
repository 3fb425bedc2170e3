// Test helper: `promtool check metrics` (/usr/bin/promtool) on an exposition, and the one
// expectation the tests of Duet's metrics share about its verdict.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace duet::metrics::testing {

inline constexpr const char* kPromtoolBinary = "/usr/bin/promtool";

inline bool PromtoolInstalled() { return ::access(kPromtoolBinary, X_OK) == 0; }

struct PromtoolResult {
  int exit_code = -1;  // 0 clean, 1 parse error, 3 lint problems; -1 when promtool did not run
  std::string output;  // stdout and stderr together
};

// Writes `text` to `path` and runs promtool check metrics on it.
inline PromtoolResult PromtoolCheckMetrics(const std::string& text, const std::filesystem::path& path) {
  std::ofstream(path) << text;
  PromtoolResult result;
  const std::string command = std::string(kPromtoolBinary) + " check metrics < '" + path.string() + "' 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0;) result.output.append(buffer, n);
  const int status = ::pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

// promtool parses the exposition (exit 1 on a parse error) and lints it (exit 3). Its lint
// rejects ':' in every metric name ("metric names should not contain ':'"), a rule vLLM's own
// vllm:* names break too, and vLLM's histogram iteration_tokens_total draws a lint for its
// counter's suffix. So: the text as served must draw those complaints and no other, and the same
// text with "duet:" spelled "duet_" must pass clean but for the iteration_tokens_total lint where
// that family is present, which proves every other rule (HELP, _total suffixes, units, histogram
// shape) holds. `what` names the text in messages and in its files under `dir`.
inline void ExpectPromtoolAccepts(const std::string& what, const std::string& text, const std::filesystem::path& dir) {
  ASSERT_FALSE(text.empty()) << what << ": empty exposition";
  const std::string iteration_tokens_lint =
      "duet:iteration_tokens_total non-counter metrics should not have \"_total\" suffix";
  const std::string colon_lint = "metric names should not contain ':'";
  const PromtoolResult served = PromtoolCheckMetrics(text, dir / (what + ".prom"));
  std::printf("promtool check metrics (%s, %zu bytes): exit %d\n", what.c_str(), text.size(), served.exit_code);
  EXPECT_EQ(served.exit_code, 3) << what << ": " << served.output;
  std::istringstream lines(served.output);
  int complaints = 0;
  for (std::string line; std::getline(lines, line);) {
    ++complaints;
    if (line == iteration_tokens_lint) continue;
    EXPECT_TRUE(line.size() >= colon_lint.size() &&
                line.compare(line.size() - colon_lint.size(), colon_lint.size(), colon_lint) == 0)
        << what << ": " << line;
  }
  EXPECT_GT(complaints, 0) << what;  // promtool really read the families: one complaint each

  std::string underscored = text;
  for (size_t pos = 0; (pos = underscored.find("duet:", pos)) != std::string::npos;) underscored.replace(pos, 5, "duet_");
  const PromtoolResult clean = PromtoolCheckMetrics(underscored, dir / (what + "_underscored.prom"));
  std::printf("promtool check metrics (%s, duet_ names): exit %d '%s'\n", what.c_str(), clean.exit_code,
              clean.output.c_str());
  const bool has_iteration_tokens = text.find("duet:iteration_tokens_total") != std::string::npos;
  EXPECT_EQ(clean.exit_code, has_iteration_tokens ? 3 : 0) << what << ": " << clean.output;
  EXPECT_EQ(clean.output,
            has_iteration_tokens ? "duet_iteration_tokens_total non-counter metrics should not have \"_total\" suffix\n" : "")
      << what;
}

}  // namespace duet::metrics::testing

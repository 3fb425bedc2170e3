#include "cli/generate_progress.h"

#include <cstdio>
#include <string>

#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace duet {
namespace {

TEST(FormatGenerateProgress, TqdmsFiguresAndClock) {
  EXPECT_EQ(FormatGenerateProgress({.done = 25, .total = 100, .prompt_tokens = 1000, .output_tokens = 4000,
                                    .elapsed_s = 10}),
            "Processed prompts:  25%|######                   | 25/100 [00:10<00:30, 2.50 it/s, est. speed input: "
            "100.00 toks/s, output: 400.00 toks/s]");
  // Nothing done yet: no estimate; an hour and more: H:MM:SS.
  EXPECT_EQ(FormatGenerateProgress({.done = 0, .total = 8}),
            "Processed prompts:   0%|                         | 0/8 [00:00<?, 0.00 it/s, est. speed input: 0.00 "
            "toks/s, output: 0.00 toks/s]");
  const std::string late = FormatGenerateProgress({.done = 1, .total = 2, .elapsed_s = 3725});
  EXPECT_NE(late.find("[1:02:05<1:02:05, "), std::string::npos) << late;
  EXPECT_NE(FormatGenerateProgress({.done = 2, .total = 2}).find("100%|#########################| 2/2"),
            std::string::npos);
}

// What a GenerateProgress writes to a file (not a terminal) in `mode`.
std::string Written(ProgressMode mode) {
  FILE* file = std::tmpfile();
  {
    GenerateProgress progress(3, mode, file);
    progress.Update(1, 10, 5);
    progress.Update(3, 30, 20);
  }
  std::rewind(file);
  std::string text;
  for (int c; (c = std::fgetc(file)) != EOF;) text.push_back(char(c));
  std::fclose(file);
  return text;
}

TEST(GenerateProgress, ALinePerDrawOffATerminalOnlyWhenAsked) {
  EXPECT_EQ(Written(ProgressMode::kAuto), "");  // a file is no terminal
  EXPECT_EQ(Written(ProgressMode::kOff), "");
  const std::string text = Written(ProgressMode::kOn);
  ASSERT_FALSE(text.empty());
  EXPECT_EQ(text.back(), '\n');
  EXPECT_EQ(text.find('\r'), std::string::npos) << text;
  std::vector<std::string> lines = absl::StrSplit(text.substr(0, text.size() - 1), '\n');
  EXPECT_TRUE(lines.front().starts_with("Processed prompts:   0%|")) << text;  // drawn at the start
  for (const std::string& line : lines) EXPECT_TRUE(line.starts_with("Processed prompts: ")) << line;
  EXPECT_TRUE(lines.back().starts_with("Processed prompts: 100%|#########################| 3/3 [")) << text;
}

}  // namespace
}  // namespace duet

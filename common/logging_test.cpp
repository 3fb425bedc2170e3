#include "common/logging.h"

#include <algorithm>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace duet {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;

class LoggingTest : public ::testing::Test {
 protected:
  void SetUp() override { saved_ = MinLogLevel(); }
  void TearDown() override { SetMinLogLevel(saved_); }
  LogLevel saved_ = LogLevel::kInfo;
};

TEST_F(LoggingTest, OneLineInTheCommonFormat) {
  SetMinLogLevel(LogLevel::kInfo);
  testing::internal::CaptureStderr();
  DUET_LOG_REQUEST(WARNING, "cmpl-42") << "lease expired after " << 30 << " s";
  const std::string out = testing::internal::GetCapturedStderr();
  EXPECT_THAT(out.substr(0, out.size() - 1), MatchesRegex(R"([0-9]{4}-[0-9]{2}-[0-9]{2} [0-9:]{8}\.[0-9]{6} W [0-9]+ logging_test\.cpp:[0-9]+\] )"
                                R"(\[cmpl-42\] lease expired after 30 s)"));
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1);
  EXPECT_EQ(out.back(), '\n');
}

TEST_F(LoggingTest, BelowTheThresholdIsNotEvaluated) {
  SetMinLogLevel(LogLevel::kWarning);
  int evaluated = 0;
  auto side_effect = [&] { return ++evaluated; };
  testing::internal::CaptureStderr();
  DUET_LOG(INFO) << side_effect();
  DUET_LOG(ERROR) << "shown " << side_effect();
  const std::string out = testing::internal::GetCapturedStderr();
  EXPECT_EQ(evaluated, 1);
  EXPECT_THAT(out, HasSubstr(" E "));
  EXPECT_THAT(out, HasSubstr("shown 1\n"));
  EXPECT_EQ(out.find("shown"), out.rfind("shown"));
}

TEST_F(LoggingTest, ParsesLevelNames) {
  EXPECT_EQ(*ParseLogLevel("debug"), LogLevel::kDebug);
  EXPECT_EQ(*ParseLogLevel("INFO"), LogLevel::kInfo);
  EXPECT_EQ(*ParseLogLevel("warn"), LogLevel::kWarning);
  EXPECT_EQ(*ParseLogLevel("error"), LogLevel::kError);
  EXPECT_FALSE(ParseLogLevel("verbose").ok());
}

TEST(LoggingDeathTest, FatalAborts) {
  EXPECT_DEATH({ DUET_LOG(FATAL) << "invariant broken"; }, "F .*invariant broken");
}

}  // namespace
}  // namespace duet

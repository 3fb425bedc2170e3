#include "common/finish_reason.h"

#include "gtest/gtest.h"

namespace duet {
namespace {

TEST(FinishReasonTest, ParsesEveryNameItWrites) {
  for (FinishReason reason : {FinishReason::kNone, FinishReason::kStop, FinishReason::kLength,
                              FinishReason::kAbort, FinishReason::kError}) {
    EXPECT_EQ(ParseFinishReason(FinishReasonName(reason)), reason) << FinishReasonName(reason);
  }
  EXPECT_STREQ(FinishReasonName(FinishReason::kLength), "length");
}

TEST(FinishReasonTest, OtherNamesAreNotReasons) {
  EXPECT_EQ(ParseFinishReason("exploded"), std::nullopt);
  EXPECT_EQ(ParseFinishReason(""), std::nullopt);
  EXPECT_EQ(ParseFinishReason("Stop"), std::nullopt);
}

}  // namespace
}  // namespace duet

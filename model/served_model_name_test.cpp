#include "model/served_model_name.h"

#include "gtest/gtest.h"

namespace duet {
namespace {

TEST(ServedModelNameTest, TheGivenNameElseTheDirectorysBaseName) {
  EXPECT_EQ(ServedModelName("llama-3-8b", "models/tiny"), "llama-3-8b");
  EXPECT_EQ(ServedModelName("", "models/tiny"), "tiny");
  EXPECT_EQ(ServedModelName("", "models/tiny/"), "tiny");
  EXPECT_EQ(ServedModelName("", "/abs/path/qwen2"), "qwen2");
}

}  // namespace
}  // namespace duet

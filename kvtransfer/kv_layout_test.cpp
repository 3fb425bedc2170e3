#include "kvtransfer/kv_layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace duet::kvtransfer {
namespace {

using ::testing::HasSubstr;

KvLayout Llama8B() { return {32, 16, 8, 128, KvDtype::kBFloat16}; }

TEST(KvLayoutTest, SizesFollowTheEngineLayout) {
  const KvLayout layout = Llama8B();
  EXPECT_EQ(layout.ElementSize(), 2u);
  EXPECT_EQ(layout.TokenHeadBytes(), 256u);
  EXPECT_EQ(layout.BlockBytes(), 8u * 16 * 128 * 2);
  EXPECT_EQ(DtypeSize(KvDtype::kFloat32), 4u);
  EXPECT_EQ(DtypeSize(KvDtype::kFloat16), 2u);
}

TEST(KvLayoutTest, SerializeRoundTrips) {
  for (KvLayout layout : {Llama8B(), KvLayout{1, 1, 1, 1, KvDtype::kFloat32},
                          KvLayout{6, 32, 4, 64, KvDtype::kFloat16}}) {
    absl::StatusOr<KvLayout> parsed = KvLayout::Deserialize(layout.Serialize());
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, layout);
  }
}

TEST(KvLayoutTest, DeserializeRejectsCorruptBlobs) {
  std::string blob = Llama8B().Serialize();
  EXPECT_THAT(KvLayout::Deserialize(blob.substr(0, 10)).status().message(),
              HasSubstr("truncated"));
  std::string bad_version = blob;
  bad_version[0] = 9;
  EXPECT_THAT(KvLayout::Deserialize(bad_version).status().message(), HasSubstr("version 9"));
  std::string bad_dtype = blob;
  bad_dtype[1] = 42;
  EXPECT_THAT(KvLayout::Deserialize(bad_dtype).status().message(), HasSubstr("dtype code 42"));
  std::string bad_size = blob;
  bad_size[2] = 4;  // bf16 claiming 4-byte elements
  EXPECT_FALSE(KvLayout::Deserialize(bad_size).ok());
  EXPECT_FALSE(KvLayout::Deserialize(blob + "x").ok());
  EXPECT_FALSE(KvLayout::Deserialize(KvLayout{0, 16, 8, 128, KvDtype::kFloat32}.Serialize()).ok());
}

TEST(KvLayoutTest, CompatibilityAllowsOnlyBlockSizeToDiffer) {
  const KvLayout base = Llama8B();
  EXPECT_EQ(*CheckCompatible(base, base), LayoutMatch::kSameShape);
  KvLayout bigger_blocks = base;
  bigger_blocks.block_size = 32;
  EXPECT_EQ(*CheckCompatible(base, bigger_blocks), LayoutMatch::kReblock);

  KvLayout other = base;
  other.dtype = KvDtype::kFloat16;
  absl::Status status = CheckCompatible(base, other).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("dtype differs"));
  EXPECT_THAT(status.message(), HasSubstr("float16"));

  other = base;
  other.head_dim = 64;
  EXPECT_THAT(CheckCompatible(base, other).status().message(), HasSubstr("head_dim differs"));
  other = base;
  other.num_layers = 16;
  EXPECT_THAT(CheckCompatible(base, other).status().message(), HasSubstr("layer count"));
  other = base;
  other.num_kv_heads = 4;
  EXPECT_EQ(CheckCompatible(base, other).status().code(), absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace duet::kvtransfer

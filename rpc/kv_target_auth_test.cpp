#include "rpc/kv_target_auth.h"

#include "gtest/gtest.h"

namespace duet::rpc {
namespace {

v1::KvTarget Target() {
  v1::KvTarget t;
  t.set_receiver_descriptor(std::string("descriptor\0bytes", 16));
  t.set_transfer_id(42);
  for (uint32_t id : {3u, 4u, 9u}) t.add_block_ids(id);
  for (uint32_t id : {7u, 8u}) t.add_device_block_ids(id);
  return t;
}

TEST(KvTargetAuthTest, SignedTargetsVerifyAndAnyChangeIsRefused) {
  const std::string key = KvTargetKey("cluster-token");
  ASSERT_EQ(key.size(), 32u);
  v1::KvTarget signed_target = Target();
  SignKvTarget(key, &signed_target);
  EXPECT_EQ(signed_target.authenticator().size(), 32u);
  EXPECT_TRUE(VerifyKvTarget(key, signed_target).ok());

  std::vector<v1::KvTarget> tampered(8, signed_target);
  tampered[0].set_transfer_id(43);
  tampered[1].set_block_ids(2, 10);
  tampered[2].add_block_ids(10);
  tampered[3].set_device_block_ids(0, 1);
  tampered[4].mutable_receiver_descriptor()->back() ^= 1;
  tampered[5].clear_authenticator();
  // Ids moved from one list to the other.
  tampered[6].clear_block_ids();
  tampered[6].clear_device_block_ids();
  for (uint32_t id : {3u, 4u, 9u, 7u}) tampered[6].add_block_ids(id);
  tampered[6].add_device_block_ids(8);
  tampered[7].set_first_token(16);  // the blocks would land one block off
  for (size_t i = 0; i < tampered.size(); ++i) {
    EXPECT_EQ(VerifyKvTarget(key, tampered[i]).code(), absl::StatusCode::kPermissionDenied) << i;
  }
  EXPECT_EQ(VerifyKvTarget(KvTargetKey("another-token"), signed_target).code(), absl::StatusCode::kPermissionDenied);
}

TEST(KvTargetAuthTest, WithoutATokenNothingIsSignedOrChecked) {
  EXPECT_EQ(KvTargetKey(""), "");
  v1::KvTarget t = Target();
  SignKvTarget("", &t);
  EXPECT_TRUE(t.authenticator().empty());
  EXPECT_TRUE(VerifyKvTarget("", t).ok());
}

}  // namespace
}  // namespace duet::rpc

// Loopback tests of the UCX transport: byte equality across layouts, layout checks, leases,
// cancellation and peers that die (in child processes of this same binary, see main()).
#include "kvtransfer/ucx_transport.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <future>
#include <map>
#include <memory>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "kvtransfer/testing_child.h"
#include "kvtransfer/testing_pools.h"

namespace duet::kvtransfer {
namespace {

using ::testing::HasSubstr;

// Records a receiver's callbacks and lets the test wait for them.
class ReceiverProbe {
 public:
  ReceiverCallbacks callbacks() {
    ReceiverCallbacks callbacks;
    callbacks.on_layer_received = [this](uint64_t request_id, uint32_t layer) {
      absl::MutexLock lock(&mu_);
      ++layers_[request_id];
    };
    callbacks.on_request_done = [this](uint64_t request_id, const absl::Status& status, MemoryKind) {
      absl::MutexLock lock(&mu_);
      EXPECT_FALSE(done_.contains(request_id)) << "request " << request_id << " ended twice";
      done_[request_id] = status;
    };
    callbacks.on_blocks_released = [this](const ReleasedLease& lease) {
      absl::MutexLock lock(&mu_);
      released_.push_back(lease);
    };
    return callbacks;
  }

  // The request's final status, or DEADLINE_EXCEEDED("test wait") if it did not end in time.
  absl::Status WaitDone(uint64_t request_id, absl::Duration timeout = absl::Seconds(20)) {
    absl::MutexLock lock(&mu_);
    auto ended = [&] { return done_.contains(request_id); };
    if (!mu_.AwaitWithTimeout(absl::Condition(&ended), timeout)) {
      return absl::DeadlineExceededError("test wait: request did not end");
    }
    return done_.at(request_id);
  }
  int layers(uint64_t request_id) {
    absl::MutexLock lock(&mu_);
    return layers_[request_id];
  }
  std::vector<ReleasedLease> released() {
    absl::MutexLock lock(&mu_);
    return released_;
  }

 private:
  absl::Mutex mu_;
  std::map<uint64_t, int> layers_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, absl::Status> done_ ABSL_GUARDED_BY(mu_);
  std::vector<ReleasedLease> released_ ABSL_GUARDED_BY(mu_);
};

uint32_t BlocksFor(uint32_t tokens, uint32_t block_size) {
  return (tokens + block_size - 1) / block_size;
}

// `count` distinct ids below `num_blocks`, deliberately out of order with one contiguous run.
std::vector<uint32_t> ScatteredIds(uint32_t count, uint32_t num_blocks, uint32_t salt) {
  std::vector<uint32_t> ids;
  std::vector<bool> used(num_blocks, false);
  for (uint32_t i = 0; ids.size() < count; ++i) {
    const uint32_t id = i < 3 ? (salt + i) % num_blocks : (salt + 7 * i * i + 3) % num_blocks;
    if (!used[id]) {
      used[id] = true;
      ids.push_back(id);
    }
  }
  return ids;
}

void ExpectSameTokens(HostKvPools& src, const std::vector<uint32_t>& src_ids, HostKvPools& dst,
                      const std::vector<uint32_t>& dst_ids, uint32_t num_layers,
                      uint32_t num_tokens) {
  for (uint32_t layer = 0; layer < num_layers; ++layer) {
    const std::string src_k = src.Gather(src.key(layer), src_ids, num_tokens);
    const std::string dst_k = dst.Gather(dst.key(layer), dst_ids, num_tokens);
    ASSERT_EQ(src_k.size(), dst_k.size());
    ASSERT_EQ(std::memcmp(src_k.data(), dst_k.data(), src_k.size()), 0) << "K layer " << layer;
    const std::string src_v = src.Gather(src.value(layer), src_ids, num_tokens);
    const std::string dst_v = dst.Gather(dst.value(layer), dst_ids, num_tokens);
    ASSERT_EQ(std::memcmp(src_v.data(), dst_v.data(), src_v.size()), 0) << "V layer " << layer;
  }
}

struct TransferShape {
  uint32_t src_block_size;
  uint32_t dst_block_size;
  uint32_t num_layers;
  uint32_t num_kv_heads;
  uint32_t head_dim;
  KvDtype dtype;
  uint32_t num_tokens;
  // kNetwork: tcp with peer failure detection; kSharedMemory / kAuto (both sides on this host):
  // UCX may use shared memory (see HostTransport).
  HostTransport host_transport = HostTransport::kNetwork;
};

class UcxLoopbackTest : public ::testing::TestWithParam<TransferShape> {};

TEST_P(UcxLoopbackTest, ReceiverBytesEqualSenderBytesLayerByLayer) {
  const TransferShape s = GetParam();
  const KvLayout src_layout{s.num_layers, s.src_block_size, s.num_kv_heads, s.head_dim, s.dtype};
  KvLayout dst_layout = src_layout;
  dst_layout.block_size = s.dst_block_size;
  const uint32_t src_blocks = BlocksFor(s.num_tokens, s.src_block_size);
  const uint32_t dst_blocks = BlocksFor(s.num_tokens, s.dst_block_size);
  HostKvPools src(src_layout, 2 * src_blocks + 3, /*seed=*/11);
  HostKvPools dst(dst_layout, 2 * dst_blocks + 3, /*seed=*/0);
  const std::vector<uint32_t> src_ids = ScatteredIds(src_blocks, 2 * src_blocks + 3, 1);
  const std::vector<uint32_t> dst_ids = ScatteredIds(dst_blocks, 2 * dst_blocks + 3, 2);

  ReceiverProbe probe;
  auto receiver = CreateUcxKvReceiver(dst.memory(), probe.callbacks());
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  auto sender = CreateUcxKvSender(src.memory(), {.host_transport = s.host_transport});
  ASSERT_TRUE(sender.ok()) << sender.status();
  absl::StatusOr<PeerId> peer = (*sender)->Connect((*receiver)->descriptor());
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_EQ((*sender)->path(*peer), s.host_transport == HostTransport::kNetwork ? TransferPath::kUcxNetwork
                                                                                : TransferPath::kUcxSharedMemory);

  constexpr uint64_t kRequest = 42;
  ASSERT_TRUE((*receiver)
                  ->Expect({.request_id = kRequest, .num_tokens = s.num_tokens,
                            .dst_block_ids = dst_ids, .verify_checksums = true})
                  .ok());
  std::vector<std::future<absl::Status>> sends;
  for (uint32_t layer = 0; layer < s.num_layers; ++layer) {
    sends.push_back((*sender)->SendLayer(*peer, {.request_id = kRequest, .layer = layer,
                                                 .num_tokens = s.num_tokens,
                                                 .src_block_ids = src_ids,
                                                 .dst_block_ids = dst_ids,
                                                 .with_checksums = true}));
  }
  EXPECT_TRUE((*sender)->Finish(*peer, kRequest).get().ok());
  for (auto& send : sends) EXPECT_TRUE(send.get().ok());
  EXPECT_TRUE(probe.WaitDone(kRequest).ok());
  EXPECT_EQ(probe.layers(kRequest), static_cast<int>(s.num_layers));
  EXPECT_TRUE(probe.released().empty());
  EXPECT_EQ((*receiver)->active_leases(), 0u);
  EXPECT_EQ((*sender)->pending_operations(), 0u);
  ExpectSameTokens(src, src_ids, dst, dst_ids, s.num_layers, s.num_tokens);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, UcxLoopbackTest,
    ::testing::Values(TransferShape{1, 1, 1, 1, 8, KvDtype::kFloat32, 5},
                      TransferShape{16, 16, 6, 4, 64, KvDtype::kBFloat16, 100},
                      TransferShape{32, 32, 32, 4, 128, KvDtype::kBFloat16, 200},
                      TransferShape{16, 16, 32, 2, 16, KvDtype::kFloat32, 1000},
                      TransferShape{16, 16, 1, 8, 128, KvDtype::kFloat16, 17},
                      // Different block sizes on the two sides: re-blocked per (head, run).
                      TransferShape{16, 32, 6, 4, 64, KvDtype::kBFloat16, 100},
                      TransferShape{32, 16, 6, 4, 64, KvDtype::kBFloat16, 100},
                      TransferShape{1, 16, 2, 2, 32, KvDtype::kFloat32, 40},
                      // Shared-memory transports, asked for or chosen (both sides on this host).
                      TransferShape{16, 16, 6, 4, 64, KvDtype::kBFloat16, 100, HostTransport::kSharedMemory},
                      TransferShape{16, 32, 32, 8, 128, KvDtype::kBFloat16, 300, HostTransport::kSharedMemory},
                      TransferShape{16, 16, 32, 8, 128, KvDtype::kBFloat16, 512, HostTransport::kAuto},
                      TransferShape{32, 16, 4, 2, 64, KvDtype::kFloat32, 77, HostTransport::kAuto}));

// A small same-shape setup for the protocol tests.
class UcxProtocolTest : public ::testing::Test {
 protected:
  static constexpr KvLayout kLayout{4, 16, 2, 32, KvDtype::kFloat32};
  static constexpr uint32_t kBlocks = 32;

  void SetUp() override {
    auto receiver = CreateUcxKvReceiver(dst_.memory(), probe_.callbacks());
    ASSERT_TRUE(receiver.ok()) << receiver.status();
    receiver_ = std::move(*receiver);
    auto sender = CreateUcxKvSender(src_.memory(), {.operation_timeout = absl::Seconds(3)});
    ASSERT_TRUE(sender.ok()) << sender.status();
    sender_ = std::move(*sender);
    absl::StatusOr<PeerId> peer = sender_->Connect(receiver_->descriptor());
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
  }

  LayerSend Layer(uint64_t request_id, uint32_t layer, bool checksums = true) {
    return {.request_id = request_id, .layer = layer, .num_tokens = 40,
            .src_block_ids = {1, 2, 3}, .dst_block_ids = {7, 5, 6},
            .with_checksums = checksums};
  }
  ExpectedRequest Expected(uint64_t request_id, absl::Duration ttl = absl::Seconds(30)) {
    return {.request_id = request_id, .num_tokens = 40, .dst_block_ids = {7, 5, 6},
            .lease_ttl = ttl, .verify_checksums = true};
  }

  HostKvPools src_{kLayout, kBlocks, 3};
  HostKvPools dst_{kLayout, kBlocks, 0};
  ReceiverProbe probe_;
  std::unique_ptr<KvReceiver> receiver_;
  std::unique_ptr<KvSender> sender_;
  PeerId peer_ = 0;
};

TEST_F(UcxProtocolTest, ConcurrentRequestsInterleaveLayers) {
  constexpr int kRequests = 6;
  HostKvPools dst(kLayout, 3 * kRequests, 0);
  ReceiverProbe probe;
  auto receiver = CreateUcxKvReceiver(dst.memory(), probe.callbacks());
  ASSERT_TRUE(receiver.ok());
  absl::StatusOr<PeerId> peer = sender_->Connect((*receiver)->descriptor());
  ASSERT_TRUE(peer.ok());
  std::vector<std::future<absl::Status>> futures;
  for (uint64_t r = 0; r < kRequests; ++r) {
    std::vector<uint32_t> ids = {uint32_t(3 * r + 2), uint32_t(3 * r), uint32_t(3 * r + 1)};
    ASSERT_TRUE((*receiver)->Expect({.request_id = r, .num_tokens = 40, .dst_block_ids = ids,
                                     .verify_checksums = true}).ok());
  }
  for (uint32_t layer = 0; layer < kLayout.num_layers; ++layer) {
    for (uint64_t r = 0; r < kRequests; ++r) {
      futures.push_back(sender_->SendLayer(
          *peer, {.request_id = r, .layer = layer, .num_tokens = 40,
                  .src_block_ids = {uint32_t(r), uint32_t(r + 10), uint32_t(r + 20)},
                  .dst_block_ids = {uint32_t(3 * r + 2), uint32_t(3 * r), uint32_t(3 * r + 1)},
                  .with_checksums = true}));
    }
  }
  for (uint64_t r = 0; r < kRequests; ++r) futures.push_back(sender_->Finish(*peer, r));
  for (auto& future : futures) EXPECT_TRUE(future.get().ok());
  for (uint64_t r = 0; r < kRequests; ++r) {
    EXPECT_TRUE(probe.WaitDone(r).ok());
    ExpectSameTokens(src_, {uint32_t(r), uint32_t(r + 10), uint32_t(r + 20)}, dst,
                     {uint32_t(3 * r + 2), uint32_t(3 * r), uint32_t(3 * r + 1)},
                     kLayout.num_layers, 40);
  }
}

TEST_F(UcxProtocolTest, IncompatibleLayoutIsRefusedAtConnect) {
  KvLayout other = kLayout;
  other.head_dim = 64;
  HostKvPools dst(other, kBlocks, 0);
  ReceiverProbe probe;
  auto receiver = CreateUcxKvReceiver(dst.memory(), probe.callbacks());
  ASSERT_TRUE(receiver.ok());
  absl::StatusOr<PeerId> peer = sender_->Connect((*receiver)->descriptor());
  EXPECT_EQ(peer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(peer.status().message(), HasSubstr("head_dim differs"));
  EXPECT_EQ(sender_->Connect("not a descriptor").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(UcxProtocolTest, PathFollowsTheHostIdentities) {
  auto receiver_on = [&](const char* host) {
    return CreateUcxKvReceiver(dst_.memory(), probe_.callbacks(), {.host_id = host});
  };
  auto here = receiver_on("host-a");
  auto there = receiver_on("host-b");
  ASSERT_TRUE(here.ok() && there.ok());
  for (HostTransport transport : {HostTransport::kAuto, HostTransport::kNetwork, HostTransport::kSharedMemory}) {
    auto sender = CreateUcxKvSender(src_.memory(), {.host_transport = transport, .host_id = "host-a"});
    ASSERT_TRUE(sender.ok());
    absl::StatusOr<PeerId> near = (*sender)->Connect((*here)->descriptor());
    absl::StatusOr<PeerId> far = (*sender)->Connect((*there)->descriptor());
    ASSERT_TRUE(near.ok() && far.ok());
    const TransferPath forced =
        transport == HostTransport::kNetwork ? TransferPath::kUcxNetwork : TransferPath::kUcxSharedMemory;
    EXPECT_EQ((*sender)->path(*near), transport == HostTransport::kAuto ? TransferPath::kUcxSharedMemory : forced);
    EXPECT_EQ((*sender)->path(*far), transport == HostTransport::kAuto ? TransferPath::kUcxNetwork : forced);
  }
  EXPECT_EQ(TransferPathName(TransferPath::kCudaIpc), "cuda_ipc");
  EXPECT_EQ(TransferPathName(TransferPath::kUcxSharedMemory), "ucx_shm");
  EXPECT_EQ(TransferPathName(TransferPath::kUcxNetwork), "ucx_net");
}

TEST_F(UcxProtocolTest, DeviceDestinationsNeedDevicePools) {
  ExpectedRequest request = Expected(3);
  request.device_block_ids = {1, 2, 4};
  absl::Status status = receiver_->Expect(request);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr("no device pools"));
  EXPECT_EQ(receiver_->active_leases(), 0u);
}

TEST_F(UcxProtocolTest, ReceiverCancelReleasesBlocksOnce) {
  ASSERT_TRUE(receiver_->Expect(Expected(1)).ok());
  EXPECT_EQ(receiver_->Expect(Expected(1)).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(receiver_->Cancel(1, KvReceiver::CancelRelease::kNow));
  EXPECT_FALSE(receiver_->Cancel(1, KvReceiver::CancelRelease::kNow));
  EXPECT_FALSE(receiver_->Cancel(1, KvReceiver::CancelRelease::kAfterSender));
  EXPECT_EQ(probe_.WaitDone(1).code(), absl::StatusCode::kCancelled);
  ASSERT_EQ(probe_.released().size(), 1u);
  EXPECT_EQ(probe_.released()[0].reason, LeaseEnd::kCancelled);
  EXPECT_THAT(probe_.released()[0].block_ids, ::testing::ElementsAre(7, 5, 6));
  EXPECT_EQ(receiver_->active_leases(), 0u);
}

// A request cancelled while its sender may still be writing keeps its blocks until the sender's
// finish notice (sent after its last put landed): released then, never completed; a later
// kNow (the sender is gone) ends one at once.
TEST_F(UcxProtocolTest, CancelAfterSenderKeepsTheBlocksUntilTheSenderHasStopped) {
  ASSERT_TRUE(receiver_->Expect(Expected(11)).ok());
  EXPECT_TRUE(sender_->SendLayer(peer_, Layer(11, 0)).get().ok());
  EXPECT_TRUE(receiver_->Cancel(11, KvReceiver::CancelRelease::kAfterSender));
  for (uint32_t layer = 1; layer < kLayout.num_layers; ++layer) {
    EXPECT_TRUE(sender_->SendLayer(peer_, Layer(11, layer)).get().ok());  // puts land in held blocks
  }
  EXPECT_EQ(probe_.WaitDone(11, absl::Milliseconds(200)).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(probe_.released().empty());
  EXPECT_EQ(receiver_->active_leases(), 1u);
  EXPECT_TRUE(sender_->Finish(peer_, 11).get().ok());
  absl::Status done = probe_.WaitDone(11);
  EXPECT_EQ(done.code(), absl::StatusCode::kCancelled) << done;  // not completed
  ASSERT_EQ(probe_.released().size(), 1u);
  EXPECT_EQ(probe_.released()[0].reason, LeaseEnd::kCancelled);
  EXPECT_EQ(receiver_->active_leases(), 0u);

  ASSERT_TRUE(receiver_->Expect(Expected(12)).ok());
  EXPECT_TRUE(receiver_->Cancel(12, KvReceiver::CancelRelease::kAfterSender));
  EXPECT_EQ(receiver_->active_leases(), 1u);
  EXPECT_TRUE(receiver_->Cancel(12, KvReceiver::CancelRelease::kNow));
  EXPECT_EQ(probe_.WaitDone(12).code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(receiver_->active_leases(), 0u);
}

// The sender's abort notice, which frees the blocks, goes out only after the request's layers in
// flight have landed: it never overtakes their puts.
TEST_F(UcxProtocolTest, SenderAbortWaitsForTheLayersInFlight) {
  ASSERT_TRUE(receiver_->Expect(Expected(15)).ok());
  std::vector<std::future<absl::Status>> layers;
  for (uint32_t layer = 0; layer < kLayout.num_layers; ++layer) layers.push_back(sender_->SendLayer(peer_, Layer(15, layer)));
  std::future<absl::Status> aborted = sender_->Abort(peer_, 15);
  EXPECT_EQ(probe_.WaitDone(15).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(probe_.layers(15), int(kLayout.num_layers));  // every layer's notice came before the release
  for (auto& f : layers) EXPECT_TRUE(f.get().ok());
  EXPECT_TRUE(aborted.get().ok());
  EXPECT_EQ(sender_->pending_operations(), 0u);
}

// The sender's abort notice and the lease's expiry end a cancelled request's wait too.
TEST_F(UcxProtocolTest, CancelAfterSenderEndsAtTheSendersAbortOrTheLeasesEnd) {
  ASSERT_TRUE(receiver_->Expect(Expected(13)).ok());
  EXPECT_TRUE(receiver_->Cancel(13, KvReceiver::CancelRelease::kAfterSender));
  EXPECT_TRUE(sender_->Abort(peer_, 13).get().ok());
  EXPECT_EQ(probe_.WaitDone(13).code(), absl::StatusCode::kCancelled);

  ASSERT_TRUE(receiver_->Expect(Expected(14, absl::Milliseconds(300))).ok());
  EXPECT_TRUE(receiver_->Cancel(14, KvReceiver::CancelRelease::kAfterSender));
  absl::Status done = probe_.WaitDone(14, absl::Seconds(5));
  EXPECT_EQ(done.code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(done.message(), HasSubstr("timed out"));
  EXPECT_EQ(receiver_->active_leases(), 0u);
}

TEST_F(UcxProtocolTest, SenderAbortReleasesReceiverBlocks) {
  ASSERT_TRUE(receiver_->Expect(Expected(2)).ok());
  EXPECT_TRUE(sender_->SendLayer(peer_, Layer(2, 0)).get().ok());
  EXPECT_TRUE(sender_->Abort(peer_, 2).get().ok());
  EXPECT_EQ(probe_.WaitDone(2).code(), absl::StatusCode::kAborted);
  ASSERT_EQ(probe_.released().size(), 1u);
  EXPECT_EQ(probe_.released()[0].reason, LeaseEnd::kAborted);
  EXPECT_EQ(sender_->pending_operations(), 0u);
}

// Finish's completion form reports the same outcomes without a future: OK after the layers, the
// first failure otherwise.
TEST_F(UcxProtocolTest, LayersSentTogetherArriveAsLayers) {
  ASSERT_TRUE(receiver_->Expect(Expected(12)).ok());
  std::future<absl::Status> first = sender_->SendLayer(peer_, Layer(12, 0));
  LayerSend rest = Layer(12, 1);
  rest.num_layers = kLayout.num_layers - 1;
  std::future<absl::Status> together = sender_->SendLayer(peer_, rest);
  EXPECT_TRUE(sender_->Finish(peer_, 12).get().ok());
  EXPECT_TRUE(first.get().ok());
  EXPECT_TRUE(together.get().ok());
  EXPECT_TRUE(probe_.WaitDone(12).ok());  // every layer's checksum verified
  EXPECT_EQ(probe_.layers(12), int(kLayout.num_layers));
  ExpectSameTokens(src_, {1, 2, 3}, dst_, {7, 5, 6}, kLayout.num_layers, 40);
  EXPECT_EQ(sender_->pending_operations(), 0u);
}

TEST_F(UcxProtocolTest, LayersOutsideTheModelAreRefused) {
  ASSERT_TRUE(receiver_->Expect(Expected(13)).ok());
  LayerSend past_the_end = Layer(13, 2);
  past_the_end.num_layers = kLayout.num_layers - 1;
  absl::Status refused = sender_->SendLayer(peer_, past_the_end).get();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("layers 2..5"));
  LayerSend none = Layer(13, 0);
  none.num_layers = 0;
  EXPECT_EQ(sender_->SendLayer(peer_, none).get().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sender_->Finish(peer_, 13).get().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(probe_.WaitDone(13).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(sender_->pending_operations(), 0u);
  EXPECT_EQ(receiver_->active_leases(), 0u);
}

TEST_F(UcxProtocolTest, FinishWithACompletionReportsOnce) {
  auto finish_then = [this](uint64_t request_id) {
    auto reported = std::make_shared<std::promise<absl::Status>>();
    std::future<absl::Status> outcome = reported->get_future();
    sender_->Finish(peer_, request_id, [reported](const absl::Status& s) { reported->set_value(s); });
    return outcome.get();
  };
  ASSERT_TRUE(receiver_->Expect(Expected(8)).ok());
  for (uint32_t layer = 0; layer < kLayout.num_layers; ++layer) (void)sender_->SendLayer(peer_, Layer(8, layer));
  EXPECT_TRUE(finish_then(8).ok());
  EXPECT_TRUE(probe_.WaitDone(8).ok());

  ASSERT_TRUE(receiver_->Expect(Expected(9)).ok());
  LayerSend bad = Layer(9, 0);
  bad.dst_block_ids = {7, 5, kBlocks};  // outside the receiver's pool
  (void)sender_->SendLayer(peer_, bad);
  EXPECT_EQ(finish_then(9).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(probe_.WaitDone(9).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(sender_->pending_operations(), 0u);
}

TEST_F(UcxProtocolTest, FailedLayerMakesFinishFailAndAbortsTheReceiver) {
  ASSERT_TRUE(receiver_->Expect(Expected(3)).ok());
  LayerSend bad = Layer(3, 1);
  bad.dst_block_ids = {7, 5, kBlocks};  // outside the receiver's pool
  auto good = sender_->SendLayer(peer_, Layer(3, 0));
  absl::Status bad_status = sender_->SendLayer(peer_, bad).get();
  EXPECT_EQ(bad_status.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(bad_status.message(), HasSubstr("destination block id 32"));
  EXPECT_TRUE(good.get().ok());
  absl::Status finish = sender_->Finish(peer_, 3).get();
  EXPECT_EQ(finish.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(finish.message(), HasSubstr("layer 1"));
  EXPECT_EQ(probe_.WaitDone(3).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(sender_->pending_operations(), 0u);
  EXPECT_EQ(receiver_->active_leases(), 0u);
}


// The destination is checked once for a send of several layers; every layer fails with it.
TEST_F(UcxProtocolTest, BadDestinationFailsEveryLayerOfASend) {
  ASSERT_TRUE(receiver_->Expect(Expected(14)).ok());
  LayerSend bad = Layer(14, 0);
  bad.num_layers = kLayout.num_layers;
  bad.dst_block_ids = {7, 5, kBlocks};  // outside the receiver's pool
  absl::Status bad_status = sender_->SendLayer(peer_, bad).get();
  EXPECT_EQ(bad_status.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(bad_status.message(), HasSubstr("destination block id 32"));
  absl::Status finish = sender_->Finish(peer_, 14).get();
  EXPECT_EQ(finish.code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(probe_.WaitDone(14).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(probe_.layers(14), 0);
  EXPECT_EQ(sender_->pending_operations(), 0u);
  EXPECT_EQ(receiver_->active_leases(), 0u);
}
TEST_F(UcxProtocolTest, MissingChecksumFailsAVerifyingRequest) {
  ASSERT_TRUE(receiver_->Expect(Expected(4)).ok());
  EXPECT_TRUE(sender_->SendLayer(peer_, Layer(4, 0, /*checksums=*/false)).get().ok());
  absl::Status done = probe_.WaitDone(4);
  EXPECT_EQ(done.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(done.message(), HasSubstr("without checksums"));
  ASSERT_EQ(probe_.released().size(), 1u);
  EXPECT_EQ(probe_.released()[0].reason, LeaseEnd::kFailed);
}

TEST_F(UcxProtocolTest, LeaseExpiresWhenTheSenderGoesQuiet) {
  ASSERT_TRUE(receiver_->Expect(Expected(5, absl::Milliseconds(300))).ok());
  EXPECT_TRUE(sender_->SendLayer(peer_, Layer(5, 0)).get().ok());
  absl::Status done = probe_.WaitDone(5, absl::Seconds(5));
  EXPECT_EQ(done.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(done.message(), HasSubstr("1 of 4 layers received"));
  ASSERT_EQ(probe_.released().size(), 1u);
  EXPECT_EQ(probe_.released()[0].reason, LeaseEnd::kExpired);
  // A late finish is ignored: the request ended exactly once.
  EXPECT_TRUE(sender_->Finish(peer_, 5).get().ok());
  EXPECT_EQ(probe_.released().size(), 1u);
}

TEST_F(UcxProtocolTest, ClosedReceiverFailsWithinTheTimeout) {
  KvLayout layout = kLayout;
  HostKvPools dst(layout, kBlocks, 0);
  ReceiverProbe probe;
  auto receiver = CreateUcxKvReceiver(dst.memory(), probe.callbacks());
  ASSERT_TRUE(receiver.ok());
  const std::string descriptor = (*receiver)->descriptor();
  receiver->reset();

  const absl::Time start = absl::Now();
  absl::StatusOr<PeerId> peer = sender_->Connect(descriptor);
  if (peer.ok()) {  // endpoints to a worker address are created lazily by some transports
    absl::Status sent = sender_->SendLayer(*peer, Layer(6, 0)).get();
    EXPECT_FALSE(sent.ok());
    absl::Status finish = sender_->Finish(*peer, 6).get();
    EXPECT_FALSE(finish.ok());
    EXPECT_TRUE(absl::IsUnavailable(sent) || absl::IsDeadlineExceeded(sent)) << sent;
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(6));
  EXPECT_EQ(sender_->pending_operations(), 0u);
  // The other peer is unaffected.
  ASSERT_TRUE(receiver_->Expect(Expected(7)).ok());
  EXPECT_TRUE(sender_->SendLayer(peer_, Layer(7, 0)).get().ok());
}

// ---- Peers in child processes ----

constexpr KvLayout kChildLayout{4, 16, 2, 32, KvDtype::kFloat32};
constexpr uint32_t kChildBlocks = 16;
constexpr uint64_t kChildRequest = 77;
const std::vector<uint32_t> kChildSrcIds = {4, 9, 2};
const std::vector<uint32_t> kChildDstIds = {8, 3, 11};
constexpr uint32_t kChildTokens = 40;

// Children: this test binary re-executed in one role (DUET_KV_TEST_CHILD, see main()) over one
// HostTransport (DUET_KV_TEST_TRANSPORT: net or shm).
TEST(UcxDeadPeerTest, TransferToAKilledReceiverFailsCleanly) {
  ChildProcess child({"DUET_KV_TEST_CHILD=receiver", "DUET_KV_TEST_TRANSPORT=net"});
  const std::string descriptor = absl::HexStringToBytes(child.ReadLine());
  ASSERT_FALSE(descriptor.empty());

  HostKvPools src(kChildLayout, kChildBlocks, 5);
  auto sender = CreateUcxKvSender(src.memory(), {.operation_timeout = absl::Seconds(2),
                                                 .host_transport = HostTransport::kNetwork});
  ASSERT_TRUE(sender.ok());
  absl::StatusOr<PeerId> peer = (*sender)->Connect(descriptor);
  ASSERT_TRUE(peer.ok()) << peer.status();
  LayerSend layer{.request_id = kChildRequest, .layer = 0, .num_tokens = kChildTokens,
                  .src_block_ids = kChildSrcIds, .dst_block_ids = kChildDstIds};
  ASSERT_TRUE((*sender)->SendLayer(*peer, layer).get().ok());  // the peer was alive

  child.Kill();
  const absl::Time start = absl::Now();
  absl::Status status;
  // Depending on the transport, the first writes after the kill may still land in the dead
  // peer's buffers; within a few layers (and the operation timeout) the failure must show.
  for (uint32_t l = 1; l < kChildLayout.num_layers && status.ok(); ++l) {
    layer.layer = l;
    status = (*sender)->SendLayer(*peer, layer).get();
  }
  if (status.ok()) status = (*sender)->Finish(*peer, kChildRequest).get();
  EXPECT_FALSE(status.ok());
  EXPECT_TRUE(absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status)) << status;
  EXPECT_LT(absl::Now() - start, absl::Seconds(6));
  // Later operations fail at once with the peer's failure; nothing stays pending.
  EXPECT_FALSE((*sender)->SendLayer(*peer, layer).get().ok());
  EXPECT_FALSE((*sender)->Finish(*peer, kChildRequest).get().ok());
  EXPECT_EQ((*sender)->pending_operations(), 0u);
}

// Over shared memory a dead receiver is not reported by UCX: writes may still land in its
// segments. Every operation must still end within the operation timeout, and nothing leaks.
TEST(UcxDeadPeerTest, SharedMemoryTransferToAKilledReceiverEndsWithinTheTimeout) {
  ChildProcess child({"DUET_KV_TEST_CHILD=receiver", "DUET_KV_TEST_TRANSPORT=shm"});
  const std::string descriptor = absl::HexStringToBytes(child.ReadLine());
  ASSERT_FALSE(descriptor.empty());
  HostKvPools src(kChildLayout, kChildBlocks, 5);
  auto sender = CreateUcxKvSender(src.memory(), {.operation_timeout = absl::Seconds(2),
                                                 .host_transport = HostTransport::kSharedMemory});
  ASSERT_TRUE(sender.ok());
  absl::StatusOr<PeerId> peer = (*sender)->Connect(descriptor);
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_EQ((*sender)->path(*peer), TransferPath::kUcxSharedMemory);
  LayerSend layer{.request_id = kChildRequest, .layer = 0, .num_tokens = kChildTokens,
                  .src_block_ids = kChildSrcIds, .dst_block_ids = kChildDstIds};
  ASSERT_TRUE((*sender)->SendLayer(*peer, layer).get().ok());

  child.Kill();
  const absl::Time start = absl::Now();
  for (uint32_t l = 1; l < kChildLayout.num_layers; ++l) {
    layer.layer = l;
    absl::Status sent = (*sender)->SendLayer(*peer, layer).get();
    EXPECT_TRUE(sent.ok() || absl::IsDeadlineExceeded(sent) || absl::IsUnavailable(sent)) << sent;
  }
  absl::Status finish = (*sender)->Finish(*peer, kChildRequest).get();
  EXPECT_TRUE(finish.ok() || absl::IsDeadlineExceeded(finish) || absl::IsUnavailable(finish)) << finish;
  EXPECT_LT(absl::Now() - start, absl::Seconds(8));
  EXPECT_EQ((*sender)->pending_operations(), 0u);
}

// The receiver's side of a dead sender: the lease expires and releases the blocks exactly once,
// whatever the transport (the lease, not the transport, detects it).
void ExpectLeaseExpiresAfterSenderKill(const char* transport) {
  HostKvPools dst(kChildLayout, kChildBlocks, 0);
  ReceiverProbe probe;
  auto receiver = CreateUcxKvReceiver(dst.memory(), probe.callbacks());
  ASSERT_TRUE(receiver.ok());
  ASSERT_TRUE((*receiver)
                  ->Expect({.request_id = kChildRequest, .num_tokens = kChildTokens,
                            .dst_block_ids = kChildDstIds, .lease_ttl = absl::Seconds(1),
                            .verify_checksums = true})
                  .ok());
  ChildProcess child({"DUET_KV_TEST_CHILD=sender", absl::StrCat("DUET_KV_TEST_TRANSPORT=", transport)});
  child.Send(absl::BytesToHexString((*receiver)->descriptor()));
  ASSERT_EQ(child.ReadLine(), "sent 2 layers");
  child.Kill();

  absl::Status done = probe.WaitDone(kChildRequest, absl::Seconds(10));
  EXPECT_EQ(done.code(), absl::StatusCode::kDeadlineExceeded) << done;
  EXPECT_THAT(done.message(), HasSubstr("2 of 4 layers received"));
  ASSERT_EQ(probe.released().size(), 1u);
  EXPECT_EQ(probe.released()[0].reason, LeaseEnd::kExpired);
  EXPECT_EQ(probe.released()[0].block_ids, kChildDstIds);
  EXPECT_EQ((*receiver)->active_leases(), 0u);
  // The two layers that did arrive are intact.
  HostKvPools src(kChildLayout, kChildBlocks, 5);
  ExpectSameTokens(src, kChildSrcIds, dst, kChildDstIds, 2, kChildTokens);
}

TEST(UcxDeadPeerTest, ReceiverLeaseExpiresWhenTheSenderIsKilledMidRequest) {
  ExpectLeaseExpiresAfterSenderKill("net");
}

TEST(UcxDeadPeerTest, SharedMemoryReceiverLeaseExpiresWhenTheSenderIsKilledMidRequest) {
  ExpectLeaseExpiresAfterSenderKill("shm");
}

HostTransport ChildTransport() {
  const char* transport = std::getenv("DUET_KV_TEST_TRANSPORT");
  return transport != nullptr && std::string_view(transport) == "shm" ? HostTransport::kSharedMemory
                                                                      : HostTransport::kNetwork;
}

// Child role "receiver": publish a descriptor, then wait to be killed.
int RunChildReceiver() {
  HostKvPools dst(kChildLayout, kChildBlocks, 0);
  ReceiverCallbacks callbacks;
  callbacks.on_blocks_released = [](const ReleasedLease&) {};
  auto receiver = CreateUcxKvReceiver(dst.memory(), callbacks);
  if (!receiver.ok()) return 1;
  std::printf("%s\n", absl::BytesToHexString((*receiver)->descriptor()).c_str());
  std::fflush(stdout);
  while (true) pause();
}

// Child role "sender": connect to the descriptor on stdin, send two layers, wait to be killed.
int RunChildSender() {
  char line[1 << 16];
  if (std::fgets(line, sizeof(line), stdin) == nullptr) return 1;
  std::string hex(line);
  while (!hex.empty() && hex.back() == '\n') hex.pop_back();
  HostKvPools src(kChildLayout, kChildBlocks, 5);
  auto sender = CreateUcxKvSender(src.memory(), {.host_transport = ChildTransport()});
  if (!sender.ok()) return 1;
  absl::StatusOr<PeerId> peer = (*sender)->Connect(absl::HexStringToBytes(hex));
  if (!peer.ok()) return 1;
  for (uint32_t layer = 0; layer < 2; ++layer) {
    absl::Status sent = (*sender)->SendLayer(
        *peer, {.request_id = kChildRequest, .layer = layer, .num_tokens = kChildTokens,
                .src_block_ids = kChildSrcIds, .dst_block_ids = kChildDstIds,
                .with_checksums = true}).get();
    if (!sent.ok()) return 1;
  }
  std::printf("sent 2 layers\n");
  std::fflush(stdout);
  while (true) pause();
}

}  // namespace
}  // namespace duet::kvtransfer

int main(int argc, char** argv) {
  if (const char* role = std::getenv("DUET_KV_TEST_CHILD")) {
    if (std::string_view(role) == "receiver") return duet::kvtransfer::RunChildReceiver();
    if (std::string_view(role) == "sender") return duet::kvtransfer::RunChildSender();
    return 2;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

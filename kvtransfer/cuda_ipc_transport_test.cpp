// The CUDA IPC path (device_kv_memory.h) end to end on one GPU: a sender and a receiver with
// device pools, in one process and in two, the bytes checked against the source; peers killed
// mid-way leak nothing. Label gpu: skipped without a CUDA device.
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvtransfer/testing_child.h"
#include "kvtransfer/testing_device_pools.h"
#include "kvtransfer/testing_pools.h"
#include "kvtransfer/ucx_transport.h"

namespace duet::kvtransfer {
namespace {

using ::testing::HasSubstr;

bool HasGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define SKIP_WITHOUT_GPU() \
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device"

constexpr uint32_t kLayers = 4;
constexpr uint32_t kTokens = 150;
constexpr uint32_t kBlocks = 40;
constexpr uint64_t kRequest = 91;
// The receiver's layout; the sender's block size is a test parameter (16: same shape, 32: the
// copies re-block per head and token run).
constexpr KvLayout kReceiverLayout{kLayers, 16, 4, 64, KvDtype::kBFloat16};

std::vector<uint32_t> Ids(uint32_t tokens, uint32_t block_size, uint32_t first, uint32_t step) {
  std::vector<uint32_t> ids;
  for (uint32_t i = 0; i < (tokens + block_size - 1) / block_size; ++i) ids.push_back((first + i * step) % kBlocks);
  return ids;
}
const std::vector<uint32_t> kReceiverIds = Ids(kTokens, 16, 3, 3);

// The canonical K and V hashes of every layer's first `tokens` tokens.
std::string LayerHashes(const KvLayout& layout, HostKvPools& pools, const std::vector<uint32_t>& ids) {
  std::string out;
  for (uint32_t layer = 0; layer < layout.num_layers; ++layer) {
    absl::StrAppend(&out, HashLayerTokens(layout, pools.key(layer), ids, kTokens), ",",
                    HashLayerTokens(layout, pools.value(layer), ids, kTokens), ";");
  }
  return out;
}

class Probe {
 public:
  ReceiverCallbacks callbacks() {
    ReceiverCallbacks c;
    c.on_request_done = [this](uint64_t id, const absl::Status& status, MemoryKind landed) {
      absl::MutexLock lock(&mu_);
      done_[id] = {status, landed};
    };
    c.on_blocks_released = [this](const ReleasedLease&) {
      absl::MutexLock lock(&mu_);
      ++released_;
    };
    return c;
  }
  std::pair<absl::Status, MemoryKind> Wait(uint64_t id, absl::Duration timeout = absl::Seconds(20)) {
    absl::MutexLock lock(&mu_);
    auto ended = [&] { return done_.contains(id); };
    if (!mu_.AwaitWithTimeout(absl::Condition(&ended), timeout)) {
      return {absl::DeadlineExceededError("test wait"), MemoryKind::kHost};
    }
    return done_.at(id);
  }
  int released() {
    absl::MutexLock lock(&mu_);
    return released_;
  }

 private:
  absl::Mutex mu_;
  std::map<uint64_t, std::pair<absl::Status, MemoryKind>> done_;
  int released_ = 0;
};

// The sending side: seeded device pools of `block_size`, a sender over them and a stream.
struct DeviceSender {
  explicit DeviceSender(uint32_t block_size)
      : layout{kLayers, block_size, kReceiverLayout.num_kv_heads, kReceiverLayout.head_dim, kReceiverLayout.dtype},
        host(layout, kBlocks, /*seed=*/11), device(layout, kBlocks), ids(Ids(kTokens, block_size, 30, 7)) {
    device.Upload(host);
    memory = *CreateDeviceKvMemory(device.pools());
    sender = *CreateUcxKvSender(host.memory(), {.operation_timeout = absl::Seconds(3), .device = memory.get()});
    DUET_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  }
  ~DeviceSender() {
    sender.reset();
    cudaStreamDestroy(stream);
  }
  LayerSend Layer(uint32_t layer, const std::vector<uint32_t>& dst) const {
    return {.request_id = kRequest, .layer = layer, .num_tokens = kTokens, .src_block_ids = ids,
            .dst_block_ids = dst, .with_checksums = true, .device_stream = stream};
  }

  KvLayout layout;
  HostKvPools host;
  DeviceKvTestPools device;
  std::vector<uint32_t> ids;
  std::unique_ptr<DeviceKvMemory> memory;
  std::unique_ptr<KvSender> sender;
  cudaStream_t stream = nullptr;
};

// The receiving side: zeroed host and device pools and a receiver exporting the device ones.
struct DeviceReceiver {
  DeviceReceiver() : host(kReceiverLayout, kBlocks, 0), device(kReceiverLayout, kBlocks) {
    memory = *CreateDeviceKvMemory(device.pools());
    receiver = *CreateUcxKvReceiver(host.memory(), probe.callbacks(), {.device = memory.get()});
  }
  ExpectedRequest Expected(absl::Duration ttl = absl::Seconds(30)) const {
    return {.request_id = kRequest, .num_tokens = kTokens, .dst_block_ids = Ids(kTokens, 16, 1, 2),
            .device_block_ids = kReceiverIds, .lease_ttl = ttl, .verify_checksums = true};
  }
  std::string DeviceHashes() {
    HostKvPools copy(kReceiverLayout, kBlocks, 0);
    device.Download(copy);
    return LayerHashes(kReceiverLayout, copy, kReceiverIds);
  }

  Probe probe;
  HostKvPools host;
  DeviceKvTestPools device;
  std::unique_ptr<DeviceKvMemory> memory;
  std::unique_ptr<KvReceiver> receiver;
};

// Children: this binary re-executed in one role (DUET_IPC_TEST_CHILD, see main()).
class Child : public ChildProcess {
 public:
  explicit Child(const char* role) : ChildProcess({absl::StrCat("DUET_IPC_TEST_CHILD=", role)}) {}
};

class CudaIpcTransportTest : public ::testing::TestWithParam<uint32_t> {};

// In one process: the request in sends of `layers_per_send` layers (1: as a forward pass produces
// them; kLayers: one copy launch for all), then the receiver's device bytes.
void ExpectDeviceBytesEqualTheSource(uint32_t sender_block_size, uint32_t layers_per_send) {
  DeviceReceiver receiver;
  DeviceSender sender(sender_block_size);
  absl::StatusOr<PeerId> peer = sender.sender->Connect(receiver.receiver->descriptor());
  ASSERT_TRUE(peer.ok()) << peer.status();
  ASSERT_EQ(sender.sender->path(*peer), TransferPath::kCudaIpc);
  ASSERT_TRUE(receiver.receiver->Expect(receiver.Expected()).ok());
  std::vector<std::future<absl::Status>> sends;
  for (uint32_t layer = 0; layer < kLayers; layer += layers_per_send) {
    LayerSend send = sender.Layer(layer, kReceiverIds);
    send.num_layers = layers_per_send;
    sends.push_back(sender.sender->SendLayer(*peer, send));
  }
  EXPECT_TRUE(sender.sender->Finish(*peer, kRequest).get().ok());
  for (auto& send : sends) EXPECT_TRUE(send.get().ok());
  const auto [status, landed] = receiver.probe.Wait(kRequest);
  ASSERT_TRUE(status.ok()) << status;  // every layer's checksums verified
  EXPECT_EQ(landed, MemoryKind::kDevice);
  EXPECT_EQ(receiver.DeviceHashes(), LayerHashes(sender.layout, sender.host, sender.ids));
  EXPECT_EQ(sender.sender->pending_operations(), 0u);
  EXPECT_EQ(receiver.receiver->active_leases(), 0u);
}

TEST_P(CudaIpcTransportTest, InOneProcessTheDeviceBytesEqualTheSource) {
  SKIP_WITHOUT_GPU();
  ExpectDeviceBytesEqualTheSource(GetParam(), 1);
}

TEST_P(CudaIpcTransportTest, AllLayersInOneSendEqualTheSource) {
  SKIP_WITHOUT_GPU();
  ExpectDeviceBytesEqualTheSource(GetParam(), kLayers);
}

TEST_P(CudaIpcTransportTest, BetweenProcessesTheDeviceBytesEqualTheSource) {
  SKIP_WITHOUT_GPU();
  Child child("receiver");
  const std::string descriptor = absl::HexStringToBytes(child.ReadLine());
  ASSERT_FALSE(descriptor.empty());
  DeviceSender sender(GetParam());
  absl::StatusOr<PeerId> peer = sender.sender->Connect(descriptor);
  ASSERT_TRUE(peer.ok()) << peer.status();
  ASSERT_EQ(sender.sender->path(*peer), TransferPath::kCudaIpc);
  child.Send("expect");
  ASSERT_EQ(child.ReadLine(), "expecting");
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    (void)sender.sender->SendLayer(*peer, sender.Layer(layer, kReceiverIds));
  }
  ASSERT_TRUE(sender.sender->Finish(*peer, kRequest).get().ok());
  // The child verified every layer's checksums, then reports the bytes it holds.
  EXPECT_EQ(child.ReadLine(), absl::StrCat("done OK device ", LayerHashes(sender.layout, sender.host, sender.ids)));

  // Killed receiver: the sender lets go of its mapping and stays healthy.
  child.Kill();
  sender.sender->Disconnect(*peer);
  EXPECT_EQ(sender.sender->pending_operations(), 0u);
  EXPECT_EQ(cudaStreamSynchronize(sender.stream), cudaSuccess);
  HostKvPools back(sender.layout, kBlocks, 0);
  sender.device.Download(back);
  EXPECT_EQ(LayerHashes(sender.layout, back, sender.ids), LayerHashes(sender.layout, sender.host, sender.ids));
}

INSTANTIATE_TEST_SUITE_P(SenderBlockSize, CudaIpcTransportTest, ::testing::Values(16u, 32u));

TEST(CudaIpcDeadPeerTest, KilledSenderReleasesTheDeviceBlocksWithinTheLease) {
  SKIP_WITHOUT_GPU();
  DeviceReceiver receiver;
  ASSERT_TRUE(receiver.receiver->Expect(receiver.Expected(absl::Seconds(1))).ok());
  Child child("sender");
  child.Send(absl::BytesToHexString(receiver.receiver->descriptor()));
  ASSERT_EQ(child.ReadLine(), "sent 2 layers");
  child.Kill();
  const auto [status, landed] = receiver.probe.Wait(kRequest, absl::Seconds(10));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_EQ(receiver.probe.released(), 1);
  EXPECT_EQ(receiver.receiver->active_leases(), 0u);
}

TEST(CudaIpcPathTest, ASenderWithoutDevicePoolsUsesTheHostPools) {
  SKIP_WITHOUT_GPU();
  DeviceReceiver receiver;
  HostKvPools src(kReceiverLayout, kBlocks, 5);
  auto sender = CreateUcxKvSender(src.memory());
  ASSERT_TRUE(sender.ok());
  absl::StatusOr<PeerId> peer = (*sender)->Connect(receiver.receiver->descriptor());
  ASSERT_TRUE(peer.ok());
  EXPECT_EQ((*sender)->path(*peer), TransferPath::kUcxSharedMemory);
  const ExpectedRequest expected = receiver.Expected();
  ASSERT_TRUE(receiver.receiver->Expect(expected).ok());
  const std::vector<uint32_t> src_ids = Ids(kTokens, 16, 20, 1);
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    ASSERT_TRUE((*sender)
                    ->SendLayer(*peer, {.request_id = kRequest, .layer = layer, .num_tokens = kTokens,
                                        .src_block_ids = src_ids, .dst_block_ids = expected.dst_block_ids,
                                        .with_checksums = true})
                    .get()
                    .ok());
  }
  ASSERT_TRUE((*sender)->Finish(*peer, kRequest).get().ok());
  const auto [status, landed] = receiver.probe.Wait(kRequest);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(landed, MemoryKind::kHost);
  EXPECT_EQ(LayerHashes(kReceiverLayout, receiver.host, expected.dst_block_ids),
            LayerHashes(kReceiverLayout, src, src_ids));
}

// Child "receiver": device pools exported; on "expect", expects kRequest and reports how it ends.
int RunChildReceiver() {
  DeviceReceiver receiver;
  std::printf("%s\n", absl::BytesToHexString(receiver.receiver->descriptor()).c_str());
  std::fflush(stdout);
  char line[64];
  if (std::fgets(line, sizeof(line), stdin) == nullptr) return 1;
  if (!receiver.receiver->Expect(receiver.Expected()).ok()) return 1;
  std::printf("expecting\n");
  std::fflush(stdout);
  const auto [status, landed] = receiver.probe.Wait(kRequest, absl::Seconds(30));
  std::printf("done %s %s %s\n", status.ok() ? "OK" : status.ToString().c_str(),
              landed == MemoryKind::kDevice ? "device" : "host", receiver.DeviceHashes().c_str());
  std::fflush(stdout);
  while (true) pause();
}

// Child "sender": connects to the descriptor on stdin, enqueues two layers (never finishes).
int RunChildSender() {
  char line[1 << 16];
  if (std::fgets(line, sizeof(line), stdin) == nullptr) return 1;
  std::string hex(line);
  while (!hex.empty() && hex.back() == '\n') hex.pop_back();
  DeviceSender sender(16);
  absl::StatusOr<PeerId> peer = sender.sender->Connect(absl::HexStringToBytes(hex));
  if (!peer.ok() || sender.sender->path(*peer) != TransferPath::kCudaIpc) return 1;
  for (uint32_t layer = 0; layer < 2; ++layer) (void)sender.sender->SendLayer(*peer, sender.Layer(layer, kReceiverIds));
  cudaStreamSynchronize(sender.stream);
  std::printf("sent 2 layers\n");
  std::fflush(stdout);
  while (true) pause();
}

}  // namespace
}  // namespace duet::kvtransfer

int main(int argc, char** argv) {
  if (const char* role = std::getenv("DUET_IPC_TEST_CHILD")) {
    if (std::string_view(role) == "receiver") return duet::kvtransfer::RunChildReceiver();
    if (std::string_view(role) == "sender") return duet::kvtransfer::RunChildSender();
    return 2;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

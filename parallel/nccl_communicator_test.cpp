#include "parallel/nccl_communicator.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

#include "gtest/gtest.h"

namespace duet::parallel {
namespace {

int GpuCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

#define SKIP_WITHOUT_GPU() \
  if (GpuCount() == 0) GTEST_SKIP() << "no CUDA device"

std::string NvlsSetting() {
  const char* value = std::getenv("NCCL_NVLS_ENABLE");
  return value == nullptr ? "(unset)" : value;
}

// A block of `elements` int64 that says who made it and for which step.
std::vector<int64_t> Pattern(int owner, int step, size_t elements) {
  std::vector<int64_t> block(elements);
  for (size_t i = 0; i < elements; ++i) {
    block[i] = (int64_t{owner} << 40) + (int64_t{step} << 20) + static_cast<int64_t>(i);
  }
  return block;
}

class DeviceBuffer {
 public:
  DeviceBuffer(int device, size_t bytes) : bytes_(bytes) {
    EXPECT_EQ(cudaSetDevice(device), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&data_, bytes), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  std::span<std::byte> bytes() { return {static_cast<std::byte*>(data_), bytes_}; }
  void Upload(const std::vector<int64_t>& host) {
    ASSERT_EQ(host.size() * sizeof(int64_t), bytes_);
    ASSERT_EQ(cudaMemcpy(data_, host.data(), bytes_, cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<int64_t> Download() {
    std::vector<int64_t> host(bytes_ / sizeof(int64_t));
    EXPECT_EQ(cudaMemcpy(host.data(), data_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }
  // cudaMemset may still be running when it returns, and the communicator's stream does not wait
  // for the default stream: finish it before the buffer takes part in an exchange.
  void Poison() {
    ASSERT_EQ(cudaMemset(data_, 0xA5, bytes_), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }

 private:
  void* data_ = nullptr;
  size_t bytes_;
};

TEST(NcclCommunicatorTest, DisableNcclMulticastOverwritesTheEnvironment) {
  // In a fresh process (the death-test child), so the once-per-process setenv has not run yet.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("NCCL_NVLS_ENABLE", "1", 1);
        const bool ok = DisableNcclMulticast().ok() && NvlsSetting() == "0";
        std::_Exit(ok ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(NcclCommunicatorTest, MulticastTurnedBackOnIsRefused) {
  ASSERT_TRUE(DisableNcclMulticast().ok());
  setenv("NCCL_NVLS_ENABLE", "1", 1);
  EXPECT_EQ(DisableNcclMulticast().code(), absl::StatusCode::kFailedPrecondition);
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  EXPECT_TRUE(DisableNcclMulticast().ok());
}

// Argument checks come before NCCL or CUDA are touched, so they hold without a GPU too.
TEST(NcclCommunicatorTest, BadArgumentsAreRefused) {
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  EXPECT_EQ(CreateNcclCommunicator(1, 1, id, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateNcclCommunicator(0, 0, id, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateNcclCommunicator(0, 1, id, -1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateNcclCommunicators({}).status().code(), absl::StatusCode::kInvalidArgument);
  const int twice[] = {0, 0};
  EXPECT_EQ(CreateNcclCommunicators(twice).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(NcclCommunicatorTest, SizeOneExchangesWithItself) {
  SKIP_WITHOUT_GPU();
  absl::StatusOr<ncclUniqueId> id = CreateNcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<std::unique_ptr<Communicator>> made = CreateNcclCommunicator(0, 1, *id, 0);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(NvlsSetting(), "0");
  Communicator& comm = **made;
  EXPECT_EQ(comm.rank(), 0);
  EXPECT_EQ(comm.size(), 1);

  constexpr size_t kElements = 1 << 18;  // 2 MiB
  DeviceBuffer send(0, kElements * sizeof(int64_t));
  DeviceBuffer recv(0, kElements * sizeof(int64_t));
  for (int step = 0; step < 200; ++step) {
    send.Upload(Pattern(0, step, kElements));
    recv.Poison();
    absl::Status status = comm.StartRingExchange(send.bytes(), recv.bytes())->Wait();
    ASSERT_TRUE(status.ok()) << status;
    ASSERT_EQ(recv.Download(), Pattern(0, step, kElements)) << "step " << step;
  }

  send.Upload(Pattern(0, 9, kElements));
  ASSERT_TRUE(comm.Broadcast(send.bytes(), 0).ok());
  EXPECT_EQ(send.Download(), Pattern(0, 9, kElements));
  EXPECT_EQ(comm.Broadcast(send.bytes(), 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(comm.Barrier().ok());
  EXPECT_EQ(comm.StartRingExchange(send.bytes(), recv.bytes().first(8))->Wait().code(),
            absl::StatusCode::kInvalidArgument);
  // The communicator stays usable after a refused exchange.
  EXPECT_TRUE(comm.StartRingExchange(send.bytes(), recv.bytes())->Wait().ok());
  EXPECT_EQ(NvlsSetting(), "0");
}

// One process driving every visible GPU (a group of one on a one-GPU machine), a thread a rank:
// N - 1 ring steps carry every block round, broadcasts from each root, a barrier.
TEST(NcclCommunicatorTest, OneProcessDrivingEveryGpu) {
  SKIP_WITHOUT_GPU();
  const int size = GpuCount();
  std::vector<int> devices(size);
  for (int d = 0; d < size; ++d) devices[d] = d;
  absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> made =
      CreateNcclCommunicators(devices);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(NvlsSetting(), "0");
  std::vector<std::unique_ptr<Communicator>>& ranks = *made;
  ASSERT_EQ(ranks.size(), static_cast<size_t>(size));

  constexpr size_t kElements = 1 << 16;
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      Communicator& comm = *ranks[r];
      ASSERT_EQ(comm.rank(), r);
      DeviceBuffer buffers[2] = {DeviceBuffer(r, kElements * sizeof(int64_t)),
                                 DeviceBuffer(r, kElements * sizeof(int64_t))};
      buffers[0].Upload(Pattern(r, 0, kElements));
      for (int step = 1; step < size; ++step) {
        DeviceBuffer& in_hand = buffers[(step - 1) % 2];
        DeviceBuffer& next = buffers[step % 2];
        next.Poison();
        absl::Status status = comm.StartRingExchange(in_hand.bytes(), next.bytes())->Wait();
        ASSERT_TRUE(status.ok()) << status;
        EXPECT_EQ(next.Download(), Pattern((r - step + size) % size, 0, kElements))
            << "rank " << r << " step " << step;
      }
      for (int root = 0; root < size; ++root) {
        DeviceBuffer data(r, kElements * sizeof(int64_t));
        if (r == root) {
          data.Upload(Pattern(root, 5, kElements));
        } else {
          data.Poison();
        }
        absl::Status status = comm.Broadcast(data.bytes(), root);
        ASSERT_TRUE(status.ok()) << status;
        EXPECT_EQ(data.Download(), Pattern(root, 5, kElements)) << "rank " << r << " root " << root;
      }
      EXPECT_TRUE(comm.Barrier().ok());
    });
  }
  for (std::thread& t : threads) t.join();
}

}  // namespace
}  // namespace duet::parallel

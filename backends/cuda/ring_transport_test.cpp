// The ring transports move every rank's block to the next rank, whole and unchanged.
#include "backends/cuda/ring_transport.h"

#include <cstdint>
#include <vector>

#include <cuda_runtime.h>

#include "gtest/gtest.h"

namespace duet::cuda {
namespace {

int GpuCount() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess;
  cudaGetLastError();
  return ok ? n : 0;
}

// Rank r's K and V blocks: words saying who made them.
std::vector<uint32_t> Pattern(int rank, int pool, size_t words) {
  std::vector<uint32_t> v(words);
  for (size_t i = 0; i < words; ++i) v[i] = (uint32_t(rank) << 24) | (uint32_t(pool) << 20) | uint32_t(i);
  return v;
}

// Runs `steps` ring steps over `devices` with `kind` and checks that rank r holds rank
// (r - step)'s block after each.
void ExpectRingPassesBlocks(const std::string& kind, const std::vector<int>& devices) {
  const int n = int(devices.size());
  const size_t words = 3 * 4096 + 5, bytes = words * 4;
  absl::StatusOr<std::unique_ptr<RingTransport>> transport = CreateRingTransport(kind, devices);
  ASSERT_TRUE(transport.ok()) << transport.status();
  EXPECT_EQ((*transport)->name(), kind);
  // Two buffers per rank and pool: step k reads buffer (k - 1) % 2, writes k % 2.
  std::vector<std::array<std::array<void*, 2>, 2>> buffers(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(cudaSetDevice(devices[size_t(r)]), cudaSuccess);
    for (auto& pools : buffers[size_t(r)]) {
      for (void*& p : pools) ASSERT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
    }
    for (int pool = 0; pool < 2; ++pool) {
      ASSERT_EQ(cudaMemcpy(buffers[size_t(r)][0][size_t(pool)], Pattern(r, pool, words).data(), bytes,
                           cudaMemcpyHostToDevice),
                cudaSuccess);
    }
  }
  for (int step = 1; step <= n; ++step) {
    std::vector<std::array<void*, 2>> held, recv;
    for (int r = 0; r < n; ++r) {
      held.push_back(buffers[size_t(r)][size_t((step - 1) % 2)]);
      recv.push_back(buffers[size_t(r)][size_t(step % 2)]);
    }
    ASSERT_TRUE((*transport)->EnqueueStep(held, recv, bytes).ok());
    for (int r = 0; r < n; ++r) {
      ASSERT_EQ(cudaSetDevice(devices[size_t(r)]), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize((*transport)->stream(r)), cudaSuccess);
    }
    for (int r = 0; r < n; ++r) {
      const int source = ((r - step) % n + n) % n;
      for (int pool = 0; pool < 2; ++pool) {
        std::vector<uint32_t> got(words);
        ASSERT_EQ(cudaMemcpy(got.data(), recv[size_t(r)][size_t(pool)], bytes, cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(got, Pattern(source, pool, words)) << kind << " step " << step << " rank " << r << " pool " << pool;
      }
    }
  }
  for (auto& rank : buffers) {
    for (auto& pools : rank) {
      for (void* p : pools) cudaFree(p);
    }
  }
}

TEST(RingTransport, PeerCopiesBetweenRanksOnOneGpu) {
  if (GpuCount() == 0) GTEST_SKIP() << "no CUDA device";
  ExpectRingPassesBlocks("peer", {0, 0});
  ExpectRingPassesBlocks("peer", {0, 0, 0});
}

TEST(RingTransport, PeerAndNcclOverEveryGpu) {
  if (GpuCount() < 2) GTEST_SKIP() << "needs two GPUs";
  std::vector<int> devices;
  for (int d = 0; d < GpuCount(); ++d) devices.push_back(d);
  ExpectRingPassesBlocks("peer", devices);
  ExpectRingPassesBlocks("nccl", devices);
}

TEST(RingTransport, NcclRefusesTwoRanksOnOneGpuAndUnknownKinds) {
  if (GpuCount() == 0) GTEST_SKIP() << "no CUDA device";
  EXPECT_EQ(CreateRingTransport("nccl", {0, 0}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateRingTransport("carrier-pigeon", {0, 0}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateRingTransport("peer", {0}).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace duet::cuda

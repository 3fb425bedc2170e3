#include "cli/worker_placement.h"

#include <gtest/gtest.h>

namespace duet {
namespace {

// Without devices every worker shares serve's first GPU, as before: the fraction split evenly.
TEST(WorkerPlacementTest, OneSharedGpuSplitsTheFractionEvenly) {
  absl::StatusOr<Placement> p = PlaceWorkers({.num_prefill_workers = 1, .num_decode_workers = 2,
                                              .gpu_memory_utilization = 0.9});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->decode.size(), 2u);
  ASSERT_EQ(p->prefill.size(), 1u);
  for (const WorkerPlacement& w : p->decode) {
    EXPECT_FALSE(w.cuda_visible_devices.has_value());
    EXPECT_DOUBLE_EQ(w.gpu_memory_utilization, 0.3);
  }
  EXPECT_DOUBLE_EQ(p->prefill[0].gpu_memory_utilization, 0.3);
}

// A sequence-parallel group on GPUs 0-3 and the decode workers on 4 and 5: nobody shares, so every
// executor may use the whole fraction; each decode worker sees only its GPU.
TEST(WorkerPlacementTest, DecodeWorkersOnTheirOwnGpus) {
  absl::StatusOr<Placement> p = PlaceWorkers({.num_prefill_workers = 1, .num_decode_workers = 2,
                                              .prefill_group_devices = {0, 1, 2, 3}, .decode_devices = {4, 5},
                                              .gpu_memory_utilization = 0.9});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->decode[0].cuda_visible_devices, "4");
  EXPECT_EQ(p->decode[1].cuda_visible_devices, "5");
  EXPECT_DOUBLE_EQ(p->decode[0].gpu_memory_utilization, 0.9);
  EXPECT_DOUBLE_EQ(p->prefill[0].gpu_memory_utilization, 0.9);
  EXPECT_FALSE(p->prefill[0].cuda_visible_devices.has_value());
}

// Three decode workers on two GPUs cycle 6, 7, 6; GPU 6 holds two of them and rank 1 of the group
// sits on 7 beside one, so the prefill worker's share follows its most shared GPU.
TEST(WorkerPlacementTest, SharedGpusSplitByTheirMostSharedDevice) {
  absl::StatusOr<Placement> p = PlaceWorkers({.num_prefill_workers = 1, .num_decode_workers = 3,
                                              .prefill_group_devices = {0, 7}, .decode_devices = {6, 7},
                                              .gpu_memory_utilization = 0.8});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->decode[2].cuda_visible_devices, "6");
  EXPECT_DOUBLE_EQ(p->decode[0].gpu_memory_utilization, 0.4);  // GPU 6: decode 0 and 2
  EXPECT_DOUBLE_EQ(p->decode[1].gpu_memory_utilization, 0.4);  // GPU 7: decode 1 and rank 1
  EXPECT_DOUBLE_EQ(p->prefill[0].gpu_memory_utilization, 0.4);
}

// A group whose ranks repeat a GPU counts each rank: --devices 0,0 beside a decode worker on 0.
TEST(WorkerPlacementTest, RanksOnOneGpuCountOneEach) {
  absl::StatusOr<Placement> p = PlaceWorkers({.num_prefill_workers = 1, .num_decode_workers = 1,
                                              .prefill_group_devices = {0, 0}, .gpu_memory_utilization = 0.9});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->decode[0].gpu_memory_utilization, 0.3, 1e-12);
  EXPECT_NEAR(p->prefill[0].gpu_memory_utilization, 0.3, 1e-12);
}

// Device numbers are serve's own: under CUDA_VISIBLE_DEVICES=2,3 device 1 is the GPU "3".
TEST(WorkerPlacementTest, DevicesIndexServesOwnVisibleDevices) {
  absl::StatusOr<Placement> p = PlaceWorkers({.num_decode_workers = 2, .decode_devices = {1, 0},
                                              .visible_devices = "2, GPU-5e3f"});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->decode[0].cuda_visible_devices, "GPU-5e3f");
  EXPECT_EQ(p->decode[1].cuda_visible_devices, "2");
}

TEST(WorkerPlacementTest, ADeviceServeDoesNotSeeIsRefused) {
  absl::StatusOr<Placement> p = PlaceWorkers({.decode_devices = {2}, .visible_devices = "0,1"});
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("CUDA_VISIBLE_DEVICES=\"0,1\" names 2"), std::string::npos) << p.status();
  EXPECT_FALSE(PlaceWorkers({.decode_devices = {-1}}).ok());
}

}  // namespace
}  // namespace duet

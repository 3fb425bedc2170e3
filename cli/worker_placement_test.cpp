#include "cli/worker_placement.h"

#include <gtest/gtest.h>

namespace duet {
namespace {

// The GPU a placed worker runs on: the first of its CUDA_VISIBLE_DEVICES.
std::string FirstGpu(const WorkerPlacement& w) {
  const std::string& v = w.cuda_visible_devices.value_or("");
  return v.substr(0, v.find(','));
}

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
// executor may use the whole fraction; each decode worker sees its GPU first and the others after
// it (the indices past the host's GPUs are ignored by CUDA).
TEST(WorkerPlacementTest, DecodeWorkersOnTheirOwnGpus) {
  absl::StatusOr<Placement> p = PlaceWorkers({.num_prefill_workers = 1, .num_decode_workers = 2,
                                              .prefill_group_devices = {0, 1, 2, 3}, .decode_devices = {4, 5},
                                              .gpu_memory_utilization = 0.9});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->decode[0].cuda_visible_devices.value_or("").substr(0, 20), "4,0,1,2,3,5,6,7,8,9,");
  EXPECT_EQ(FirstGpu(p->decode[1]), "5");
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
  EXPECT_EQ(FirstGpu(p->decode[2]), "6");
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

// 2 prefill + 2 decode workers on four GPUs (--prefill-devices 0,1 --decode-devices 2,3): each
// alone on its GPU.
TEST(WorkerPlacementTest, PrefillWorkersOnTheirOwnGpus) {
  absl::StatusOr<Placement> p = PlaceWorkers({.num_prefill_workers = 2, .num_decode_workers = 2,
                                              .prefill_devices = {0, 1}, .decode_devices = {2, 3},
                                              .gpu_memory_utilization = 0.9});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(FirstGpu(p->prefill[0]), "0");
  EXPECT_EQ(FirstGpu(p->prefill[1]), "1");
  EXPECT_EQ(FirstGpu(p->decode[1]), "3");
  for (const auto* role : {&p->prefill, &p->decode}) {
    for (const WorkerPlacement& w : *role) EXPECT_DOUBLE_EQ(w.gpu_memory_utilization, 0.9);
  }
}

// A group's GPUs are --devices; --prefill-devices beside them is refused.
TEST(WorkerPlacementTest, PrefillDevicesAndAGroupsDevicesAreRefusedTogether) {
  absl::StatusOr<Placement> p = PlaceWorkers({.prefill_group_devices = {0, 1}, .prefill_devices = {2}});
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("--devices"), std::string::npos) << p.status();
}

// Device numbers are serve's own: under CUDA_VISIBLE_DEVICES="2, GPU-5e3f" device 1 is the GPU
// "GPU-5e3f", listed first with "2" after it.
TEST(WorkerPlacementTest, DevicesIndexServesOwnVisibleDevices) {
  absl::StatusOr<Placement> p = PlaceWorkers({.num_decode_workers = 2, .decode_devices = {1, 0},
                                              .visible_devices = "2, GPU-5e3f"});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->decode[0].cuda_visible_devices, "GPU-5e3f,2");
  EXPECT_EQ(p->decode[1].cuda_visible_devices, "2,GPU-5e3f");
}

TEST(WorkerPlacementTest, ADeviceServeDoesNotSeeIsRefused) {
  absl::StatusOr<Placement> p = PlaceWorkers({.decode_devices = {2}, .visible_devices = "0,1"});
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("--decode-devices: device 2 but CUDA_VISIBLE_DEVICES=\"0,1\" names 2"),
            std::string::npos)
      << p.status();
  EXPECT_FALSE(PlaceWorkers({.decode_devices = {-1}}).ok());
}

}  // namespace
}  // namespace duet

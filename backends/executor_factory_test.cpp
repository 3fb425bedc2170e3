#include "backends/executor_factory.h"

#include <cstdlib>
#include <string>

#include "gtest/gtest.h"

namespace duet {
namespace {

const std::string kModel = std::string(DUET_MODELS_DIR) + "/tiny-code-llama";

TEST(ExecutorFactoryTest, CpuBackendLoadsTheModel) {
  EngineConfig config;
  config.model_dir = kModel;
  config.backend = "cpu";
  absl::StatusOr<std::unique_ptr<ModelExecutor>> executor = LoadExecutor(config);
  ASSERT_TRUE(executor.ok()) << executor.status();
  EXPECT_EQ((*executor)->config().num_layers, 6);
}

TEST(ExecutorFactoryTest, UnknownBackendIsRefused) {
  EngineConfig config;
  config.model_dir = kModel;
  config.backend = "tpu";
  EXPECT_FALSE(LoadExecutor(config).ok());
}

#ifdef DUET_HAVE_CUDA
// The variables are read before any device is touched, so this holds on a machine without a GPU.
TEST(ExecutorFactoryTest, AKernelRowCountThatIsNotOneIsAClearError) {
  EngineConfig config;
  config.model_dir = kModel;
  config.backend = "cuda";
  for (const char* name : {"DUET_WIDE_GEMM_MIN_ROWS", "DUET_GEMM_TUNING_MAX_ROWS"}) {
    for (const char* bad : {"abc", "-1", "64rows", ""}) {
      ASSERT_EQ(setenv(name, bad, 1), 0);
      absl::StatusOr<std::unique_ptr<ModelExecutor>> executor = LoadExecutor(config);
      ASSERT_FALSE(executor.ok()) << name << "=" << bad;
      EXPECT_EQ(executor.status().code(), absl::StatusCode::kInvalidArgument) << name << "=" << bad;
      EXPECT_NE(executor.status().message().find(name), std::string::npos) << executor.status();
    }
    unsetenv(name);
  }
}

TEST(ExecutorFactoryTest, AKernelRowRangeThatIsNotOneIsAClearError) {
  EngineConfig config;
  config.model_dir = kModel;
  config.backend = "cuda";
  const char* name = "DUET_WIDE_GEMM_SILU_ROWS";
  for (const char* bad : {"abc", "192", "192-", "-448", "448-192", "0-448", "192-448rows", ""}) {
    ASSERT_EQ(setenv(name, bad, 1), 0);
    absl::StatusOr<std::unique_ptr<ModelExecutor>> executor = LoadExecutor(config);
    ASSERT_FALSE(executor.ok()) << name << "=" << bad;
    EXPECT_EQ(executor.status().code(), absl::StatusCode::kInvalidArgument) << name << "=" << bad;
    EXPECT_NE(executor.status().message().find(name), std::string::npos) << executor.status();
  }
  unsetenv(name);
}
#endif

}  // namespace
}  // namespace duet

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
// The variable is read before any device is touched, so this holds on a machine without a GPU.
TEST(ExecutorFactoryTest, AWideGemmRowCountThatIsNotOneIsAClearError) {
  EngineConfig config;
  config.model_dir = kModel;
  config.backend = "cuda";
  for (const char* bad : {"abc", "-1", "64rows", ""}) {
    ASSERT_EQ(setenv("DUET_WIDE_GEMM_MIN_ROWS", bad, 1), 0);
    absl::StatusOr<std::unique_ptr<ModelExecutor>> executor = LoadExecutor(config);
    ASSERT_FALSE(executor.ok()) << bad;
    EXPECT_EQ(executor.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(executor.status().message().find("DUET_WIDE_GEMM_MIN_ROWS"), std::string::npos) << executor.status();
  }
  unsetenv("DUET_WIDE_GEMM_MIN_ROWS");
}
#endif

}  // namespace
}  // namespace duet

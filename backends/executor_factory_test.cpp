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
// Loading the CUDA backend with $name=value fails with an InvalidArgument that names the variable.
// The variables are read before any device is touched, so this holds on a machine without a GPU.
void ExpectClearErrorFor(const char* name, const char* value) {
  EngineConfig config;
  config.model_dir = kModel;
  config.backend = "cuda";
  ASSERT_EQ(setenv(name, value, 1), 0);
  absl::StatusOr<std::unique_ptr<ModelExecutor>> executor = LoadExecutor(config);
  unsetenv(name);
  ASSERT_FALSE(executor.ok()) << name << "=" << value;
  EXPECT_EQ(executor.status().code(), absl::StatusCode::kInvalidArgument) << name << "=" << value;
  EXPECT_NE(executor.status().message().find(name), std::string::npos) << executor.status();
}

TEST(ExecutorFactoryTest, AKernelRowCountThatIsNotOneIsAClearError) {
  for (const char* name : {"DUET_WIDE_GEMM_MIN_ROWS", "DUET_GEMM_TUNING_MAX_ROWS"}) {
    for (const char* bad : {"abc", "-1", "64rows", ""}) ExpectClearErrorFor(name, bad);
  }
}

TEST(ExecutorFactoryTest, ASwitchThatIsNotZeroOrOneIsAClearError) {
  for (const char* bad : {"yes", "2", "01", ""}) ExpectClearErrorFor("DUET_LAST_LAYER_LOGIT_ROWS_ONLY", bad);
}
#endif

}  // namespace
}  // namespace duet

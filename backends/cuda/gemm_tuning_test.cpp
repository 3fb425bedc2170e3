// GemmTuning on a real device: a kept cuBLASLt algorithm computes the product cuBLAS's default
// does (within bf16 rounding of the output; a K split only reorders fp32 sums), shapes never tuned
// or tuned without a gain fall back to the caller, and bad shapes are refused.
#include "backends/cuda/gemm_tuning.h"

#include <cmath>
#include <vector>

#include <cublas_v2.h>

#include "gtest/gtest.h"
#include "kernels/kernel_test_util.h"

namespace duet::cuda {
namespace {

class GemmTuningTest : public ::testing::Test {
 protected:
  // y[rows, out] = x[rows, in] · W[out, in]^T with three layers' W.
  static constexpr int kRows = 384, kIn = 1024, kOut = 768, kLayers = 3;

  void SetUp() override {
    DUET_SKIP_WITHOUT_GPU();
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
    ASSERT_EQ(cublasCreate(&cublas_), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasSetStream(cublas_, stream_), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cudaMalloc(&workspace_, kWorkspaceBytes), cudaSuccess);
    ASSERT_EQ(cublasSetWorkspace(cublas_, workspace_, kWorkspaceBytes), CUBLAS_STATUS_SUCCESS);
    x_host_ = kernels::testing::RandomFloats(size_t(kRows) * kIn, 1);
    x_ = Upload(x_host_);
    for (int l = 0; l < kLayers; ++l) {
      w_host_.push_back(kernels::testing::RandomFloats(size_t(kOut) * kIn, 10 + uint64_t(l), -0.05f, 0.05f));
      weights_.push_back(Upload(w_host_.back()));
    }
    ASSERT_EQ(cudaMalloc(&y_, size_t(kRows) * kOut * 2), cudaSuccess);
    auto tuning = GemmTuning::Create(stream_, workspace_, kWorkspaceBytes);
    ASSERT_TRUE(tuning.ok()) << tuning.status();
    tuning_ = std::move(*tuning);
  }
  void TearDown() override {
    tuning_.reset();
    for (const __nv_bfloat16* w : weights_) cudaFree(const_cast<__nv_bfloat16*>(w));
    cudaFree(const_cast<__nv_bfloat16*>(x_));
    cudaFree(y_);
    cudaFree(workspace_);
    if (cublas_ != nullptr) cublasDestroy(cublas_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Rounds `v` to bf16 on the host (the values the device holds) and uploads it.
  const __nv_bfloat16* Upload(std::vector<float>& v) {
    std::vector<__nv_bfloat16> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      b[i] = __float2bfloat16(v[i]);
      v[i] = __bfloat162float(b[i]);
    }
    __nv_bfloat16* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, b.size() * 2), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d, b.data(), b.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    return d;
  }
  void RunDefault(const __nv_bfloat16* w) {
    const float alpha = 1.0f, beta = 0.0f;
    ASSERT_EQ(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, kOut, kRows, kIn, &alpha, w, CUDA_R_16BF, kIn, x_,
                           CUDA_R_16BF, kIn, &beta, y_, CUDA_R_16BF, kOut, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              CUBLAS_STATUS_SUCCESS);
  }
  absl::StatusOr<GemmTuning::Result> Tune(const GemmTuning::Shape& shape, double max_time_ratio) {
    return tuning_->Tune(shape, weights_, x_, y_, [this](const __nv_bfloat16* w) { RunDefault(w); }, max_time_ratio);
  }
  // y as the host sees it, after the stream's work.
  std::vector<float> Download() {
    std::vector<__nv_bfloat16> b(size_t(kRows) * kOut);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(b.data(), y_, b.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    std::vector<float> y(b.size());
    for (size_t i = 0; i < b.size(); ++i) y[i] = __bfloat162float(b[i]);
    return y;
  }
  // Every element within bf16 rounding of the fp32 reference of layer `l`'s product.
  void ExpectProductOfLayer(const std::vector<float>& y, int l) {
    const std::vector<float>& w = w_host_[size_t(l)];
    int bad = 0;
    for (int r = 0; r < kRows; r += 7) {  // a sample of rows keeps the host reference quick
      for (int o = 0; o < kOut; ++o) {
        double want = 0;
        for (int k = 0; k < kIn; ++k) want += double(x_host_[size_t(r) * kIn + k]) * w[size_t(o) * kIn + k];
        const double got = y[size_t(r) * kOut + o];
        if (std::fabs(got - want) > 1e-2 + 8e-3 * std::fabs(want)) ++bad;
      }
    }
    EXPECT_EQ(bad, 0);
  }

  static constexpr size_t kWorkspaceBytes = size_t(32) << 20;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  void* workspace_ = nullptr;
  std::vector<float> x_host_;
  std::vector<std::vector<float>> w_host_;
  const __nv_bfloat16* x_ = nullptr;
  std::vector<const __nv_bfloat16*> weights_;
  __nv_bfloat16* y_ = nullptr;
  std::unique_ptr<GemmTuning> tuning_;
};

TEST_F(GemmTuningTest, KeptAlgorithmComputesTheProduct) {
  const GemmTuning::Shape shape{kRows, kIn, kOut};
  // Kept whatever the timing says, so the test always runs a tuned algorithm.
  absl::StatusOr<GemmTuning::Result> r = Tune(shape, 1e9);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->kept);
  EXPECT_GT(r->candidates, 0);
  EXPECT_GT(r->default_us, 0);
  EXPECT_GT(r->best_us, 0);
  EXPECT_FALSE(r->algorithm.empty());
  EXPECT_EQ(tuning_->num_kept(), 1u);
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_EQ(cudaMemsetAsync(y_, 0xff, size_t(kRows) * kOut * 2, stream_), cudaSuccess);  // NaNs until written
    ASSERT_TRUE(tuning_->Run(shape, x_, weights_[size_t(l)], y_));
    ExpectProductOfLayer(Download(), l);
  }
}

TEST_F(GemmTuningTest, WithoutAKeptAlgorithmTheCallerRunsTheDefault) {
  const GemmTuning::Shape shape{kRows, kIn, kOut};
  EXPECT_FALSE(tuning_->Run(shape, x_, weights_[0], y_));  // never tuned
  absl::StatusOr<GemmTuning::Result> r = Tune(shape, 0.0);  // nothing takes no time
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->kept);
  EXPECT_EQ(tuning_->num_kept(), 0u);
  EXPECT_FALSE(tuning_->Run(shape, x_, weights_[0], y_));
  // Kept, then tuned again without a gain: the default again.
  ASSERT_TRUE(Tune(shape, 1e9).ok());
  EXPECT_TRUE(tuning_->Run(shape, x_, weights_[0], y_));
  ASSERT_TRUE(Tune(shape, 0.0).ok());
  EXPECT_FALSE(tuning_->Run(shape, x_, weights_[0], y_));
  // An operand off the 256-byte alignment the candidates assume.
  ASSERT_TRUE(Tune(shape, 1e9).ok());
  EXPECT_FALSE(tuning_->Run(shape, x_ + 8, weights_[0], y_));
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
}

TEST_F(GemmTuningTest, RefusesAnEmptyShape) {
  EXPECT_EQ(Tune({0, kIn, kOut}, 1e9).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tuning_->Tune({kRows, kIn, kOut}, {}, x_, y_, [](const __nv_bfloat16*) {}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace duet::cuda

// Programmatic dependent launch: a decode-like chain of kernels, each reading what the previous
// one wrote, gives bit-for-bit the results of fully serialized launches, on a stream and replayed
// from a CUDA graph. A kernel that reads its input before waiting, or writes before the previous
// kernel is done with a buffer, shows up here as a difference.
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/elementwise/norm.h"
#include "kernels/gemm/gemv.h"
#include "kernels/graph_test_util.h"
#include "kernels/kernel_test_util.h"
#include "kernels/launch.h"

namespace duet::kernels {
namespace {


constexpr int kHidden = 1024, kInter = 2816, kLayers = 6;

struct Chain {
  static constexpr int kRows = 2;  // buffers hold up to this many rows
  int rows = 1;
  DeviceBuffer<float> residual{size_t(kRows) * kHidden};
  DeviceBuffer<__nv_bfloat16> normed{size_t(kRows) * kHidden}, act{size_t(kRows) * kInter},
      delta{size_t(kRows) * kHidden};
  DeviceBuffer<__nv_bfloat16> norm_weight{testing::ToBf16(testing::RandomFloats(kHidden, 1, 0.5f, 1.5f))};
  DeviceBuffer<__nv_bfloat16> gate_up{testing::ToBf16(testing::RandomFloats(size_t(2) * kInter * kHidden, 2, -0.05f, 0.05f))};
  DeviceBuffer<__nv_bfloat16> down{testing::ToBf16(testing::RandomFloats(size_t(kHidden) * kInter, 3, -0.05f, 0.05f))};
  const std::vector<float> initial = testing::RandomFloats(size_t(kRows) * kHidden, 4);

  // Per layer: residual += delta and normalize; silu(gate) * up; down projection into delta.
  void Enqueue(cudaStream_t stream) {
    for (int layer = 0; layer < kLayers; ++layer) {
      FusedAddRmsNorm({residual.get(), layer == 0 ? nullptr : delta.get(), norm_weight.get(), nullptr, normed.get(),
                       rows, kHidden, 1e-5f},
                      stream);
      Gemv({normed.get(), gate_up.get(), act.get(), rows, kHidden, 2 * kInter, false, GemvEpilogue::kSiluMul}, stream);
      Gemv({act.get(), down.get(), delta.get(), rows, kInter, kHidden, false}, stream);
    }
    FusedAddRmsNorm({residual.get(), delta.get(), norm_weight.get(), nullptr, normed.get(), rows, kHidden, 1e-5f},
                    stream);
  }
  void Reset() {
    residual.Upload(initial);
    normed.Poison();
    act.Poison();
    delta.Poison();
  }
  // The residual and normalized rows the chain wrote (the buffers' rows past `rows` stay unwritten).
  std::vector<float> Result() const {
    const size_t used = size_t(rows) * kHidden;
    std::vector<float> out = residual.Download();
    out.resize(used);
    const std::vector<float> n = testing::ToFloat(normed.Download());
    out.insert(out.end(), n.begin(), n.begin() + used);
    return out;
  }
};

std::vector<float> RunOnStream(Chain& chain, bool programmatic) {
  SetProgrammaticLaunch(programmatic);
  cudaStream_t stream;
  DUET_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  chain.Reset();
  chain.Enqueue(stream);
  DUET_CUDA_CHECK(cudaStreamSynchronize(stream));
  DUET_CUDA_CHECK(cudaStreamDestroy(stream));
  SetProgrammaticLaunch(true);
  return chain.Result();
}

std::vector<float> RunFromGraph(Chain& chain, bool programmatic) {
  SetProgrammaticLaunch(programmatic);
  testing::CaptureAndReplay([&](cudaStream_t stream) { chain.Enqueue(stream); }, [&] { chain.Reset(); });
  SetProgrammaticLaunch(true);
  return chain.Result();
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(ProgrammaticLaunch, DecodeChainMatchesSerializedLaunches) {
  DUET_SKIP_WITHOUT_GPU();
  for (int rows : {1, 2}) {
    Chain chain;
    chain.rows = rows;
    const std::vector<float> serialized = RunOnStream(chain, false);
    for (float v : serialized) ASSERT_TRUE(std::isfinite(v)) << "rows " << rows;
    for (int repeat = 0; repeat < 3; ++repeat) {
      EXPECT_TRUE(BitEqual(RunOnStream(chain, true), serialized)) << "stream, rows " << rows;
      EXPECT_TRUE(BitEqual(RunFromGraph(chain, true), serialized)) << "graph, rows " << rows;
    }
    EXPECT_TRUE(BitEqual(RunFromGraph(chain, false), serialized)) << "graph without PDL, rows " << rows;
  }
}

}  // namespace
}  // namespace duet::kernels

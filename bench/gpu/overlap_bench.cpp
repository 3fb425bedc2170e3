// Can the memory-bound decode attention run beside a compute-bound projection on one GPU? A mixed
// step runs them one after the other: the paged decode attention of 64 rows at 576 tokens of
// context is ~15% of the step and draws little power, the products draw the card's power cap
// (docs/BENCHMARKS.md). Splitting a step into two nano-batches would let one's attention run
// beside the other's products; this measures the best case of that, before any engine change.
//
//   overlap_bench [--rows 320] [--batch 64] [--context 576] [--ms 300] [--reserve 0,16,32,48]
//
// Per pair: the gate_up product ([rows, 4096] · [28672, 4096]^T, bf16, weights rotating over
// copies larger than L2) and the decode attention (Llama-3-8B heads, random block tables), each
// pair launched back to back for --ms (long enough to meet the power cap) and timed over its
// second half. Alone: each by itself; one after the other on one stream (today's order); side by
// side: the two on two streams in lockstep (pair i's product and attention both wait for pair
// i - 1's), the product's cuBLASLt heuristic told to leave `reserve` SMs free
// (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <vector>

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "CLI/CLI.hpp"
#include "backends/cuda/lt_product.h"
#include "kernels/attention/decode_attention_bench_util.h"
#include "kernels/cuda_check.h"
#include "kernels/elementwise/random_fill.h"

namespace duet {
namespace {

constexpr int kHidden = 4096, kGateUp = 2 * 14336;
constexpr int kQHeads = 32, kKvHeads = 8, kHeadDim = 128, kBlockSize = 16;

void CheckLt(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "%s: cuBLAS status %d\n", what, int(s));
    std::exit(1);
  }
}

// y[rows, out] = x[rows, in] · W[out, in]^T through cuBLASLt, its heuristic's first choice for
// `sm_count` SMs (0: the whole device).
class Product {
 public:
  Product(cublasLtHandle_t lt, int rows, int in, int out, int sm_count, void* workspace, size_t workspace_bytes)
      : workspace_(workspace) {
    absl::StatusOr<std::unique_ptr<cuda::LtProduct>> made =
        cuda::LtProduct::Create(lt, rows, in, out, workspace_bytes, sm_count);
    std::vector<cublasLtMatmulAlgo_t> algos;
    if (made.ok()) algos = (*made)->Candidates(1);
    if (algos.empty()) {
      std::fprintf(stderr, "no cuBLASLt algorithm for %d x %d x %d\n", rows, in, out);
      std::exit(1);
    }
    product_ = *std::move(made);
    algo_ = algos.front();
  }
  void Run(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, cudaStream_t stream) const {
    CheckLt(product_->Launch(algo_, x, w, y, workspace_, stream), "matmul");
  }

 private:
  void* workspace_;
  std::unique_ptr<cuda::LtProduct> product_;
  cublasLtMatmulAlgo_t algo_{};
};

// Microseconds per pair over the second half of `ms` of pairs launched back to back;
// `enqueue(i)` puts pair i on the streams and leaves `main` (the first stream) after all of it.
double UsPerPair(double ms, cudaStream_t main, const std::function<void(int)>& enqueue) {
  cudaEvent_t start, stop;
  DUET_CUDA_CHECK(cudaEventCreate(&start));
  DUET_CUDA_CHECK(cudaEventCreate(&stop));
  auto time_pairs = [&](int first, int n) {
    DUET_CUDA_CHECK(cudaEventRecord(start, main));
    for (int i = first; i < first + n; ++i) enqueue(i);
    DUET_CUDA_CHECK(cudaEventRecord(stop, main));
    DUET_CUDA_CHECK(cudaEventSynchronize(stop));
    float elapsed = 0;
    DUET_CUDA_CHECK(cudaEventElapsedTime(&elapsed, start, stop));
    return double(elapsed) * 1e3 / n;
  };
  const double one_us = time_pairs(0, 8);
  const int half = std::max(8, int(ms * 500.0 / one_us));
  time_pairs(8, half);
  const double us = time_pairs(8 + half, half);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return us;
}

int Run(int argc, char** argv) {
  CLI::App app{"decode attention beside a projection: one after the other vs side by side"};
  int rows = 320, batch = 64, context = 576;
  double ms = 300;
  std::vector<int> reserves = {0, 16, 32, 48};
  app.add_option("--rows", rows, "rows of the gate_up product")->check(CLI::Range(1, 8192));
  app.add_option("--batch", batch, "decode sequences")->check(CLI::Range(1, 1024));
  app.add_option("--context", context, "tokens of context per sequence")->check(CLI::Range(1, 131072));
  app.add_option("--ms", ms, "milliseconds of pairs per figure")->check(CLI::Range(10.0, 5000.0));
  app.add_option("--reserve", reserves, "SMs the product leaves free, one figure each")->delimiter(',');
  CLI11_PARSE(app, argc, argv);

  int device = 0, num_sms = 0;
  DUET_CUDA_CHECK(cudaGetDevice(&device));
  DUET_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  cudaStream_t s1, s2;
  DUET_CUDA_CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  DUET_CUDA_CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));

  // The product's operands: weights rotating over copies larger than L2.
  const size_t weight_elems = size_t(kGateUp) * kHidden;
  const int copies = int((size_t(256) << 20) / (weight_elems * 2) + 2);
  std::vector<__nv_bfloat16*> weights(size_t(copies), nullptr);
  for (size_t i = 0; i < weights.size(); ++i) {
    DUET_CUDA_CHECK(cudaMalloc(&weights[i], weight_elems * 2));
    kernels::FillRandomBf16(weights[i], weight_elems, uint64_t(i + 1), 0.025f, nullptr);
  }
  __nv_bfloat16 *x, *y;
  DUET_CUDA_CHECK(cudaMalloc(&x, size_t(rows) * kHidden * 2));
  DUET_CUDA_CHECK(cudaMalloc(&y, size_t(rows) * kGateUp * 2));
  kernels::FillRandomBf16(x, size_t(rows) * kHidden, 99, 1.f, nullptr);
  const size_t workspace_bytes = size_t(32) << 20;
  void* workspace;
  DUET_CUDA_CHECK(cudaMalloc(&workspace, workspace_bytes));
  cublasLtHandle_t lt;
  CheckLt(cublasLtCreate(&lt), "cublasLtCreate");

  // The decode attention's cache: each sequence on random blocks.
  kernels::bench::RandomPagedDecode decode(batch, context, kQHeads, kKvHeads, kHeadDim, kBlockSize);
  decode.Prepare(batch, context, context, num_sms);
  DUET_CUDA_CHECK(cudaDeviceSynchronize());

  auto attend = [&](cudaStream_t s) { decode.Launch(s); };
  const Product full(lt, rows, kHidden, kGateUp, 0, workspace, workspace_bytes);
  auto multiply = [&](const Product& product, int i, cudaStream_t s) {
    product.Run(x, weights[size_t(i % copies)], y, s);
  };
  const double product_alone = UsPerPair(ms, s1, [&](int i) { multiply(full, i, s1); });
  const double attention_alone = UsPerPair(ms, s1, [&](int) { attend(s1); });
  const double in_turn = UsPerPair(ms, s1, [&](int i) {
    multiply(full, i, s1);
    attend(s1);
  });
  const double kv_mb = decode.KvBytes() / 1e6;
  std::printf("%d SMs; gate_up %d x %d x %d (%.1f TFLOP/s alone); decode attention %d x %d (%.0f MB of KV, %.0f GB/s "
              "alone); %.0f ms per figure\n",
              num_sms, rows, kHidden, kGateUp, 2.0 * rows * kHidden * kGateUp / product_alone * 1e-6, batch, context,
              kv_mb, kv_mb / attention_alone * 1e3, ms);
  std::printf("%-34s %10.1f us\n", "product alone", product_alone);
  std::printf("%-34s %10.1f us\n", "attention alone", attention_alone);
  std::printf("%-34s %10.1f us\n", "one after the other (one stream)", in_turn);

  cudaEvent_t done1, done2;
  DUET_CUDA_CHECK(cudaEventCreateWithFlags(&done1, cudaEventDisableTiming));
  DUET_CUDA_CHECK(cudaEventCreateWithFlags(&done2, cudaEventDisableTiming));
  for (int reserve : reserves) {
    const Product product(lt, rows, kHidden, kGateUp, reserve > 0 ? num_sms - reserve : 0, workspace,
                          workspace_bytes);
    const double product_reserved = UsPerPair(ms, s1, [&](int i) { multiply(product, i, s1); });
    const double side_by_side = UsPerPair(ms, s1, [&](int i) {
      // Pair i starts once both halves of pair i - 1 are done.
      DUET_CUDA_CHECK(cudaStreamWaitEvent(s2, done1));
      multiply(product, i, s1);
      attend(s2);
      DUET_CUDA_CHECK(cudaEventRecord(done2, s2));
      DUET_CUDA_CHECK(cudaStreamWaitEvent(s1, done2));
      DUET_CUDA_CHECK(cudaEventRecord(done1, s1));
    });
    std::printf("side by side, product leaves %3d SMs %10.1f us  (%.3fx one after the other; product alone on %d "
                "SMs %.1f us)\n",
                reserve, side_by_side, side_by_side / in_turn, num_sms - reserve, product_reserved);
  }
  return 0;
}

}  // namespace
}  // namespace duet

int main(int argc, char** argv) { return duet::Run(argc, argv); }

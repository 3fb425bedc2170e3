// Gemv vs cuBLAS at the Llama-3-8B decode shapes: time and weight-read bandwidth next to the
// device copy bandwidth (read + write) measured in the same run.
#include <algorithm>
#include <cstdio>
#include <vector>

#include <cublas_v2.h>

#include "kernels/cuda_check.h"
#include "kernels/gemm/gemv.h"

namespace {

template <typename F>
float MedianMs(F&& launch) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> ms;
  for (int i = 0; i < 30; ++i) {
    cudaEventRecord(a);
    launch();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    if (i >= 5) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main() {
  const size_t copy_bytes = size_t(1) << 30;
  void *src, *dst;
  DUET_CUDA_CHECK(cudaMalloc(&src, copy_bytes));
  DUET_CUDA_CHECK(cudaMalloc(&dst, copy_bytes));
  const float copy_ms = MedianMs([&] { cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice); });
  std::printf("device copy %.0f GB/s (read + write)\n", 2.0 * copy_bytes / copy_ms / 1e6);
  cudaFree(src);
  cudaFree(dst);

  cublasHandle_t handle;
  cublasCreate(&handle);
  struct Shape { const char* name; int in, out; };
  const Shape shapes[] = {{"qkv", 4096, 6144}, {"o", 4096, 4096}, {"gate_up", 4096, 28672}, {"down", 14336, 4096},
                          {"lm_head", 4096, 128256}};
  std::printf("%-8s %5s %10s %10s %10s %10s\n", "shape", "rows", "gemv_us", "GB/s", "cublas_us", "GB/s");
  for (const Shape& s : shapes) {
    // Several weight copies, rotated, so each launch reads from HBM rather than L2.
    const int copies = 8;
    const size_t wbytes = size_t(s.in) * s.out * 2;
    std::vector<void*> w(copies);
    for (void*& p : w) {
      DUET_CUDA_CHECK(cudaMalloc(&p, wbytes));
      cudaMemset(p, 0x11, wbytes);
    }
    void *x, *y;
    DUET_CUDA_CHECK(cudaMalloc(&x, size_t(8) * s.in * 2));
    DUET_CUDA_CHECK(cudaMalloc(&y, size_t(8) * s.out * 4));
    cudaMemset(x, 0x11, size_t(8) * s.in * 2);
    for (int rows : {1, 2, 4}) {
      int i = 0;
      const float gemv_ms = MedianMs([&] {
        duet::kernels::Gemv({static_cast<const __nv_bfloat16*>(x), static_cast<const __nv_bfloat16*>(w[i++ % copies]), y,
                             rows, s.in, s.out, false},
                            nullptr);
      });
      const float alpha = 1, beta = 0;
      const float cublas_ms = MedianMs([&] {
        cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, s.out, rows, s.in, &alpha, w[i++ % copies], CUDA_R_16BF, s.in, x,
                     CUDA_R_16BF, s.in, &beta, y, CUDA_R_16BF, s.out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      });
      std::printf("%-8s %5d %10.1f %10.0f %10.1f %10.0f\n", s.name, rows, gemv_ms * 1e3, wbytes / gemv_ms / 1e6,
                  cublas_ms * 1e3, wbytes / cublas_ms / 1e6);
    }
    for (void* p : w) cudaFree(p);
    cudaFree(x);
    cudaFree(y);
  }
  cublasDestroy(handle);
  return 0;
}

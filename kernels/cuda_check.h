// Invariant checks around CUDA runtime calls. A failing CUDA call inside a kernel launcher is a
// bug or a dead device, never bad user input: report where and abort.
#pragma once

#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#define DUET_CUDA_CHECK(expr)                                                                 \
  do {                                                                                        \
    cudaError_t duet_cuda_err_ = (expr);                                                      \
    if (duet_cuda_err_ != cudaSuccess) {                                                      \
      std::fprintf(stderr, "%s:%d: CUDA error %s: %s (%s)\n", __FILE__, __LINE__,            \
                   cudaGetErrorName(duet_cuda_err_), cudaGetErrorString(duet_cuda_err_), #expr); \
      std::abort();                                                                           \
    }                                                                                         \
  } while (0)

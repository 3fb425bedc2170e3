// Invariant checks of kernel launchers: their arguments, and the CUDA runtime calls they make.
// A failure is a bug or a dead device, never bad user input: report where and abort.
#pragma once

#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

// Launcher argument checks: a violated one is a caller bug, so report where and abort.
#define DUET_KERNEL_CHECK(cond)                                                        \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);   \
      std::abort();                                                                    \
    }                                                                                  \
  } while (0)

#define DUET_CUDA_CHECK(expr)                                                                 \
  do {                                                                                        \
    cudaError_t duet_cuda_err_ = (expr);                                                      \
    if (duet_cuda_err_ != cudaSuccess) {                                                      \
      std::fprintf(stderr, "%s:%d: CUDA error %s: %s (%s)\n", __FILE__, __LINE__,            \
                   cudaGetErrorName(duet_cuda_err_), cudaGetErrorString(duet_cuda_err_), #expr); \
      std::abort();                                                                           \
    }                                                                                         \
  } while (0)

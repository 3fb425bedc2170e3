// CUDA graph capture check for kernel tests: a launcher must be capturable (no synchronization,
// no allocation) and its replay must redo the same work.
#pragma once

#include <functional>

#include <cuda_runtime.h>

#include "kernels/cuda_check.h"

namespace duet::kernels::testing {

// Captures launch(stream) on a fresh non-blocking stream (global capture mode, the strictest),
// then runs before_replay() (e.g. re-poison outputs), replays the graph once and waits for it.
// The replay does not wait for the legacy default stream: what before_replay() changes must have
// landed when it returns (DeviceBuffer's Upload and Poison have).
inline void CaptureAndReplay(const std::function<void(cudaStream_t)>& launch, const std::function<void()>& before_replay) {
  cudaStream_t stream;
  DUET_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  DUET_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  launch(stream);
  DUET_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  DUET_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  before_replay();
  DUET_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  DUET_CUDA_CHECK(cudaStreamSynchronize(stream));
  DUET_CUDA_CHECK(cudaGraphExecDestroy(exec));
  DUET_CUDA_CHECK(cudaGraphDestroy(graph));
  DUET_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace duet::kernels::testing

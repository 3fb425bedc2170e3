// The sampled tokens of steps launched ahead (async scheduling, engine/model_executor.h's
// LaunchSample / CollectSamples): each step's tokens and logprobs are copied to pinned host memory
// at the end of the step, an event behind them, and collected in launch order. Two slots, so the
// copy of a step launched while the host still reads the one before cannot overwrite it. Each
// step also marks its midpoint, where late scheduling plans the step after it (engine/llm_engine.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <deque>
#include <vector>

#include "absl/status/status.h"
#include "backends/cuda/device_memory.h"
#include "engine/model_executor.h"

namespace duet::cuda {

class LaunchedSamples {
 public:
  static constexpr int kMaxLaunched = 2;

  LaunchedSamples() = default;
  ~LaunchedSamples();
  LaunchedSamples(const LaunchedSamples&) = delete;
  LaunchedSamples& operator=(const LaunchedSamples&) = delete;

  // Room for steps of up to `max_rows` sampled rows.
  absl::Status Init(int max_rows);
  bool empty() const { return launched_.empty(); }
  bool full() const { return launched_.size() == size_t(kMaxLaunched); }
  // Enqueues on `stream` the copy of a step's `rows` samples (device tokens and logprobs). Not full.
  absl::Status Enqueue(const int32_t* tokens, const float* logprobs, int rows, cudaStream_t stream);
  // Waits for the oldest enqueued step's copy and gives its samples. FailedPrecondition when empty.
  absl::Status Collect(std::vector<DeviceSample>& samples);

  // Records the midpoint event at this point of `stream`: the middle of the step being enqueued
  // (or captured: a graph replays the record each launch). Aborts on a CUDA error, as a launch does.
  void MarkMidpoint(cudaStream_t stream);
  // Waits until the device has passed the last marked midpoint; at once when nothing is enqueued.
  // A CUDA error is left to Collect to report.
  void WaitForMidpoint();
  // Whether the oldest enqueued step's copy has completed (false when none is enqueued).
  bool OldestDone() const;

 private:
  struct Launched {
    int slot = 0;
    int rows = 0;
  };
  // A slot's tokens; its logprobs follow them, max_rows_ on.
  int32_t* SlotTokens(int slot) { return host_.as<int32_t>() + size_t(slot) * 2 * size_t(max_rows_); }

  int max_rows_ = 0;
  PinnedBuffer host_;  // kMaxLaunched slots of [max_rows] tokens then [max_rows] logprobs
  cudaEvent_t copied_[kMaxLaunched] = {};
  cudaEvent_t midpoint_ = nullptr;
  std::deque<Launched> launched_;
  int next_slot_ = 0;
};

}  // namespace duet::cuda

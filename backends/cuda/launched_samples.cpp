#include "backends/cuda/launched_samples.h"

#include "common/check.h"
#include "common/status_macros.h"
#include "kernels/cuda_check.h"

namespace duet::cuda {

LaunchedSamples::~LaunchedSamples() {
  for (cudaEvent_t e : copied_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  if (midpoint_ != nullptr) cudaEventDestroy(midpoint_);
}

absl::Status LaunchedSamples::Init(int max_rows) {
  DUET_CHECK(max_rows > 0);
  max_rows_ = max_rows;
  DUET_RETURN_IF_ERROR(host_.Resize(size_t(kMaxLaunched) * 2 * size_t(max_rows) * 4));
  for (cudaEvent_t& e : copied_) {
    if (e == nullptr) DUET_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "event"));
  }
  if (midpoint_ == nullptr) {
    DUET_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&midpoint_, cudaEventDisableTiming), "event"));
  }
  return absl::OkStatus();
}

absl::Status LaunchedSamples::Enqueue(const int32_t* tokens, const float* logprobs, int rows, cudaStream_t stream) {
  DUET_CHECK(!full() && rows >= 0 && rows <= max_rows_);
  const int slot = next_slot_;
  next_slot_ = (next_slot_ + 1) % kMaxLaunched;
  int32_t* host_tokens = SlotTokens(slot);
  auto* host_logprobs = reinterpret_cast<float*>(host_tokens + max_rows_);
  if (rows > 0) {
    DUET_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(host_tokens, tokens, size_t(rows) * 4, cudaMemcpyDeviceToHost, stream), "sampled tokens"));
    DUET_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(host_logprobs, logprobs, size_t(rows) * 4, cudaMemcpyDeviceToHost, stream), "logprobs"));
  }
  DUET_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(copied_[slot], stream), "event"));
  launched_.push_back({slot, rows});
  return absl::OkStatus();
}

absl::Status LaunchedSamples::Collect(std::vector<DeviceSample>& samples) {
  if (launched_.empty()) return absl::FailedPreconditionError("no launched step to collect");
  const Launched l = launched_.front();
  launched_.pop_front();
  DUET_RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(copied_[l.slot]), "step"));
  const int32_t* host_tokens = SlotTokens(l.slot);
  const auto* host_logprobs = reinterpret_cast<const float*>(host_tokens + max_rows_);
  samples.resize(size_t(l.rows));
  for (int i = 0; i < l.rows; ++i) samples[size_t(i)] = DeviceSample{host_tokens[i], host_logprobs[i]};
  return absl::OkStatus();
}

void LaunchedSamples::MarkMidpoint(cudaStream_t stream) {
  DUET_CHECK(midpoint_ != nullptr);
  // Under stream capture only "external" makes the record a graph node (a plain record there is a
  // capture-internal dependency); outside capture the flag is an error.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  DUET_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  DUET_CUDA_CHECK(cudaEventRecordWithFlags(
      midpoint_, stream, capture == cudaStreamCaptureStatusActive ? cudaEventRecordExternal : cudaEventRecordDefault));
}

void LaunchedSamples::WaitForMidpoint() {
  if (!launched_.empty()) cudaEventSynchronize(midpoint_);
}

bool LaunchedSamples::OldestDone() const {
  return !launched_.empty() && cudaEventQuery(copied_[launched_.front().slot]) == cudaSuccess;
}

}  // namespace duet::cuda

#include "backends/cuda/graph_runner.h"

#include "backends/cuda/device_memory.h"
#include "common/status_macros.h"

namespace duet::cuda {

int GraphBatchSize(int num_seqs) {
  if (num_seqs <= 2) return num_seqs;
  if (num_seqs <= 4) return 4;
  return (num_seqs + 7) / 8 * 8;
}

int TreeGraphTokens(int num_tokens) {
  if (num_tokens <= 16) return (num_tokens + 7) / 8 * 8;
  int octave = 16;
  while (octave * 2 < num_tokens) octave *= 2;
  const int step = octave / 4;
  return (num_tokens + step - 1) / step * step;
}

void GraphRunner::Clear() {
  for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
  graphs_.clear();
}

absl::Status GraphRunner::Launch(const GraphKey& key, const KvCache& cache, const std::function<void()>& enqueue) {
  if (cache_ != &cache) {
    Clear();
    cache_ = &cache;
  }
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    enqueue();
    DUET_RETURN_IF_ERROR(CudaStatus(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "begin capture"));
    enqueue();
    cudaGraph_t graph = nullptr;
    DUET_RETURN_IF_ERROR(CudaStatus(cudaStreamEndCapture(stream_, &graph), "end capture"));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    DUET_RETURN_IF_ERROR(CudaStatus(err, "graph instantiate"));
    it = graphs_.emplace(key, exec).first;
    ++num_captures_;
  }
  return CudaStatus(cudaGraphLaunch(it->second, stream_), "graph launch");
}

}  // namespace duet::cuda

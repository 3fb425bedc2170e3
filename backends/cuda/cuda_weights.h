// A Llama-family checkpoint's weights resident on the device as bf16, read through
// model/safetensors' WeightStore: q/k/v stacked into one projection, gate/up into another, so each
// sublayer is one GEMM.
#pragma once

#include <vector>

#include <cuda_bf16.h>

#include "absl/status/statusor.h"
#include "backends/cuda/device_memory.h"
#include "model/model_config.h"
#include "model/safetensors.h"

namespace duet::cuda {

struct CudaLayerWeights {
  const __nv_bfloat16* input_norm;  // [hidden]
  const __nv_bfloat16* qkv;         // [(heads + 2 * kv_heads) * head_dim, hidden]
  const __nv_bfloat16* qkv_bias;    // [(heads + 2 * kv_heads) * head_dim] or null
  const __nv_bfloat16* o;           // [hidden, heads * head_dim]
  const __nv_bfloat16* o_bias;      // [hidden] or null
  const __nv_bfloat16* post_norm;   // [hidden]
  const __nv_bfloat16* gate_up;     // [2 * intermediate, hidden]: gate rows then up rows
  const __nv_bfloat16* down;        // [hidden, intermediate]
};

class CudaWeights {
 public:
  // Allocates from `arena` and uploads every tensor the config names (converted to bf16 where the
  // checkpoint holds another float type), checking shapes. Out of device memory:
  // ResourceExhausted naming the tensor, the bytes asked for and the bytes free.
  static absl::StatusOr<CudaWeights> Upload(const WeightStore& weights, const ModelConfig& config, DeviceArena& arena);

  const __nv_bfloat16* embed() const { return embed_; }            // [vocab, hidden]
  const __nv_bfloat16* final_norm() const { return final_norm_; }  // [hidden]
  const __nv_bfloat16* lm_head() const { return lm_head_; }        // [vocab, hidden] (the embedding when tied)
  const CudaLayerWeights& layer(size_t i) const { return layers_[i]; }
  size_t num_layers() const { return layers_.size(); }
  int64_t bytes() const { return bytes_; }  // every weight byte on the device

 private:
  class Uploader;

  std::vector<DeviceAllocation> allocations_;
  int64_t bytes_ = 0;
  const __nv_bfloat16* embed_ = nullptr;
  const __nv_bfloat16* final_norm_ = nullptr;
  const __nv_bfloat16* lm_head_ = nullptr;
  std::vector<CudaLayerWeights> layers_;
};

}  // namespace duet::cuda

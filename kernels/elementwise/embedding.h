// Token embedding lookup into the fp32 residual stream.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace duet::kernels {

// residual[r, :] = float(table[tokens[r], :]); table bf16 [vocab, dim], residual fp32 [rows, dim].
// Every token must be in [0, vocab) (the caller validates ids). dim must be a multiple of 8;
// table and residual 16-byte aligned.
void EmbeddingGather(const int32_t* tokens, const __nv_bfloat16* table, float* residual, int rows, int dim,
                     cudaStream_t);

}  // namespace duet::kernels

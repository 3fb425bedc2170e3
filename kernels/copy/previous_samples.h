// Async scheduling: a step launched before the previous step's sampled tokens reach the host
// carries, for each such token, a placeholder id -1 - row (engine/model_executor.h's
// PreviousStepSample), where `row` is the token's logits row in the previous step. This kernel
// puts the tokens in, on the device, before the step's embedding reads them.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace duet::kernels {

// tokens: [num_tokens] int32 token ids on the device, in place: every negative id t becomes
// samples[-1 - t]; the others stay. samples: the previous step's sampled token ids (device).
// Stream-ordered after what wrote both; a dependent launch (kernels/launch.cuh).
void ResolvePreviousStepSamples(int32_t* tokens, int num_tokens, const int32_t* samples, cudaStream_t stream);

}  // namespace duet::kernels

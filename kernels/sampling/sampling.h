// Per-row token sampling from fp32 logits: greedy, temperature, min-p, top-k, top-p, seeded.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace duet::kernels {

// Per-row sampling from fp32 logits [rows, vocab]. Row r: temperature[r] <= 0 means greedy
// (argmax, lowest index on ties). Otherwise probs = softmax(logits / temperature), then keep
// top_k (<= 0: off), min_p (relative to the max prob; 0: off), top_p (nucleus; 1: off) in vLLM's
// order (min_p, then top_k, then top_p over the renormalized survivors), renormalize and draw one
// token with Philox keyed by (seeds[r], offsets[r]): a (seed, offset) pair always gives the same token.
// logprobs_out[r] = log-softmax of the raw logits (temperature 1) at the chosen token.
//
// Arrays are [rows]. temperature == nullptr: every row greedy. top_k / top_p / min_p == nullptr:
// that filter off for every row. seeds / offsets == nullptr: 0. logprobs_out may be null.
//
// Ties: the survivors of top_k and top_p are taken in (probability descending, token id
// ascending) order, as in the CPU engine's sampler; on rows whose candidate set exceeds
// 16384 tokens (flat distributions with a large top_k or top_p) the filters become thresholds
// and every token tied with the boundary is kept (as vLLM does).
// Grammar masks: when bitmask_index is not null and bitmask_index[r] = m >= 0, row r is drawn
// (or its argmax taken) among the tokens t whose bit (t % 32) of token_bitmask[m * bitmask_words
// + t / 32] is set only, as if every other logit were -infinity (a mask that allows nothing gives token 0).
// bitmask_index[r] < 0 or bitmask_index == nullptr: no mask. The logprob stays the raw one.
// Graph-capturable; the first call on each device also sets a kernel attribute (a CUDA API call
// outside the stream), so make one call before capturing, as a warm-up step does.
struct SamplingParams {
  const float* logits;
  int rows;
  int vocab;
  const float* temperature;
  const int32_t* top_k;
  const float* top_p;
  const float* min_p;
  const uint64_t* seeds;
  const uint64_t* offsets;
  int32_t* tokens_out;
  float* logprobs_out;
  const uint32_t* token_bitmask = nullptr;  // [masks, bitmask_words]
  const int32_t* bitmask_index = nullptr;   // [rows]
  int bitmask_words = 0;                    // >= ceil(vocab / 32) when masks are given
};
void SampleTokens(const SamplingParams&, cudaStream_t);

}  // namespace duet::kernels

// A mixed step's attention in one launch: the paged decode attention of the sequences that decode
// one token (paged_attention.h) and the prefill attention of the prompt chunks beside them
// (prefill_attention.h), each CTA running one or the other kernel's work.
//
// Why: beside 64 decode rows, a 256-token prompt chunk's attention is 128 CTAs of latency-bound
// work (a few per SM) and the decode attention is bandwidth-bound. Launched one after the other,
// the GPU runs the prompt's CTAs mostly idle; in one grid they run while the decode CTAs stream
// the cache. The outputs are the two kernels' own, bit for bit: the same per-CTA code runs.
#pragma once

#include <cuda_runtime.h>

#include "kernels/attention/paged_attention.h"
#include "kernels/attention/prefill_attention.h"

namespace duet::kernels {

// `decode` and `prefill` as the two kernels take them (both on the same layer's cache, the same
// head_dim, their own q rows and outputs); `prefill` without the attention-state outputs (those
// are ring attention's). Enqueued with programmatic dependent launch on `stream`. Aborts on
// arguments either kernel refuses. Either part may be empty (num_seqs 0).
void MixedAttention(const PagedDecodeAttentionParams& decode, const PagedDecodeAttentionPlan& plan,
                    const PrefillAttentionParams& prefill, cudaStream_t stream);

}  // namespace duet::kernels

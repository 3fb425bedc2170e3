// One query head's attention over its context on the CPU: out = softmax(scale · q·Kᵀ) · V.
//
// The context comes as runs of consecutive cache slots (a paged cache's slots are consecutive
// within a block; a draft-tree token's ancestors are single slots), each slot `head_dim` floats
// after the previous one, keys and values alike ([num_blocks, num_kv_heads, block_size,
// head_dim] pools: one (block, kv head) is a run).
//
// Every score and every output element is the same float32 computation in the same order
// whatever the runs are and whichever thread computes it, so a token's attention does not depend
// on how its context is split into runs, on the other tokens of its step, or on the threads.
#pragma once

#include <cstdint>

#include "absl/types/span.h"

namespace duet {

// Consecutive slots of the context: `count` keys from `keys`, the same slots' values from
// `values`, each slot head_dim floats apart.
struct KvRun {
  const float* keys = nullptr;
  const float* values = nullptr;
  int64_t count = 0;
};

// q: [head_dim]; out: [head_dim]; scores: room for the context's length (scratch). The context
// (the sum of the runs' counts) is at least one slot.
void AttendHead(const float* q, absl::Span<const KvRun> context, int64_t head_dim, float scale, float* scores,
                float* out);

// The portable code alone: the reference the AVX2 path is tested against, and the fallback for
// CPUs without AVX2/FMA or a head_dim that is not a multiple of 8.
void AttendHeadPortable(const float* q, absl::Span<const KvRun> context, int64_t head_dim, float scale,
                        float* scores, float* out);

// Whether AttendHead takes the AVX2/FMA path for this head_dim on this CPU.
bool AttendHeadUsesAvx2(int64_t head_dim);

}  // namespace duet

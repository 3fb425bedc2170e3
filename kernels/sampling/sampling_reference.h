// Plain CPU reference for SampleTokens: the exact distribution each row is drawn from, in double.
#pragma once

#include <cstdint>
#include <vector>

namespace duet::kernels::reference {

// First index of the largest logit.
int32_t Argmax(const float* logits, int vocab);

// log softmax(logits)[token] at temperature 1.
double LogSoftmax(const float* logits, int vocab, int32_t token);

// The distribution SampleTokens draws from at temperature > 0: p = softmax(logits / temperature);
// keep tokens with p >= min_p * max(p); of those the top_k (<= 0 or >= vocab: all) in
// (logit descending, token id ascending) order; of those the shortest prefix whose mass reaches
// top_p of theirs (top_p >= 1: all); renormalize. Returns [vocab] probabilities (0 for dropped tokens).
std::vector<double> FilteredDistribution(const float* logits, int vocab, float temperature, int top_k, float top_p,
                                         float min_p);

}  // namespace duet::kernels::reference

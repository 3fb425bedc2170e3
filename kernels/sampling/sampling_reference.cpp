#include "kernels/sampling/sampling_reference.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace duet::kernels::reference {

int32_t Argmax(const float* logits, int vocab) {
  int32_t best = 0;
  for (int32_t i = 1; i < vocab; ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return best;
}

double LogSoftmax(const float* logits, int vocab, int32_t token) {
  const double max_logit = *std::max_element(logits, logits + vocab);
  double sum = 0;
  for (int i = 0; i < vocab; ++i) sum += std::exp(double(logits[i]) - max_logit);
  return double(logits[token]) - max_logit - std::log(sum);
}

std::vector<double> FilteredDistribution(const float* logits, int vocab, float temperature, int top_k, float top_p,
                                         float min_p) {
  const double max_logit = *std::max_element(logits, logits + vocab);
  // Weights relative to the max token: w = p / max(p).
  std::vector<double> weight(vocab);
  for (int i = 0; i < vocab; ++i) weight[i] = std::exp((double(logits[i]) - max_logit) / temperature);

  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });

  std::vector<int32_t> kept;
  for (int32_t t : order) {
    if (weight[t] >= min_p) kept.push_back(t);
  }
  if (top_k > 0 && size_t(top_k) < kept.size()) kept.resize(size_t(top_k));
  if (top_p < 1.f) {
    double total = 0;
    for (int32_t t : kept) total += weight[t];
    double cumulative = 0;
    size_t n = 0;
    while (n < kept.size()) {
      cumulative += weight[kept[n++]];
      if (cumulative >= double(top_p) * total) break;
    }
    kept.resize(n);
  }
  double kept_total = 0;
  for (int32_t t : kept) kept_total += weight[t];
  std::vector<double> probs(vocab, 0.0);
  for (int32_t t : kept) probs[t] = weight[t] / kept_total;
  return probs;
}

}  // namespace duet::kernels::reference

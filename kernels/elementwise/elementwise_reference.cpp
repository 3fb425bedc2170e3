#include "kernels/elementwise/elementwise_reference.h"

#include <cmath>

#include <cuda_bf16.h>

namespace duet::kernels::reference {
namespace {

float RoundBf16(double x) { return __bfloat162float(__float2bfloat16(float(x))); }

}  // namespace

std::vector<float> FusedAddRmsNorm(std::vector<float>& residual, const std::vector<float>* delta,
                                   const std::vector<float>& weight, const std::vector<int32_t>* row_index,
                                   int rows, int dim, float eps) {
  std::vector<float> out(size_t(rows) * dim);
  for (int i = 0; i < rows; ++i) {
    const size_t src = size_t(row_index != nullptr ? (*row_index)[i] : i) * dim;
    if (delta != nullptr) {
      for (int j = 0; j < dim; ++j) residual[src + j] += (*delta)[size_t(i) * dim + j];
    }
    double sum_squares = 0;
    for (int j = 0; j < dim; ++j) sum_squares += double(residual[src + j]) * residual[src + j];
    const double inv_rms = 1.0 / std::sqrt(sum_squares / dim + eps);
    for (int j = 0; j < dim; ++j) {
      out[size_t(i) * dim + j] = float(double(RoundBf16(residual[src + j] * inv_rms)) * weight[j]);
    }
  }
  return out;
}

std::vector<float> RotateHalf(const float* x, int head_dim, int position, const std::vector<float>& inv_freq) {
  const int half = head_dim / 2;
  std::vector<float> out(head_dim);
  for (int i = 0; i < half; ++i) {
    const float angle = float(position) * inv_freq[i];
    const double c = std::cos(double(angle)), s = std::sin(double(angle));
    out[i] = float(x[i] * c - x[i + half] * s);
    out[i + half] = float(x[i + half] * c + x[i] * s);
  }
  return out;
}

std::vector<float> RopeAndWriteKv(const std::vector<float>& qkv, const std::vector<int32_t>& positions,
                                  const std::vector<int32_t>& slot_mapping, const std::vector<float>& inv_freq,
                                  int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                                  std::vector<float>& k_cache, std::vector<float>& v_cache) {
  const int num_tokens = int(positions.size());
  const size_t token_stride = size_t(num_q_heads + 2 * num_kv_heads) * head_dim;
  std::vector<float> q_out(size_t(num_tokens) * num_q_heads * head_dim);
  for (int t = 0; t < num_tokens; ++t) {
    const float* token_qkv = qkv.data() + t * token_stride;
    for (int h = 0; h < num_q_heads; ++h) {
      const std::vector<float> q = RotateHalf(token_qkv + size_t(h) * head_dim, head_dim, positions[t], inv_freq);
      for (int d = 0; d < head_dim; ++d) q_out[(size_t(t) * num_q_heads + h) * head_dim + d] = q[d];
    }
    const int slot = slot_mapping[t];
    if (slot < 0) continue;
    const int block = slot / block_size, in_block = slot % block_size;
    for (int h = 0; h < num_kv_heads; ++h) {
      const float* k = token_qkv + size_t(num_q_heads + h) * head_dim;
      const float* v = token_qkv + size_t(num_q_heads + num_kv_heads + h) * head_dim;
      const std::vector<float> k_rotated = RotateHalf(k, head_dim, positions[t], inv_freq);
      const size_t base = ((size_t(block) * num_kv_heads + h) * block_size + in_block) * head_dim;
      for (int d = 0; d < head_dim; ++d) {
        k_cache[base + d] = k_rotated[d];
        v_cache[base + d] = v[d];
      }
    }
  }
  return q_out;
}

std::vector<float> SiluAndMul(const std::vector<float>& in, int rows, int inter) {
  std::vector<float> out(size_t(rows) * inter);
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < inter; ++i) {
      const double gate = in[size_t(r) * 2 * inter + i], up = in[size_t(r) * 2 * inter + inter + i];
      out[size_t(r) * inter + i] = float(gate / (1.0 + std::exp(-gate)) * up);
    }
  }
  return out;
}

std::vector<float> EmbeddingGather(const std::vector<int32_t>& tokens, const std::vector<float>& table, int dim) {
  std::vector<float> out(tokens.size() * dim);
  for (size_t r = 0; r < tokens.size(); ++r) {
    for (int d = 0; d < dim; ++d) out[r * dim + d] = table[size_t(tokens[r]) * dim + d];
  }
  return out;
}

}  // namespace duet::kernels::reference

// Plain CPU references for the elementwise kernels (norm, rope, activation, embedding), written
// for obviousness, in double precision. Inputs are floats holding exactly what the kernel reads
// (bf16 tensors already rounded through bf16); outputs are unrounded unless a step of the
// reference model itself rounds (HF's RMSNorm rounds before the weight multiply).
#pragma once

#include <cstdint>
#include <vector>

namespace duet::kernels::reference {

// residual [*, dim] += delta [rows, dim] (when delta is given; rounded to fp32 as the kernel
// stores it); returns out [rows, dim] = bf16(residual[src] / rms(residual[src])) * weight, with
// src = row_index[i] (when given) or i.
std::vector<float> FusedAddRmsNorm(std::vector<float>& residual, const std::vector<float>* delta,
                                   const std::vector<float>& weight, const std::vector<int32_t>* row_index,
                                   int rows, int dim, float eps);

// HF rotate_half rotation of one head x [head_dim] at `position`; angle = float(position) * inv_freq[i]
// in fp32 (as HF), cos/sin and the rotation in double.
std::vector<float> RotateHalf(const float* x, int head_dim, int position, const std::vector<float>& inv_freq);

// q_out [num_tokens, num_q_heads, head_dim] is returned; the rotated k and the v of every token
// with slot_mapping >= 0 are written into k_cache / v_cache ([num_blocks, num_kv_heads,
// block_size, head_dim]); other cache entries are left as they are.
std::vector<float> RopeAndWriteKv(const std::vector<float>& qkv, const std::vector<int32_t>& positions,
                                  const std::vector<int32_t>& slot_mapping, const std::vector<float>& inv_freq,
                                  int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                                  std::vector<float>& k_cache, std::vector<float>& v_cache);

// in [rows, 2 * inter] (gate, then up) -> silu(gate) * up [rows, inter].
std::vector<float> SiluAndMul(const std::vector<float>& in, int rows, int inter);

// table [vocab, dim] -> rows of table picked by tokens [rows, dim].
std::vector<float> EmbeddingGather(const std::vector<int32_t>& tokens, const std::vector<float>& table, int dim);

}  // namespace duet::kernels::reference

#include "backends/cuda/cuda_weights.h"

#include <string>

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace duet::cuda {

// Allocates weight buffers and copies checkpoint tensors into them.
class CudaWeights::Uploader {
 public:
  Uploader(const WeightStore& weights, DeviceArena& arena, CudaWeights& out)
      : weights_(weights), arena_(arena), out_(out) {}

  absl::StatusOr<__nv_bfloat16*> Allocate(int64_t elems, const char* what) {
    DUET_ASSIGN_OR_RETURN(DeviceAllocation a, arena_.Allocate(size_t(elems) * sizeof(__nv_bfloat16), what));
    out_.bytes_ += int64_t(a.bytes());
    out_.allocations_.push_back(std::move(a));
    return out_.allocations_.back().as<__nv_bfloat16>();
  }

  // Copies tensor `name` (checked to have `shape`) into `dst` as bf16.
  absl::Status Copy(const std::string& name, const std::vector<int64_t>& shape, __nv_bfloat16* dst) {
    DUET_ASSIGN_OR_RETURN(const TensorView* view, weights_.Get(name));
    if (view->shape != shape) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " has shape [", absl::StrJoin(view->shape, ", "),
                                                     "], expected [", absl::StrJoin(shape, ", "), "]"));
    }
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    const void* src = view->data;
    if (view->dtype != DType::kBF16) {
      std::vector<float> f32(static_cast<size_t>(numel));
      DUET_RETURN_IF_ERROR(weights_.ReadFloat32(name, shape, absl::MakeSpan(f32)));
      staging_.resize(size_t(numel));
      for (int64_t i = 0; i < numel; ++i) staging_[size_t(i)] = __float2bfloat16(f32[size_t(i)]);
      src = staging_.data();
    }
    return CudaStatus(cudaMemcpy(dst, src, size_t(numel) * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice),
                      "weight upload");
  }

  // Allocate, then Copy each (name, shape) in order into consecutive rows of one buffer.
  absl::StatusOr<__nv_bfloat16*> Stacked(const std::vector<std::pair<std::string, std::vector<int64_t>>>& parts,
                                         const char* what) {
    int64_t elems = 0;
    for (const auto& [name, shape] : parts) elems += shape[0] * (shape.size() > 1 ? shape[1] : 1);
    DUET_ASSIGN_OR_RETURN(__nv_bfloat16 * dst, Allocate(elems, what));
    int64_t at = 0;
    for (const auto& [name, shape] : parts) {
      DUET_RETURN_IF_ERROR(Copy(name, shape, dst + at));
      at += shape[0] * (shape.size() > 1 ? shape[1] : 1);
    }
    return dst;
  }

  absl::StatusOr<__nv_bfloat16*> One(const std::string& name, const std::vector<int64_t>& shape, const char* what) {
    return Stacked({{name, shape}}, what);
  }

 private:
  const WeightStore& weights_;
  DeviceArena& arena_;
  CudaWeights& out_;
  std::vector<__nv_bfloat16> staging_;
};

absl::StatusOr<CudaWeights> CudaWeights::Upload(const WeightStore& weights, const ModelConfig& c, DeviceArena& arena) {
  CudaWeights w;
  Uploader up(weights, arena, w);
  const int64_t hidden = c.hidden_size, inter = c.intermediate_size, hd = c.head_dim;
  const int64_t q_rows = c.num_heads * hd, kv_rows = c.num_kv_heads * hd;

  DUET_ASSIGN_OR_RETURN(w.embed_, up.One("model.embed_tokens.weight", {c.vocab_size, hidden}, "embedding"));
  DUET_ASSIGN_OR_RETURN(w.final_norm_, up.One("model.norm.weight", {hidden}, "final norm"));
  if (c.tie_word_embeddings) {
    w.lm_head_ = w.embed_;
  } else {
    if (!weights.Has("lm_head.weight")) {
      return absl::InvalidArgumentError("checkpoint has no lm_head.weight and config.json does not tie word embeddings");
    }
    DUET_ASSIGN_OR_RETURN(w.lm_head_, up.One("lm_head.weight", {c.vocab_size, hidden}, "lm_head"));
  }
  w.layers_.resize(size_t(c.num_layers));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    CudaLayerWeights& l = w.layers_[size_t(i)];
    DUET_ASSIGN_OR_RETURN(l.input_norm, up.One(p + "input_layernorm.weight", {hidden}, "norm"));
    DUET_ASSIGN_OR_RETURN(l.post_norm, up.One(p + "post_attention_layernorm.weight", {hidden}, "norm"));
    DUET_ASSIGN_OR_RETURN(l.qkv, up.Stacked({{p + "self_attn.q_proj.weight", {q_rows, hidden}},
                                             {p + "self_attn.k_proj.weight", {kv_rows, hidden}},
                                             {p + "self_attn.v_proj.weight", {kv_rows, hidden}}},
                                            "qkv_proj"));
    l.qkv_bias = nullptr;
    if (c.qkv_bias) {
      DUET_ASSIGN_OR_RETURN(l.qkv_bias, up.Stacked({{p + "self_attn.q_proj.bias", {q_rows}},
                                                    {p + "self_attn.k_proj.bias", {kv_rows}},
                                                    {p + "self_attn.v_proj.bias", {kv_rows}}},
                                                   "qkv bias"));
    }
    DUET_ASSIGN_OR_RETURN(l.o, up.One(p + "self_attn.o_proj.weight", {hidden, q_rows}, "o_proj"));
    l.o_bias = nullptr;
    if (c.o_bias) {
      DUET_ASSIGN_OR_RETURN(l.o_bias, up.One(p + "self_attn.o_proj.bias", {hidden}, "o bias"));
    }
    DUET_ASSIGN_OR_RETURN(l.gate_up, up.Stacked({{p + "mlp.gate_proj.weight", {inter, hidden}},
                                                 {p + "mlp.up_proj.weight", {inter, hidden}}},
                                                "gate_up_proj"));
    DUET_ASSIGN_OR_RETURN(l.down, up.One(p + "mlp.down_proj.weight", {hidden, inter}, "down_proj"));
  }
  return w;
}

}  // namespace duet::cuda

#include "backends/cuda/llama_cuda.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/check.h"
#include "common/status_macros.h"
#include "kernels/attention/paged_attention.h"
#include "kernels/attention/prefill_attention.h"
#include "kernels/cuda_check.h"
#include "kernels/elementwise/activation.h"
#include "kernels/elementwise/bias.h"
#include "kernels/elementwise/embedding.h"
#include "kernels/elementwise/norm.h"
#include "kernels/elementwise/rope.h"
#include "kernels/gemm/gemv.h"
#include "kernels/launch.h"
#include "kernels/sampling/sampling.h"

namespace duet {
namespace {

constexpr size_t kCublasWorkspaceBytes = size_t(32) << 20;
// Device memory the executor needs beyond its own allocations (CUDA context, cuBLAS kernels,
// graphs); kept out of the KV-cache budget.
constexpr int64_t kRuntimeReserveBytes = int64_t(768) << 20;

// Decode graphs are captured for these padded batch sizes (vLLM's buckets): 1, 2, 4, then
// multiples of 8.
int GraphBatchSize(int num_seqs) {
  if (num_seqs <= 2) return num_seqs;
  if (num_seqs <= 4) return 4;
  return (num_seqs + 7) / 8 * 8;
}

// Verification graphs are captured for these padded token counts: multiples of 8 up to 16, then
// four buckets per power of two.
int TreeGraphTokens(int num_tokens) {
  if (num_tokens <= 16) return (num_tokens + 7) / 8 * 8;
  int octave = 16;
  while (octave * 2 < num_tokens) octave *= 2;
  const int step = octave / 4;
  return (num_tokens + step - 1) / step * step;
}

// Most tokens of one sequence in a verification graph (one query block of the prefill attention).
constexpr int kTreeGraphMaxChunkTokens = 64;

}  // namespace

// Offsets (in int32 units) of the step-metadata arrays, fixed for the executor's lifetime so
// captured graphs keep pointing at the right places.
struct StepMetadataLayout {
  size_t tokens, positions, slots, q_start, context_lens, logit_rows, block_tables;
  size_t tree_masks;  // uint64 (2 units) per token
  size_t temperature, top_k, top_p, min_p, seeds, offsets;  // seeds/offsets: uint64 (2 units)
  size_t sampling_pitch;
  size_t sampled_tokens, sampled_logprobs;
  size_t total;

  // max_rows: sampled rows (a step of draft trees samples every token's row).
  StepMetadataLayout(int max_tokens, int max_seqs, int max_rows, int max_blocks_per_seq) {
    size_t at = 0;
    auto take = [&](size_t n) {
      at = (at + 3) / 4 * 4;  // 16-byte aligned arrays
      const size_t begin = at;
      at += n;
      return begin;
    };
    tokens = take(max_tokens);
    positions = take(max_tokens);
    slots = take(max_tokens);
    q_start = take(max_seqs + 1);
    context_lens = take(max_seqs);
    logit_rows = take(max_tokens);
    block_tables = take(size_t(max_seqs) * max_blocks_per_seq);
    tree_masks = take(2 * size_t(max_tokens));
    // The six per-row sampling arrays sit sampling_pitch units apart (room for 8-byte rows),
    // so one 2-D copy uploads the used rows of all of them.
    sampling_pitch = (2 * size_t(max_rows) + 3) / 4 * 4;
    temperature = take(sampling_pitch);
    top_k = take(sampling_pitch);
    top_p = take(sampling_pitch);
    min_p = take(sampling_pitch);
    seeds = take(sampling_pitch);
    offsets = take(sampling_pitch);
    sampled_tokens = take(max_rows);
    sampled_logprobs = take(max_rows);
    total = take(0);
  }
};

struct LlamaCuda::StepPlan {
  int num_tokens = 0;        // rows of the step (padded to the graph batch in graph mode)
  int num_seqs = 0;          // sequences (padded likewise)
  int num_logit_rows = 0;    // logits rows (padded likewise)
  int max_q_len = 0;
  int max_context_len = 0;
  bool decode_only = false;  // one token per sequence: paged decode attention
  bool has_trees = false;    // some chunk is a draft tree: attention uses the tree masks
  int graph_batch = 0;       // > 0: replay the graph of this padded batch size
  int graph_tokens = 0;      // > 0: the graph verifies draft trees in this many (padded) rows
};

LlamaCuda::LlamaCuda(const ModelConfig& config, const LlamaCudaOptions& options)
    : config_(config), options_(options) {
  if (options_.max_model_len <= 0) options_.max_model_len = config.max_position_embeddings;
}

LlamaCuda::~LlamaCuda() {
  for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
  linear_.reset();
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::StatusOr<std::unique_ptr<LlamaCuda>> LlamaCuda::Load(const std::string& model_dir,
                                                           const LlamaCudaOptions& options) {
  absl::StatusOr<ModelConfig> config = LoadModelConfig(model_dir);
  if (!config.ok()) return config.status();
  if (config->head_dim != 64 && config->head_dim != 128) {
    return absl::UnimplementedError(absl::StrCat("the CUDA backend supports head_dim 64 and 128, not ", config->head_dim));
  }
  if (config->mlp_bias) return absl::UnimplementedError("mlp_bias is not supported");
  if (options.max_num_seqs <= 0 || options.max_num_batched_tokens <= 0) {
    return absl::InvalidArgumentError("max_num_seqs and max_num_batched_tokens must be positive");
  }
  absl::StatusOr<std::unique_ptr<WeightStore>> weights = WeightStore::Open(model_dir);
  if (!weights.ok()) return weights.status();
  std::unique_ptr<LlamaCuda> model(new LlamaCuda(*config, options));
  if (absl::Status s = model->Init(**weights); !s.ok()) return s;
  return model;
}

absl::Status LlamaCuda::Init(const WeightStore& weights) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError("no CUDA device is available");
  }
  if (options_.device < 0 || options_.device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device ", options_.device, " does not exist (", count, " found)"));
  }
  if (absl::Status s = cuda::CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"); !s.ok()) return s;
  cudaDeviceProp prop{};
  if (absl::Status s = cuda::CudaStatus(cudaGetDeviceProperties(&prop, options_.device), "device properties"); !s.ok()) {
    return s;
  }
  if (prop.major < 8) return absl::FailedPreconditionError("the CUDA backend needs compute capability 8.0 or newer");
  num_sms_ = prop.multiProcessorCount;
  kernels::SetProgrammaticLaunch(options_.programmatic_launch && prop.major >= 9);
  if (absl::Status s = cuda::CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
      !s.ok()) {
    return s;
  }
  absl::StatusOr<cuda::DeviceAllocation> ws = arena_.Allocate(kCublasWorkspaceBytes, "cuBLAS workspace");
  if (!ws.ok()) return ws.status();
  cublas_workspace_ = std::move(*ws);
  absl::StatusOr<cuda::CublasLinear> linear =
      cuda::CublasLinear::Create(stream_, cublas_workspace_.get(), cublas_workspace_.bytes());
  if (!linear.ok()) return linear.status();
  linear_ = std::make_unique<cuda::CublasLinear>(std::move(*linear));
  if (absl::Status s = LoadWeights(weights); !s.ok()) return s;
  weight_bytes_ = arena_.allocated_bytes() - int64_t(kCublasWorkspaceBytes);

  const std::vector<float> inv_freq = config_.rope.InverseFrequencies(static_cast<int>(config_.head_dim));
  const std::vector<float2> table = kernels::BuildRopeTable(inv_freq, static_cast<int>(options_.max_model_len));
  absl::StatusOr<cuda::DeviceAllocation> rope = arena_.Allocate(table.size() * sizeof(float2), "RoPE table");
  if (!rope.ok()) return rope.status();
  rope_table_ = std::move(*rope);
  if (absl::Status s = cuda::CudaStatus(
          cudaMemcpy(rope_table_.get(), table.data(), table.size() * sizeof(float2), cudaMemcpyHostToDevice), "RoPE upload");
      !s.ok()) {
    return s;
  }
  return AllocateActivations();
}

absl::Status LlamaCuda::LoadWeights(const WeightStore& weights) {
  const ModelConfig& c = config_;
  const int64_t hidden = c.hidden_size, inter = c.intermediate_size, hd = c.head_dim;
  const int64_t q_rows = c.num_heads * hd, kv_rows = c.num_kv_heads * hd;
  std::vector<__nv_bfloat16> staging;

  // Copies tensor `name` (checked to have `shape`) into `dst` as bf16.
  auto upload = [&](const std::string& name, const std::vector<int64_t>& shape, __nv_bfloat16* dst) -> absl::Status {
    absl::StatusOr<const TensorView*> view = weights.Get(name);
    if (!view.ok()) return view.status();
    if ((*view)->shape != shape) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " has shape [", absl::StrJoin((*view)->shape, ", "),
                                                     "], expected [", absl::StrJoin(shape, ", "), "]"));
    }
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    const void* src = (*view)->data;
    if ((*view)->dtype != DType::kBF16) {
      std::vector<float> f32(static_cast<size_t>(numel));
      if (absl::Status s = weights.ReadFloat32(name, shape, absl::MakeSpan(f32)); !s.ok()) return s;
      staging.resize(size_t(numel));
      for (int64_t i = 0; i < numel; ++i) staging[size_t(i)] = __float2bfloat16(f32[size_t(i)]);
      src = staging.data();
    }
    return cuda::CudaStatus(cudaMemcpy(dst, src, size_t(numel) * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice),
                            "weight upload");
  };
  auto allocate = [&](int64_t elems, const char* what) -> absl::StatusOr<__nv_bfloat16*> {
    absl::StatusOr<cuda::DeviceAllocation> a = arena_.Allocate(size_t(elems) * sizeof(__nv_bfloat16), what);
    if (!a.ok()) return a.status();
    weight_allocations_.push_back(std::move(*a));
    return weight_allocations_.back().as<__nv_bfloat16>();
  };
#define DUET_ALLOC(var, elems, what)                                  \
  absl::StatusOr<__nv_bfloat16*> var##_or = allocate((elems), (what)); \
  if (!var##_or.ok()) return var##_or.status();                       \
  __nv_bfloat16* var = *var##_or;

  DUET_ALLOC(embed, c.vocab_size * hidden, "embedding");
  DUET_RETURN_IF_ERROR(upload("model.embed_tokens.weight", {c.vocab_size, hidden}, embed));
  embed_ = embed;
  DUET_ALLOC(final_norm, hidden, "final norm");
  DUET_RETURN_IF_ERROR(upload("model.norm.weight", {hidden}, final_norm));
  final_norm_ = final_norm;
  if (c.tie_word_embeddings) {
    lm_head_ = embed_;
  } else {
    if (!weights.Has("lm_head.weight")) {
      return absl::InvalidArgumentError("checkpoint has no lm_head.weight and config.json does not tie word embeddings");
    }
    DUET_ALLOC(lm_head, c.vocab_size * hidden, "lm_head");
    DUET_RETURN_IF_ERROR(upload("lm_head.weight", {c.vocab_size, hidden}, lm_head));
    lm_head_ = lm_head;
  }
  layers_.resize(size_t(c.num_layers));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    Layer& l = layers_[size_t(i)];
    DUET_ALLOC(input_norm, hidden, "norm");
    DUET_RETURN_IF_ERROR(upload(p + "input_layernorm.weight", {hidden}, input_norm));
    DUET_ALLOC(post_norm, hidden, "norm");
    DUET_RETURN_IF_ERROR(upload(p + "post_attention_layernorm.weight", {hidden}, post_norm));
    DUET_ALLOC(qkv, (q_rows + 2 * kv_rows) * hidden, "qkv_proj");
    DUET_RETURN_IF_ERROR(upload(p + "self_attn.q_proj.weight", {q_rows, hidden}, qkv));
    DUET_RETURN_IF_ERROR(upload(p + "self_attn.k_proj.weight", {kv_rows, hidden}, qkv + q_rows * hidden));
    DUET_RETURN_IF_ERROR(upload(p + "self_attn.v_proj.weight", {kv_rows, hidden}, qkv + (q_rows + kv_rows) * hidden));
    l.qkv_bias = nullptr;
    if (c.qkv_bias) {
      DUET_ALLOC(qkv_bias, q_rows + 2 * kv_rows, "qkv bias");
      DUET_RETURN_IF_ERROR(upload(p + "self_attn.q_proj.bias", {q_rows}, qkv_bias));
      DUET_RETURN_IF_ERROR(upload(p + "self_attn.k_proj.bias", {kv_rows}, qkv_bias + q_rows));
      DUET_RETURN_IF_ERROR(upload(p + "self_attn.v_proj.bias", {kv_rows}, qkv_bias + q_rows + kv_rows));
      l.qkv_bias = qkv_bias;
    }
    DUET_ALLOC(o, hidden * q_rows, "o_proj");
    DUET_RETURN_IF_ERROR(upload(p + "self_attn.o_proj.weight", {hidden, q_rows}, o));
    l.o_bias = nullptr;
    if (c.o_bias) {
      DUET_ALLOC(o_bias, hidden, "o bias");
      DUET_RETURN_IF_ERROR(upload(p + "self_attn.o_proj.bias", {hidden}, o_bias));
      l.o_bias = o_bias;
    }
    DUET_ALLOC(gate_up, 2 * inter * hidden, "gate_up_proj");
    DUET_RETURN_IF_ERROR(upload(p + "mlp.gate_proj.weight", {inter, hidden}, gate_up));
    DUET_RETURN_IF_ERROR(upload(p + "mlp.up_proj.weight", {inter, hidden}, gate_up + inter * hidden));
    DUET_ALLOC(down, hidden * inter, "down_proj");
    DUET_RETURN_IF_ERROR(upload(p + "mlp.down_proj.weight", {hidden, inter}, down));
    l.input_norm = input_norm;
    l.post_norm = post_norm;
    l.qkv = qkv;
    l.o = o;
    l.gate_up = gate_up;
    l.down = down;
  }
#undef DUET_ALLOC
  return absl::OkStatus();
}

absl::Status LlamaCuda::AllocateActivations() {
  const ModelConfig& c = config_;
  max_logit_rows_ = std::max(options_.max_num_seqs, std::min(options_.max_logit_rows, options_.max_num_batched_tokens));
  // Rows of the buffers cuBLAS reads and writes: room for its rounded row counts.
  const int64_t t = cuda::CublasRowCapacity(options_.max_num_batched_tokens);
  const int64_t r = cuda::CublasRowCapacity(max_logit_rows_);
  const int64_t qkv_width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
  const int64_t q_width = c.num_heads * c.head_dim;
  struct Want {
    cuda::DeviceAllocation* into;
    int64_t bytes;
    const char* what;
  };
  // The decode workspace must hold the largest plan any graph bucket uses.
  for (int b = 1; b <= options_.max_num_seqs; ++b) {
    const kernels::PagedDecodeAttentionPlan plan = kernels::PlanPagedDecodeAttention(
        b, int(c.num_heads), int(c.num_kv_heads), int(c.head_dim), int(options_.max_model_len), num_sms_);
    decode_workspace_bytes_ = std::max(decode_workspace_bytes_, plan.workspace_bytes);
    decode_split_counters_count_ = std::max(decode_split_counters_count_, plan.num_split_counters);
  }
  const std::vector<Want> wants = {
      {&residual_, t * c.hidden_size * 4, "residual"},
      {&normed_, t * c.hidden_size * 2, "normed"},
      {&qkv_, t * qkv_width * 2, "qkv"},
      {&q_, t * q_width * 2, "q"},
      {&attn_, t * q_width * 2, "attention output"},
      {&delta_, t * c.hidden_size * 2, "delta"},
      {&gate_up_, t * 2 * c.intermediate_size * 2, "gate_up"},
      {&act_, t * c.intermediate_size * 2, "mlp activation"},
      {&final_normed_, r * c.hidden_size * 2, "final norm"},
      {&logits_, r * c.vocab_size * 4, "logits"},
      {&decode_workspace_, int64_t(decode_workspace_bytes_), "decode attention workspace"},
      {&decode_split_counters_, int64_t(decode_split_counters_count_) * 4, "decode attention split counters"},
  };
  for (const Want& w : wants) {
    absl::StatusOr<cuda::DeviceAllocation> a = arena_.Allocate(size_t(w.bytes), w.what);
    if (!a.ok()) return a.status();
    *w.into = std::move(*a);
  }
  // Padding rows of verification graphs keep whatever attention output a row last had: finite
  // from the start.
  if (absl::Status s = cuda::CudaStatus(cudaMemset(attn_.get(), 0, attn_.bytes()), "attention output memset");
      !s.ok()) {
    return s;
  }
  if (decode_split_counters_count_ > 0) {
    if (absl::Status s = cuda::CudaStatus(
            cudaMemset(decode_split_counters_.get(), 0, size_t(decode_split_counters_count_) * 4), "split counters");
        !s.ok()) {
      return s;
    }
  }
  // Logits of one head pass, or every row's sampled token and logprob (up to t rows each).
  // Host logits travel through it in passes of max_num_seqs rows; sampled tokens and logprobs
  // (up to t rows each) in one.
  return results_host_.Resize(std::max(size_t(options_.max_num_seqs) * size_t(c.vocab_size), 2 * size_t(t) + 8) * 4);
}

absl::Status LlamaCuda::CopyLogitsToHost(int rows, float* dst) {
  const size_t vocab = size_t(config_.vocab_size);
  for (int begin = 0; begin < rows; begin += options_.max_num_seqs) {
    const size_t bytes = size_t(std::min(options_.max_num_seqs, rows - begin)) * vocab * sizeof(float);
    if (absl::Status s = cuda::CudaStatus(cudaMemcpyAsync(results_host_.as<float>(), logits_.as<float>() + begin * vocab,
                                                          bytes, cudaMemcpyDeviceToHost, stream_),
                                          "logits copy");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = cuda::CudaStatus(cudaStreamSynchronize(stream_), "step"); !s.ok()) return s;
    std::memcpy(dst + begin * vocab, results_host_.as<float>(), bytes);
  }
  return absl::OkStatus();
}

std::optional<int64_t> LlamaCuda::DeviceKvBudgetBytes(double memory_fraction) const {
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return int64_t(0);
  // Our share of the device, minus what we already hold; never more than is actually free
  // (another process — e.g. the prefill worker beside a decode worker — may hold the rest).
  const int64_t share = int64_t(double(total_bytes) * memory_fraction) - arena_.allocated_bytes() - kRuntimeReserveBytes;
  const int64_t free_now = int64_t(free_bytes) - kRuntimeReserveBytes;
  return std::max<int64_t>(0, std::min(share, free_now));
}

std::unique_ptr<KvCache> LlamaCuda::CreateKvCache(int64_t num_blocks, int64_t block_size) {
  DUET_CHECK(block_size > 0 && (block_size & (block_size - 1)) == 0);
  block_size_ = int(block_size);
  max_blocks_per_seq_ = int((options_.max_model_len + block_size - 1) / block_size);
  layout_ = std::make_unique<const StepMetadataLayout>(options_.max_num_batched_tokens, options_.max_num_seqs,
                                                       options_.max_num_batched_tokens, max_blocks_per_seq_);
  const StepMetadataLayout& layout = *layout_;
  absl::StatusOr<cuda::DeviceAllocation> meta = arena_.Allocate(layout.total * 4, "step metadata");
  DUET_CHECK_MSG(meta.ok(), std::string(meta.status().message()).c_str());
  metadata_ = std::move(*meta);
  DUET_CHECK(metadata_host_.Resize(layout.total * 4).ok());
  std::memset(metadata_host_.as<int32_t>(), 0, layout.total * 4);
  absl::StatusOr<std::unique_ptr<cuda::DeviceKvCache>> cache = cuda::DeviceKvCache::Create(
      KvCacheShape{config_.num_layers, num_blocks, config_.num_kv_heads, block_size, config_.head_dim,
                   KvDtype::kBFloat16},
      arena_, stream_);
  DUET_CHECK_MSG(cache.ok(), std::string(cache.status().message()).c_str());
  return std::move(*cache);
}

absl::StatusOr<LlamaCuda::StepPlan> LlamaCuda::PlanStep(absl::Span<const SequenceChunk> chunks, int block_size) const {
  StepPlan plan;
  if (block_size != block_size_ || metadata_.get() == nullptr) {
    return absl::FailedPreconditionError("the KV cache passed to the CUDA executor was not created by it");
  }
  if (chunks.empty()) return absl::InvalidArgumentError("empty step");
  if (int(chunks.size()) > options_.max_num_seqs) {
    return absl::InvalidArgumentError(absl::StrCat("step has ", chunks.size(), " sequences; max_num_seqs is ",
                                                   options_.max_num_seqs));
  }
  const StepMetadataLayout& layout = *layout_;
  int32_t* meta = metadata_host_.as<int32_t>();
  int32_t* tokens = meta + layout.tokens;
  int32_t* positions = meta + layout.positions;
  int32_t* slots = meta + layout.slots;
  int32_t* q_start = meta + layout.q_start;
  int32_t* context_lens = meta + layout.context_lens;
  int32_t* block_tables = meta + layout.block_tables;
  int32_t* logit_rows = meta + layout.logit_rows;
  auto* tree_masks = reinterpret_cast<uint64_t*>(meta + layout.tree_masks);

  plan.decode_only = true;
  std::vector<int32_t> depths;
  int row = 0, logit_row = 0;
  q_start[0] = 0;
  for (size_t s = 0; s < chunks.size(); ++s) {
    const SequenceChunk& chunk = chunks[s];
    const int n = int(chunk.tokens.size());
    const int64_t end = chunk.start_position + n;
    if (n == 0) return absl::InvalidArgumentError("empty chunk");
    if (end > options_.max_model_len) {
      return absl::InvalidArgumentError(absl::StrCat("sequence reaches position ", end, " past max_model_len ",
                                                     options_.max_model_len));
    }
    if (end > int64_t(chunk.block_table.size()) * block_size) return absl::InternalError("block table too short for the chunk");
    if (chunk.num_logits < 0 || chunk.num_logits > n) return absl::InternalError("num_logits exceeds the chunk");
    if (row + n > options_.max_num_batched_tokens) {
      return absl::InvalidArgumentError(absl::StrCat("step has more than max_num_batched_tokens (",
                                                     options_.max_num_batched_tokens, ") tokens"));
    }
    if (n != 1 || chunk.num_logits != 1) plan.decode_only = false;
    // A draft tree: token j takes position start + depth(j) but slot start + j, and sees the
    // context plus its ancestors (its mask: itself and its parent's mask).
    const bool tree = !chunk.tree_parents.empty();
    if (tree) {
      if (chunk.tree_parents.size() != size_t(n) || chunk.tree_parents[0] != -1) {
        return absl::InternalError("a draft tree needs one parent per token and token 0 as its root");
      }
      if (n > 64) return absl::InvalidArgumentError("a draft tree has at most 64 tokens on the CUDA backend");
      depths.assign(size_t(n), 0);
      plan.has_trees = true;
    }
    for (int j = 0; j < n; ++j) {
      const int32_t id = chunk.tokens[size_t(j)];
      if (id < 0 || id >= config_.vocab_size) return absl::InvalidArgumentError(absl::StrCat("token id ", id, " out of range"));
      const int64_t slot = chunk.start_position + j;
      int64_t pos = slot;
      uint64_t mask = ~uint64_t{0};
      if (tree && j > 0) {
        const int32_t parent = chunk.tree_parents[size_t(j)];
        if (parent < 0 || parent >= j) return absl::InternalError("a draft tree token's parent must come before it");
        depths[size_t(j)] = depths[size_t(parent)] + 1;
        pos = chunk.start_position + depths[size_t(j)];
        mask = (uint64_t{1} << j) | tree_masks[row + parent];
      } else if (tree) {
        mask = 1;
      }
      tokens[row + j] = id;
      positions[row + j] = int32_t(pos);
      slots[row + j] = chunk.block_table[size_t(slot / block_size)] * block_size + int32_t(slot % block_size);
      tree_masks[row + j] = mask;
    }
    for (int j = n - chunk.num_logits; j < n; ++j) logit_rows[logit_row++] = row + j;
    const int num_blocks = int((end + block_size - 1) / block_size);
    std::memcpy(block_tables + s * size_t(max_blocks_per_seq_), chunk.block_table.data(), size_t(num_blocks) * 4);
    context_lens[s] = int32_t(end);
    row += n;
    q_start[s + 1] = row;
    plan.max_q_len = std::max(plan.max_q_len, n);
    plan.max_context_len = std::max(plan.max_context_len, int(end));
  }
  plan.num_tokens = row;
  plan.num_seqs = int(chunks.size());
  plan.num_logit_rows = logit_row;
  return plan;
}

void LlamaCuda::Upload(const StepPlan& plan, absl::Span<const DeviceSamplingRow> sampling) {
  const StepMetadataLayout& layout = *layout_;
  int32_t* host = metadata_host_.as<int32_t>();
  int32_t* dev = metadata_.as<int32_t>();
  auto copy = [&](size_t offset, size_t count) {
    if (count == 0) return;
    DUET_CUDA_CHECK(cudaMemcpyAsync(dev + offset, host + offset, count * 4, cudaMemcpyHostToDevice, stream_));
  };
  // tokens, positions, slots, q_start, context_lens and logit_rows are laid out back to back.
  copy(layout.tokens, layout.block_tables - layout.tokens);
  if (plan.has_trees) copy(layout.tree_masks, 2 * size_t(plan.num_tokens));
  // Only each row's used prefix of the block table travels.
  const size_t pitch = size_t(max_blocks_per_seq_) * 4;
  const size_t used = size_t((plan.max_context_len + block_size_ - 1) / block_size_) * 4;
  if (used > 0) {
    DUET_CUDA_CHECK(cudaMemcpy2DAsync(dev + layout.block_tables, pitch, host + layout.block_tables, pitch, used,
                                      size_t(plan.num_seqs), cudaMemcpyHostToDevice, stream_));
  }
  if (!sampling.empty()) {
    const int rows = plan.num_logit_rows;
    auto* temperature = reinterpret_cast<float*>(host + layout.temperature);
    int32_t* top_k = host + layout.top_k;
    auto* top_p = reinterpret_cast<float*>(host + layout.top_p);
    auto* min_p = reinterpret_cast<float*>(host + layout.min_p);
    auto* seeds = reinterpret_cast<uint64_t*>(host + layout.seeds);
    auto* offsets = reinterpret_cast<uint64_t*>(host + layout.offsets);
    for (int i = 0; i < rows; ++i) {
      if (size_t(i) >= sampling.size()) {  // graph padding rows: greedy
        temperature[i] = 0.0f;
        continue;
      }
      temperature[i] = sampling[i].temperature;
      top_k[i] = sampling[i].top_k;
      top_p[i] = sampling[i].top_p;
      min_p[i] = sampling[i].min_p;
      seeds[i] = sampling[i].seed;
      offsets[i] = sampling[i].offset;
    }
    const size_t pitch = layout.sampling_pitch * 4;
    DUET_CUDA_CHECK(cudaMemcpy2DAsync(dev + layout.temperature, pitch, host + layout.temperature, pitch,
                                      size_t(rows) * 8, 6, cudaMemcpyHostToDevice, stream_));
  }
}

void LlamaCuda::Enqueue(const StepPlan& plan, cuda::DeviceKvCache& cache, bool sample,
                        absl::Span<const SequenceChunk> chunks, const LayerDoneCallback& on_layer_done,
                        int num_layers) {
  const ModelConfig& c = config_;
  const StepMetadataLayout& layout = *layout_;
  const int32_t* meta = metadata_.as<int32_t>();
  const int t = plan.num_tokens;
  const int hidden = int(c.hidden_size), inter = int(c.intermediate_size), hd = int(c.head_dim);
  const int nh = int(c.num_heads), nkv = int(c.num_kv_heads);
  const int qkv_width = (nh + 2 * nkv) * hd, q_width = nh * hd;
  const float scale = 1.0f / std::sqrt(float(hd));
  auto* residual = residual_.as<float>();
  auto* normed = normed_.as<__nv_bfloat16>();
  auto* qkv = qkv_.as<__nv_bfloat16>();
  auto* q = q_.as<__nv_bfloat16>();
  auto* attn = attn_.as<__nv_bfloat16>();
  auto* delta = delta_.as<__nv_bfloat16>();
  auto* gate_up = gate_up_.as<__nv_bfloat16>();
  auto* act = act_.as<__nv_bfloat16>();

  kernels::PagedDecodeAttentionPlan decode_plan{};
  if (plan.decode_only) {
    // A graph must serve any context up to max_model_len; an eager step plans for its own.
    const int planned_context = plan.graph_batch > 0 ? int(options_.max_model_len) : plan.max_context_len;
    decode_plan = kernels::PlanPagedDecodeAttention(plan.num_seqs, nh, nkv, hd, planned_context, num_sms_);
    if (decode_plan.workspace_bytes > decode_workspace_bytes_) {
      decode_plan = kernels::PlanPagedDecodeAttention(plan.num_seqs, nh, nkv, hd, int(options_.max_model_len), num_sms_);
    }
    DUET_CHECK(decode_plan.workspace_bytes <= decode_workspace_bytes_);
  }

  kernels::EmbeddingGather(meta + layout.tokens, embed_, residual, t, hidden, stream_);
  for (size_t li = 0; li < size_t(num_layers); ++li) {
    const Layer& l = layers_[li];
    const kernels::PagedKvView kv = cache.Layer(int64_t(li));
    kernels::FusedAddRmsNorm({residual, li == 0 ? nullptr : delta, l.input_norm, nullptr, normed, t, hidden,
                              float(c.rms_norm_eps)},
                             stream_);
    const bool fused_epilogues = options_.fused_decode_epilogues && t <= kernels::kGemvPreferredMaxRows;
    if (fused_epilogues && l.qkv_bias == nullptr) {
      // Skinny batches: RoPE and the KV write in the projection's epilogue (no qkv round trip).
      kernels::GemvParams g{normed, l.qkv, nullptr, t, hidden, qkv_width, false, kernels::GemvEpilogue::kRopeKvWrite};
      g.rope = {meta + layout.positions, meta + layout.slots, rope_table_.as<float2>(), q, kv, nh};
      kernels::Gemv(g, stream_);
    } else {
      linear_->Forward(normed, l.qkv, qkv, t, hidden, qkv_width);
      if (l.qkv_bias != nullptr) kernels::AddBias(qkv, l.qkv_bias, t, qkv_width, stream_);
      kernels::RopeAndWriteKv({qkv, meta + layout.positions, meta + layout.slots, rope_table_.as<float2>(), q, kv, t, nh},
                              stream_);
    }
    if (plan.decode_only) {
      kernels::PagedDecodeAttentionParams p{};
      p.q = q;
      p.kv = kv;
      p.block_tables = meta + layout.block_tables;
      p.context_lens = meta + layout.context_lens;
      p.out = attn;
      p.num_seqs = plan.num_seqs;
      p.num_q_heads = nh;
      p.max_blocks_per_seq = max_blocks_per_seq_;
      p.scale = scale;
      p.workspace = decode_workspace_.as<float>();
      p.split_counters = decode_split_counters_.as<int32_t>();
      kernels::PagedDecodeAttention(p, decode_plan, stream_);
    } else {
      kernels::PrefillAttentionParams p{};
      p.q = q;
      p.kv = kv;
      p.block_tables = meta + layout.block_tables;
      p.q_start = meta + layout.q_start;
      p.context_lens = meta + layout.context_lens;
      p.tree_masks = plan.has_trees ? reinterpret_cast<const uint64_t*>(meta + layout.tree_masks) : nullptr;
      p.out = attn;
      p.num_seqs = plan.num_seqs;
      p.num_q_tokens = t;
      p.max_q_len = plan.max_q_len;
      p.num_q_heads = nh;
      p.max_blocks_per_seq = max_blocks_per_seq_;
      p.scale = scale;
      kernels::PrefillAttention(p, stream_);
    }
    linear_->Forward(attn, l.o, delta, t, q_width, hidden);
    if (l.o_bias != nullptr) kernels::AddBias(delta, l.o_bias, t, hidden, stream_);
    kernels::FusedAddRmsNorm({residual, delta, l.post_norm, nullptr, normed, t, hidden, float(c.rms_norm_eps)}, stream_);
    if (fused_epilogues) {
      linear_->ForwardSiluMul(normed, l.gate_up, gate_up, act, t, hidden, inter);
    } else {
      linear_->Forward(normed, l.gate_up, gate_up, t, hidden, 2 * inter);
      kernels::SiluAndMul(gate_up, act, t, inter, stream_);
    }
    linear_->Forward(act, l.down, delta, t, inter, hidden);
    if (on_layer_done) {
      // The layer's K/V are in the cache once the stream reaches here.
      DUET_CUDA_CHECK(cudaStreamSynchronize(stream_));
      on_layer_done(int64_t(li), chunks);
    }
  }
  if (plan.graph_batch > 0) {
    // Decode: row i gives logits row i, and they all fit one head pass, so the last MLP output
    // joins the residual stream and the final norm writes the head's input in one kernel.
    DUET_CHECK(plan.num_logit_rows == t && t <= max_logit_rows_);
    kernels::FusedAddRmsNorm({residual, delta, final_norm_, nullptr, final_normed_.as<__nv_bfloat16>(), t, hidden,
                              float(c.rms_norm_eps)},
                             stream_);
    linear_->ForwardF32(final_normed_.as<__nv_bfloat16>(), lm_head_, logits_.as<float>(), plan.num_logit_rows, hidden,
                        int(c.vocab_size));
    if (sample) EnqueueSampling(0, plan.num_logit_rows);
  } else {
    // The last MLP output joins the residual stream (the normalized copy is unused); EagerHead
    // normalizes the rows that give logits.
    kernels::FusedAddRmsNorm({residual, delta, final_norm_, nullptr, normed, t, hidden, float(c.rms_norm_eps)}, stream_);
  }
}

void LlamaCuda::EnqueueSampling(int first_row, int rows) {
  const StepMetadataLayout& layout = *layout_;
  int32_t* meta = metadata_.as<int32_t>();
  const int r = first_row;
  kernels::SampleTokens({logits_.as<float>(), rows, int(config_.vocab_size),
                         reinterpret_cast<const float*>(meta + layout.temperature) + r, meta + layout.top_k + r,
                         reinterpret_cast<const float*>(meta + layout.top_p) + r,
                         reinterpret_cast<const float*>(meta + layout.min_p) + r,
                         reinterpret_cast<const uint64_t*>(meta + layout.seeds) + r,
                         reinterpret_cast<const uint64_t*>(meta + layout.offsets) + r, meta + layout.sampled_tokens + r,
                         reinterpret_cast<float*>(meta + layout.sampled_logprobs) + r},
                        stream_);
}

void LlamaCuda::PadForGraph(StepPlan& plan, int batch) const {
  const StepMetadataLayout& layout = *layout_;
  int32_t* meta = metadata_host_.as<int32_t>();
  for (int i = plan.num_seqs; i < batch; ++i) {
    meta[layout.tokens + i] = 0;
    meta[layout.positions + i] = 0;
    meta[layout.slots + i] = -1;            // writes no K/V
    meta[layout.context_lens + i] = 0;      // attends to nothing
    meta[layout.q_start + i + 1] = i + 1;
    meta[layout.logit_rows + i] = i;
  }
  plan.num_tokens = plan.num_seqs = plan.num_logit_rows = batch;
  plan.graph_batch = batch;
}

void LlamaCuda::PadTreeStepForGraph(StepPlan& plan, int batch, int tokens) const {
  const StepMetadataLayout& layout = *layout_;
  int32_t* meta = metadata_host_.as<int32_t>();
  auto* tree_masks = reinterpret_cast<uint64_t*>(meta + layout.tree_masks);
  // Padding rows follow the real ones and belong to no sequence: they write no K/V, no query
  // attends to them, and their logits go unused.
  for (int i = plan.num_tokens; i < tokens; ++i) {
    meta[layout.tokens + i] = 0;
    meta[layout.positions + i] = 0;
    meta[layout.slots + i] = -1;
    meta[layout.logit_rows + i] = i;
    tree_masks[i] = 1;
  }
  for (int s = plan.num_seqs; s < batch; ++s) {
    meta[layout.context_lens + s] = 0;
    meta[layout.q_start + s + 1] = plan.num_tokens;  // no queries
  }
  plan.num_tokens = plan.num_logit_rows = tokens;
  plan.num_seqs = batch;
  plan.max_q_len = kTreeGraphMaxChunkTokens;
  plan.graph_batch = batch;
  plan.graph_tokens = tokens;
}

absl::Status LlamaCuda::LaunchGraph(const StepPlan& plan, cuda::DeviceKvCache& cache, bool sample, int num_layers) {
  if (graph_cache_ != &cache) {
    for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
    graphs_.clear();
    graph_cache_ = &cache;
  }
  const auto key = std::make_tuple(plan.graph_batch, plan.graph_tokens, sample, num_layers);
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    // One eager run first: kernels that configure themselves on first use (shared-memory
    // limits) and cuBLAS's heuristics do so outside the capture.
    Enqueue(plan, cache, sample, {}, nullptr, num_layers);
    cudaGraph_t graph = nullptr;
    if (absl::Status s = cuda::CudaStatus(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "begin capture");
        !s.ok()) {
      return s;
    }
    Enqueue(plan, cache, sample, {}, nullptr, num_layers);
    if (absl::Status s = cuda::CudaStatus(cudaStreamEndCapture(stream_, &graph), "end capture"); !s.ok()) return s;
    cudaGraphExec_t exec = nullptr;
    const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    if (absl::Status s = cuda::CudaStatus(err, "graph instantiate"); !s.ok()) return s;
    it = graphs_.emplace(key, exec).first;
    ++num_graph_captures_;
  }
  return cuda::CudaStatus(cudaGraphLaunch(it->second, stream_), "graph launch");
}

absl::Status LlamaCuda::EagerHead(const StepPlan& plan, bool sample, std::vector<float>* logits,
                                  std::vector<DeviceSample>* samples) {
  const StepMetadataLayout& layout = *layout_;
  const int32_t* meta = metadata_.as<int32_t>();
  const int64_t vocab = config_.vocab_size;
  for (int begin = 0; begin < plan.num_logit_rows; begin += max_logit_rows_) {
    const int rows = std::min(max_logit_rows_, plan.num_logit_rows - begin);
    kernels::FusedAddRmsNorm({residual_.as<float>(), nullptr, final_norm_, meta + layout.logit_rows + begin,
                              final_normed_.as<__nv_bfloat16>(), rows, int(config_.hidden_size), float(config_.rms_norm_eps)},
                             stream_);
    linear_->ForwardF32(final_normed_.as<__nv_bfloat16>(), lm_head_, logits_.as<float>(), rows, int(config_.hidden_size),
                        int(vocab));
    if (sample) {
      EnqueueSampling(begin, rows);
      continue;
    }
    if (absl::Status s = CopyLogitsToHost(rows, logits->data() + size_t(begin) * size_t(vocab)); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status LlamaCuda::RunLayers(absl::Span<const SequenceChunk> chunks, KvCache& kv_cache,
                                  absl::Span<const DeviceSamplingRow> sampling, const LayerDoneCallback& on_layer_done,
                                  std::vector<float>* logits, std::vector<DeviceSample>* samples, int num_layers) {
  DUET_CHECK(num_layers >= 1 && num_layers <= int(layers_.size()));
  auto* cache = dynamic_cast<cuda::DeviceKvCache*>(&kv_cache);
  if (cache == nullptr) return absl::InvalidArgumentError("the CUDA backend needs its own device KV cache");
  absl::StatusOr<StepPlan> plan = PlanStep(chunks, int(cache->shape().block_size));
  if (!plan.ok()) return plan.status();
  const bool sample = samples != nullptr;
  const int real_rows = plan->num_logit_rows;
  if (sample && size_t(real_rows) != sampling.size()) {
    return absl::InvalidArgumentError(absl::StrCat("device sampling needs one row per logits row (", real_rows,
                                                   " rows, ", sampling.size(), " given)"));
  }
  const bool graphs = options_.cuda_graphs && !on_layer_done && GraphBatchSize(plan->num_seqs) <= options_.max_num_seqs;
  const bool decode_graph =
      graphs && plan->decode_only && GraphBatchSize(plan->num_seqs) <= options_.max_num_batched_tokens;
  // A verification step (draft trees beside one-token chunks, every row giving logits) whose
  // padded rows fit one logits pass.
  const bool tree_graph = graphs && plan->has_trees && plan->num_logit_rows == plan->num_tokens &&
                          plan->max_q_len <= kTreeGraphMaxChunkTokens &&
                          TreeGraphTokens(plan->num_tokens) <= std::min(max_logit_rows_, options_.max_num_batched_tokens);
  const bool use_graph = decode_graph || tree_graph;
  if (decode_graph) PadForGraph(*plan, GraphBatchSize(plan->num_seqs));
  if (tree_graph) PadTreeStepForGraph(*plan, GraphBatchSize(plan->num_seqs), TreeGraphTokens(plan->num_tokens));
  cache->FlushSlotMoves();
  Upload(*plan, sampling);

  const int64_t vocab = config_.vocab_size;
  if (!sample) logits->resize(size_t(real_rows) * size_t(vocab));
  if (use_graph) {
    if (absl::Status s = LaunchGraph(*plan, *cache, sample, num_layers); !s.ok()) return s;
    if (!sample) {
      if (absl::Status s = CopyLogitsToHost(real_rows, logits->data()); !s.ok()) return s;
    }
  } else {
    Enqueue(*plan, *cache, sample, chunks, on_layer_done, num_layers);
    if (absl::Status s = EagerHead(*plan, sample, logits, samples); !s.ok()) return s;
  }
  if (sample) {
    const StepMetadataLayout& layout = *layout_;
    // The used rows of the tokens and of the logprobs, to the same offsets in results_host_.
    int32_t* host = results_host_.as<int32_t>();
    const size_t logprobs_at = layout.sampled_logprobs - layout.sampled_tokens;
    DUET_CUDA_CHECK(cudaMemcpyAsync(host, metadata_.as<int32_t>() + layout.sampled_tokens, size_t(real_rows) * 4,
                                    cudaMemcpyDeviceToHost, stream_));
    DUET_CUDA_CHECK(cudaMemcpyAsync(host + logprobs_at, metadata_.as<int32_t>() + layout.sampled_logprobs,
                                    size_t(real_rows) * 4, cudaMemcpyDeviceToHost, stream_));
    if (absl::Status s = cuda::CudaStatus(cudaStreamSynchronize(stream_), "step"); !s.ok()) return s;
    const auto* logprobs = reinterpret_cast<const float*>(host + logprobs_at);
    samples->resize(size_t(real_rows));
    for (int i = 0; i < real_rows; ++i) (*samples)[size_t(i)] = DeviceSample{host[i], logprobs[i]};
  }
  return absl::OkStatus();
}

absl::Status LlamaCuda::Forward(absl::Span<const SequenceChunk> chunks, KvCache& cache, std::vector<float>& logits,
                                const LayerDoneCallback& on_layer_done) {
  return RunLayers(chunks, cache, {}, on_layer_done, &logits, nullptr, int(layers_.size()));
}

absl::Status LlamaCuda::ForwardSample(absl::Span<const SequenceChunk> chunks, KvCache& cache,
                                      absl::Span<const DeviceSamplingRow> rows, std::vector<DeviceSample>& samples,
                                      const LayerDoneCallback& on_layer_done) {
  return RunLayers(chunks, cache, rows, on_layer_done, nullptr, &samples, int(layers_.size()));
}

absl::Status LlamaCuda::MoveKvSlots(KvCache& kv_cache, absl::Span<const int32_t> block_table,
                                   absl::Span<const KvSlotMove> moves) {
  auto* cache = dynamic_cast<cuda::DeviceKvCache*>(&kv_cache);
  if (cache == nullptr) return absl::InvalidArgumentError("the CUDA backend needs its own device KV cache");
  const int64_t bs = cache->shape().block_size;
  const int64_t capacity = int64_t(block_table.size()) * bs;
  for (const KvSlotMove& m : moves) {
    if (m.from < 0 || m.to < 0 || m.from >= capacity || m.to >= capacity) {
      return absl::InternalError("KV slot move outside the sequence's blocks");
    }
  }
  // Queued on the cache: a step's moves of all requests go in one launch before the next step.
  for (const KvSlotMove& m : moves) {
    cache->QueueSlotMove(int32_t(block_table[size_t(m.from / bs)] * bs + m.from % bs),
                         int32_t(block_table[size_t(m.to / bs)] * bs + m.to % bs));
  }
  return absl::OkStatus();
}

absl::Status LlamaCuda::WarmUpGraphs(KvCache& kv_cache, int32_t max_draft_tokens, int num_layers) {
  auto* cache = dynamic_cast<cuda::DeviceKvCache*>(&kv_cache);
  if (cache == nullptr) return absl::InvalidArgumentError("the CUDA backend needs its own device KV cache");
  if (!options_.cuda_graphs) return absl::OkStatus();
  const int max_tokens = std::min(max_logit_rows_, options_.max_num_batched_tokens);
  const int max_decode_batch = std::min(options_.max_num_seqs, options_.max_num_batched_tokens);
  for (int batch = 1; batch <= options_.max_num_seqs; batch = GraphBatchSize(batch + 1)) {
    // Speculation changes how many sequences a step decodes (requests finish at different
    // steps): every decode bucket's graph, every row padding.
    if (batch <= max_decode_batch) {
      StepPlan plan;
      plan.decode_only = true;
      metadata_host_.as<int32_t>()[layout_->q_start] = 0;
      PadForGraph(plan, batch);
      Upload(plan, {});
      if (absl::Status s = LaunchGraph(plan, *cache, /*sample=*/true, num_layers); !s.ok()) return s;
    }
    if (max_draft_tokens <= 0) continue;
    int fewest_seqs = batch;  // the fewest sequences a step of this bucket holds
    while (fewest_seqs > 1 && GraphBatchSize(fewest_seqs - 1) == batch) --fewest_seqs;
    const int most_tokens = batch * (1 + max_draft_tokens);
    for (int tokens = TreeGraphTokens(fewest_seqs + 1); tokens <= max_tokens; tokens = TreeGraphTokens(tokens + 1)) {
      // Every row and sequence is padding: the warm-up and capture runs write and read nothing.
      StepPlan plan;
      plan.has_trees = true;
      metadata_host_.as<int32_t>()[layout_->q_start] = 0;
      PadTreeStepForGraph(plan, batch, tokens);
      Upload(plan, {});
      if (absl::Status s = LaunchGraph(plan, *cache, /*sample=*/true, num_layers); !s.ok()) return s;
      if (tokens >= most_tokens) break;
    }
  }
  return cuda::CudaStatus(cudaStreamSynchronize(stream_), "graph warm-up");
}

namespace {

// The first layers of a LlamaCuda as a draft model, sharing its weights, buffers, stream and
// KV cache (it runs between the target's steps, never beside them).
class LlamaCudaLayerPrefix : public ModelExecutor {
 public:
  LlamaCudaLayerPrefix(LlamaCuda& model, int num_layers) : model_(model), num_layers_(num_layers) {}

  const ModelConfig& config() const override { return model_.config(); }
  KvDtype kv_dtype() const override { return model_.kv_dtype(); }
  std::unique_ptr<KvCache> CreateKvCache(int64_t num_blocks, int64_t block_size) override {
    return model_.CreateKvCache(num_blocks, block_size);
  }
  absl::Status Forward(absl::Span<const SequenceChunk> chunks, KvCache& cache, std::vector<float>& logits,
                       const LayerDoneCallback& on_layer_done = nullptr) override {
    return model_.RunLayers(chunks, cache, {}, on_layer_done, &logits, nullptr, num_layers_);
  }
  bool CanSampleOnDevice() const override { return true; }
  absl::Status ForwardSample(absl::Span<const SequenceChunk> chunks, KvCache& cache,
                             absl::Span<const DeviceSamplingRow> rows, std::vector<DeviceSample>& samples,
                             const LayerDoneCallback& on_layer_done = nullptr) override {
    return model_.RunLayers(chunks, cache, rows, on_layer_done, nullptr, &samples, num_layers_);
  }
  bool SupportsTreeAttention() const override { return true; }
  absl::Status MoveKvSlots(KvCache& cache, absl::Span<const int32_t> block_table,
                           absl::Span<const KvSlotMove> moves) override {
    return model_.MoveKvSlots(cache, block_table, moves);
  }
  absl::Status WarmUpVerification(KvCache& cache, int32_t max_draft_tokens) override {
    return model_.WarmUpGraphs(cache, max_draft_tokens, num_layers_);
  }
  int64_t num_one_time_setups() const override { return model_.num_one_time_setups(); }

 private:
  LlamaCuda& model_;
  int num_layers_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ModelExecutor>> LlamaCuda::LayerPrefix(int64_t num_layers) {
  if (absl::Status s = CheckLayerPrefix(config_, num_layers); !s.ok()) return s;
  return std::make_unique<LlamaCudaLayerPrefix>(*this, int(num_layers));
}

}  // namespace duet

#include "backends/cuda/llama_cuda.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "backends/cuda/sequence_parallel_group.h"
#include "common/check.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/attention/mixed_attention.h"
#include "kernels/attention/prefill_attention.h"
#include "kernels/elementwise/activation.h"
#include "kernels/elementwise/bias.h"
#include "kernels/elementwise/gather_rows.h"
#include "kernels/elementwise/norm.h"
#include "kernels/elementwise/random_fill.h"
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

}  // namespace

LlamaCuda::LlamaCuda(const ModelConfig& config, const LlamaCudaOptions& options)
    : config_(config), options_(options) {
  if (options_.max_model_len <= 0) options_.max_model_len = config.max_position_embeddings;
}

LlamaCuda::~LlamaCuda() {
  graphs_.reset();
  linear_.reset();
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::StatusOr<std::unique_ptr<LlamaCuda>> LlamaCuda::Load(const std::string& model_dir,
                                                           const LlamaCudaOptions& options) {
  DUET_ASSIGN_OR_RETURN(const ModelConfig config, LoadModelConfig(model_dir));
  if (config.head_dim != 64 && config.head_dim != 128) {
    return absl::UnimplementedError(absl::StrCat("the CUDA backend supports head_dim 64 and 128, not ", config.head_dim));
  }
  if (config.mlp_bias) return absl::UnimplementedError("mlp_bias is not supported");
  if (options.max_num_seqs <= 0 || options.max_num_batched_tokens <= 0) {
    return absl::InvalidArgumentError("max_num_seqs and max_num_batched_tokens must be positive");
  }
  DUET_ASSIGN_OR_RETURN(const std::unique_ptr<WeightStore> weights, WeightStore::Open(model_dir));
  std::unique_ptr<LlamaCuda> model(new LlamaCuda(config, options));
  model->model_dir_ = model_dir;
  DUET_RETURN_IF_ERROR(model->Init(*weights));
  return model;
}

absl::StatusOr<std::unique_ptr<LlamaCuda>> LlamaCuda::LoadRank(int device, int max_rows) const {
  LlamaCudaOptions options = options_;
  options.device = device;
  options.max_num_seqs = 1;
  options.max_num_batched_tokens = max_rows;
  options.max_logit_rows = 1;
  options.cuda_graphs = false;
  std::unique_ptr<LlamaCuda> model(new LlamaCuda(config_, options));
  model->model_dir_ = model_dir_;
  cuda::ScopedDevice on(device);
  DUET_RETURN_IF_ERROR(model->InitDevice());
  if (device == options_.device) {
    model->weights_ = weights_;  // ranks on one GPU share one copy
  } else {
    DUET_ASSIGN_OR_RETURN(const std::unique_ptr<WeightStore> store, WeightStore::Open(model_dir_));
    DUET_ASSIGN_OR_RETURN(cuda::CudaWeights uploaded, cuda::CudaWeights::Upload(*store, config_, model->arena_));
    model->weights_ = std::make_shared<const cuda::CudaWeights>(std::move(uploaded));
  }
  DUET_RETURN_IF_ERROR(model->UploadRopeTable());
  DUET_RETURN_IF_ERROR(model->AllocateActivations());
  DUET_RETURN_IF_ERROR(cuda::CudaStatus(cudaDeviceSynchronize(), "loading a sequence-parallel rank"));
  return model;
}

absl::Status LlamaCuda::Init(const WeightStore& weights) {
  DUET_RETURN_IF_ERROR(InitDevice());
  DUET_ASSIGN_OR_RETURN(cuda::CudaWeights uploaded, cuda::CudaWeights::Upload(weights, config_, arena_));
  weights_ = std::make_shared<const cuda::CudaWeights>(std::move(uploaded));
  DUET_RETURN_IF_ERROR(UploadRopeTable());
  DUET_RETURN_IF_ERROR(AllocateActivations());
  DUET_RETURN_IF_ERROR(TuneProjections());
  // The uploads and memsets above went through the legacy default stream, which stream_ (a
  // non-blocking stream) does not wait for: they land before the first step.
  return cuda::CudaStatus(cudaDeviceSynchronize(), "loading the model");
}

absl::Status LlamaCuda::InitDevice() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError("no CUDA device is available");
  }
  if (options_.device < 0 || options_.device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device ", options_.device, " does not exist (", count, " found)"));
  }
  DUET_RETURN_IF_ERROR(cuda::CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"));
  cudaDeviceProp prop{};
  DUET_RETURN_IF_ERROR(cuda::CudaStatus(cudaGetDeviceProperties(&prop, options_.device), "device properties"));
  if (prop.major < 8) return absl::FailedPreconditionError("the CUDA backend needs compute capability 8.0 or newer");
  num_sms_ = prop.multiProcessorCount;
  kernels::SetProgrammaticLaunch(options_.programmatic_launch && prop.major >= 9);
  DUET_RETURN_IF_ERROR(cuda::CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream"));
  graphs_ = std::make_unique<cuda::GraphRunner>(stream_);
  DUET_ASSIGN_OR_RETURN(cublas_workspace_, arena_.Allocate(kCublasWorkspaceBytes, "cuBLAS workspace"));
  DUET_ASSIGN_OR_RETURN(cuda::CublasLinear linear,
                        cuda::CublasLinear::Create(stream_, cublas_workspace_.get(), cublas_workspace_.bytes(),
                                                   options_.skinny_gemm_max_rows, options_.wide_gemm_min_rows));
  linear_ = std::make_unique<cuda::CublasLinear>(std::move(linear));
  return absl::OkStatus();
}

absl::Status LlamaCuda::UploadRopeTable() {
  const std::vector<float> inv_freq = config_.rope.InverseFrequencies(static_cast<int>(config_.head_dim));
  const std::vector<float2> table = kernels::BuildRopeTable(inv_freq, static_cast<int>(options_.max_model_len));
  DUET_ASSIGN_OR_RETURN(rope_table_, arena_.Allocate(table.size() * sizeof(float2), "RoPE table"));
  return cuda::CudaStatus(
      cudaMemcpy(rope_table_.get(), table.data(), table.size() * sizeof(float2), cudaMemcpyHostToDevice),
      "RoPE upload");
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
    DUET_ASSIGN_OR_RETURN(*w.into, arena_.Allocate(size_t(w.bytes), w.what));
  }
  // Padding rows of verification graphs keep whatever attention output a row last had: finite
  // from the start.
  DUET_RETURN_IF_ERROR(cuda::CudaStatus(cudaMemset(attn_.get(), 0, attn_.bytes()), "attention output memset"));
  if (decode_split_counters_count_ > 0) {
    DUET_RETURN_IF_ERROR(cuda::CudaStatus(
        cudaMemset(decode_split_counters_.get(), 0, size_t(decode_split_counters_count_) * 4), "split counters"));
  }
  DUET_RETURN_IF_ERROR(launched_samples_.Init(t));  // the samples of steps launched ahead
  // Logits of one head pass, or every row's sampled token and logprob (up to t rows each).
  // Host logits travel through it in passes of max_num_seqs rows; sampled tokens and logprobs
  // (up to t rows each) in one.
  return results_host_.Resize(std::max(size_t(options_.max_num_seqs) * size_t(c.vocab_size), 2 * size_t(t) + 8) * 4);
}

absl::Status LlamaCuda::TuneProjections() {
  const ModelConfig& c = config_;
  const int max_rows = std::min<int>(options_.gemm_tuning_max_rows, options_.max_num_batched_tokens);
  if (max_rows <= 0) return absl::OkStatus();
  const int hidden = int(c.hidden_size), inter = int(c.intermediate_size);
  const int qkv_width = int((c.num_heads + 2 * c.num_kv_heads) * c.head_dim), q_width = int(c.num_heads * c.head_dim);
  struct Projection {
    int in, out;
    std::vector<const __nv_bfloat16*> weights;  // one per layer
  };
  std::vector<Projection> projections = {{hidden, qkv_width, {}}, {q_width, hidden, {}}, {hidden, 2 * inter, {}},
                                         {inter, hidden, {}}};
  for (size_t l = 0; l < weights_->num_layers(); ++l) {
    const cuda::CudaLayerWeights& w = weights_->layer(l);
    projections[0].weights.push_back(w.qkv);
    projections[1].weights.push_back(w.o);
    projections[2].weights.push_back(w.gate_up);
    projections[3].weights.push_back(w.down);
  }
  // Scratch: act_ holds [T, inter] (every projection's input fits), gate_up_ [T, 2 * inter]. The
  // input is random, as activations are: on zeros the products draw less power and run faster
  // than they do in a step (kernels/elementwise/random_fill.h).
  kernels::FillRandomBf16(act_.as<__nv_bfloat16>(), act_.bytes() / sizeof(__nv_bfloat16), /*seed=*/1, 1.f, stream_);
  const __nv_bfloat16* x = act_.as<__nv_bfloat16>();
  __nv_bfloat16* y = gate_up_.as<__nv_bfloat16>();
  const auto started = std::chrono::steady_clock::now();
  double default_us = 0, tuned_us = 0;
  int kept = 0;
  for (int rows = cuda::kCublasRowQuantum; rows <= max_rows; rows += cuda::kCublasRowQuantum) {
    if (!linear_->RunsOnCublas(rows)) continue;
    for (const Projection& p : projections) {
      DUET_ASSIGN_OR_RETURN(cuda::GemmTuning::Result r, linear_->Tune(rows, p.in, p.out, p.weights, x, y,
                                                                            options_.gemm_tuning_max_time_ratio));
      default_us += r.default_us;
      tuned_us += r.kept ? r.best_us : r.default_us;
      kept += r.kept ? 1 : 0;
      gemm_tuning_.push_back(std::move(r));
    }
  }
  if (gemm_tuning_.empty()) return absl::OkStatus();
  DUET_LOG(INFO) << "GEMM tuning: " << gemm_tuning_.size() << " projection shapes of up to " << max_rows << " rows in "
                 << absl::StrFormat("%.1f", std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count())
                 << " s; cuBLASLt's fastest candidate runs " << kept << " of them (their sum per layer: "
                 << absl::StrFormat("%.0f us with cuBLAS's default, %.0f tuned", default_us, tuned_us) << ")";
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

absl::StatusOr<std::unique_ptr<cuda::DeviceKvCache>> LlamaCuda::CreateDeviceKvCache(int64_t num_blocks,
                                                                                    int64_t block_size) {
  DUET_RETURN_IF_ERROR(CreateStepMetadata(int(block_size)));
  return cuda::DeviceKvCache::Create(KvCacheShape{config_.num_layers, num_blocks, config_.num_kv_heads, block_size,
                                                  config_.head_dim, KvDtype::kBFloat16},
                                     arena_, stream_);
}

absl::Status LlamaCuda::CreateStepMetadata(int block_size) {
  DUET_CHECK(block_size > 0 && (block_size & (block_size - 1)) == 0);
  const cuda::StepLimits limits{options_.max_num_seqs, options_.max_num_batched_tokens, options_.max_model_len,
                                config_.vocab_size};
  DUET_ASSIGN_OR_RETURN(metadata_, cuda::StepMetadata::Create(limits, block_size, arena_));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<KvCache>> LlamaCuda::CreateKvCache(int64_t num_blocks, int64_t block_size) {
  DUET_ASSIGN_OR_RETURN(std::unique_ptr<cuda::DeviceKvCache> cache, CreateDeviceKvCache(num_blocks, block_size));
  return std::unique_ptr<KvCache>(std::move(cache));
}

absl::StatusOr<cuda::DeviceKvCache*> LlamaCuda::OwnCache(KvCache& kv_cache) const {
  auto* cache = dynamic_cast<cuda::DeviceKvCache*>(&kv_cache);
  if (cache == nullptr) return absl::InvalidArgumentError("the CUDA backend needs its own device KV cache");
  if (metadata_ == nullptr || cache->shape().block_size != metadata_->block_size()) {
    return absl::FailedPreconditionError("the KV cache passed to the CUDA executor was not created by it");
  }
  return cache;
}

bool LlamaCuda::PadForGraphIfEligible(cuda::StepPlan& plan, bool layer_callbacks) const {
  using cuda::GraphBatchSize;
  using cuda::TreeGraphTokens;
  const bool graphs = options_.cuda_graphs && !layer_callbacks && GraphBatchSize(plan.num_seqs) <= options_.max_num_seqs;
  const bool decode_graph = graphs && plan.decode_only && GraphBatchSize(plan.num_seqs) <= options_.max_num_batched_tokens;
  // A verification step (draft trees beside one-token chunks, every row giving logits) whose
  // padded rows fit one logits pass.
  const bool tree_graph = graphs && plan.has_trees && plan.num_logit_rows == plan.num_tokens &&
                          plan.max_q_len <= cuda::kTreeGraphMaxChunkTokens &&
                          TreeGraphTokens(plan.num_tokens) <= std::min(max_logit_rows_, options_.max_num_batched_tokens);
  if (decode_graph) metadata_->PadForGraph(plan, GraphBatchSize(plan.num_seqs));
  if (tree_graph) metadata_->PadTreeStepForGraph(plan, GraphBatchSize(plan.num_seqs), TreeGraphTokens(plan.num_tokens));
  return decode_graph || tree_graph;
}

absl::Status LlamaCuda::LaunchGraph(const cuda::StepPlan& plan, cuda::DeviceKvCache& cache, bool sample,
                                    int num_layers) {
  return graphs_->Launch({plan.graph_batch, plan.graph_tokens, sample, num_layers}, cache,
                         [&] { Enqueue(plan, cache, sample, {}, nullptr, num_layers); });
}

kernels::PagedDecodeAttentionPlan LlamaCuda::PlanDecodeAttention(const cuda::StepPlan& plan) const {
  const int num_seqs = plan.num_decode_kernel_seqs();
  if (num_seqs == 0) return {};
  const int nh = int(config_.num_heads), nkv = int(config_.num_kv_heads), hd = int(config_.head_dim);
  const int planned_context = plan.graph_batch > 0 ? int(options_.max_model_len) : plan.max_context_len;
  kernels::PagedDecodeAttentionPlan decode_plan =
      kernels::PlanPagedDecodeAttention(num_seqs, nh, nkv, hd, planned_context, num_sms_);
  if (decode_plan.workspace_bytes > decode_workspace_bytes_) {
    decode_plan = kernels::PlanPagedDecodeAttention(num_seqs, nh, nkv, hd, int(options_.max_model_len), num_sms_);
  }
  DUET_CHECK(decode_plan.workspace_bytes <= decode_workspace_bytes_);
  return decode_plan;
}

bool LlamaCuda::UseFusedEpilogues(int rows) const {
  return options_.fused_decode_epilogues && rows <= kernels::kGemvPreferredMaxRows;
}

void LlamaCuda::Enqueue(const cuda::StepPlan& plan, cuda::DeviceKvCache& cache, bool sample,
                        absl::Span<const SequenceChunk> chunks, const LayerDoneCallback& on_layer_done,
                        int num_layers) {
  const kernels::PagedDecodeAttentionPlan decode_plan = PlanDecodeAttention(plan);
  kernels::EmbeddingGather(metadata_->tokens(), weights_->embed(), residual_.as<float>(), plan.num_tokens,
                           int(config_.hidden_size), stream_);
  const LayerRows last_rows = LastLayerRows(plan);
  for (int li = 0; li < num_layers; ++li) {
    const cuda::CudaLayerWeights& l = weights_->layer(size_t(li));
    const LayerRows rows = li + 1 == num_layers ? last_rows : AllRows(plan.num_tokens);
    if (li == num_layers / 2) launched_samples_.MarkMidpoint(stream_);
    EnqueueAttention(l, li, plan, decode_plan, cache.Layer(li), rows);
    EnqueueMlp(l, rows);
    // The layer's K/V are in the cache once the stream reaches here; the hook orders its reads
    // after this point of the stream (LayerDoneCallback), so the host does not wait.
    if (on_layer_done) on_layer_done(int64_t(li), chunks);
  }
  EnqueueFinalNorm(plan, sample, last_rows);
}

LlamaCuda::LayerRows LlamaCuda::LastLayerRows(const cuda::StepPlan& plan) const {
  if (options_.last_layer_logit_rows_only && plan.graph_batch == 0 && plan.num_logit_rows < plan.num_tokens) {
    return {plan.num_logit_rows, metadata_->logit_rows()};
  }
  return AllRows(plan.num_tokens);
}

void LlamaCuda::EnqueueAttention(const cuda::CudaLayerWeights& l, int layer, const cuda::StepPlan& plan,
                                 const kernels::PagedDecodeAttentionPlan& decode_plan,
                                 const kernels::PagedKvView& kv, LayerRows out_rows) {
  const int t = plan.num_tokens;
  if (sp_step_) {
    const kernels::PagedKvView ring_view = ring_->send_view();
    EnqueueAttentionInput(l, layer == 0, t, kv, RingKvWrite{&ring_view, ring_->send_slots()});
  } else {
    EnqueueAttentionInput(l, layer == 0, t, kv);
  }
  EnqueueAttentionKernel(plan, decode_plan, kv, layer);
  EnqueueAttentionOutput(l, out_rows);
}

void LlamaCuda::EnqueueAttentionInput(const cuda::CudaLayerWeights& l, bool first_layer, int rows,
                                      const kernels::PagedKvView& kv, RingKvWrite ring) {
  kernels::FusedAddRmsNorm({residual_.as<float>(), first_layer ? nullptr : delta_.as<__nv_bfloat16>(), l.input_norm,
                            nullptr, normed_.as<__nv_bfloat16>(), rows, int(config_.hidden_size),
                            float(config_.rms_norm_eps)},
                           stream_);
  EnqueueQkvRopeKvWrite(l, rows, kv, ring);
}

void LlamaCuda::EnqueueAttentionOutput(const cuda::CudaLayerWeights& l, LayerRows rows) {
  if (rows.count == 0) return;  // a last layer without logits rows (a prompt's earlier chunk)
  const int hidden = int(config_.hidden_size);
  const int q_width = int(config_.num_heads * config_.head_dim);
  auto* delta = delta_.as<__nv_bfloat16>();
  const __nv_bfloat16* attn = attn_.as<__nv_bfloat16>();
  if (rows.index != nullptr) {  // q_ is free once the attention has read it
    kernels::GatherRows(attn, rows.index, q_.as<__nv_bfloat16>(), rows.count, q_width, stream_);
    attn = q_.as<__nv_bfloat16>();
  }
  linear_->Forward(attn, l.o, delta, rows.count, q_width, hidden);
  if (l.o_bias != nullptr) kernels::AddBias(delta, l.o_bias, rows.count, hidden, stream_);
}

void LlamaCuda::EnqueueQkvRopeKvWrite(const cuda::CudaLayerWeights& l, int rows, const kernels::PagedKvView& kv,
                                      RingKvWrite ring) {
  const int hidden = int(config_.hidden_size), nh = int(config_.num_heads);
  const int qkv_width = int((config_.num_heads + 2 * config_.num_kv_heads) * config_.head_dim);
  const auto* normed = normed_.as<__nv_bfloat16>();
  auto* q = q_.as<__nv_bfloat16>();
  if (UseFusedEpilogues(rows) && l.qkv_bias == nullptr && ring.view == nullptr) {
    // Skinny batches: RoPE and the KV write in the projection's epilogue (no qkv round trip).
    kernels::GemvParams g{normed, l.qkv, nullptr, rows, hidden, qkv_width, false, kernels::GemvEpilogue::kRopeKvWrite};
    g.rope = {metadata_->positions(), metadata_->slots(), rope_table_.as<float2>(), q, kv, nh};
    kernels::Gemv(g, stream_);
    return;
  }
  auto* qkv = qkv_.as<__nv_bfloat16>();
  linear_->Forward(normed, l.qkv, qkv, rows, hidden, qkv_width);
  if (l.qkv_bias != nullptr) kernels::AddBias(qkv, l.qkv_bias, rows, qkv_width, stream_);
  kernels::RopeAndWriteKv({qkv, metadata_->positions(), metadata_->slots(), rope_table_.as<float2>(), q, kv, rows, nh},
                          stream_);
  if (ring.view != nullptr) {
    // The rows' K/V also go to the ring's send block (q is rewritten with the same values).
    kernels::RopeAndWriteKv({qkv, metadata_->positions(), ring.slots, rope_table_.as<float2>(), q, *ring.view, rows, nh},
                            stream_);
  }
}

// The step's first `plan.num_decode_kernel_seqs()` sequences have one query row each (rows
// 0 .. num_decode - 1): the decode kernel's.
kernels::PagedDecodeAttentionParams LlamaCuda::DecodeKernelParams(const cuda::StepPlan& plan,
                                                                  const kernels::PagedKvView& kv, float scale) {
  kernels::PagedDecodeAttentionParams p{};
  p.q = q_.as<__nv_bfloat16>();
  p.kv = kv;
  p.block_tables = metadata_->block_tables();
  p.context_lens = metadata_->context_lens();
  p.out = attn_.as<__nv_bfloat16>();
  p.num_seqs = plan.num_decode_kernel_seqs();
  p.num_q_heads = int(config_.num_heads);
  p.max_blocks_per_seq = metadata_->max_blocks_per_seq();
  p.scale = scale;
  p.workspace = decode_workspace_.as<float>();
  p.split_counters = decode_split_counters_.as<int32_t>();
  return p;
}

// The other sequences (prompt chunks, draft trees): their metadata from sequence num_decode on
// (q_start holds absolute rows).
kernels::PrefillAttentionParams LlamaCuda::PrefillKernelParams(const cuda::StepPlan& plan,
                                                               const kernels::PagedKvView& kv, float scale) {
  const size_t first = size_t(plan.num_decode_kernel_seqs());
  kernels::PrefillAttentionParams p{};
  p.q = q_.as<__nv_bfloat16>();
  p.kv = kv;
  p.block_tables = metadata_->block_tables() + first * size_t(metadata_->max_blocks_per_seq());
  p.q_start = metadata_->q_start() + first;
  p.context_lens = metadata_->context_lens() + first;
  p.tree_masks = plan.has_trees ? metadata_->tree_masks() : nullptr;
  p.out = attn_.as<__nv_bfloat16>();
  p.num_seqs = plan.num_seqs - int(first);
  p.num_q_tokens = plan.num_tokens;
  p.max_q_len = plan.max_q_len;
  p.num_q_heads = int(config_.num_heads);
  p.max_blocks_per_seq = metadata_->max_blocks_per_seq();
  p.scale = scale;
  return p;
}

void LlamaCuda::EnqueueAttentionKernel(const cuda::StepPlan& plan,
                                       const kernels::PagedDecodeAttentionPlan& decode_plan,
                                       const kernels::PagedKvView& kv, int layer) {
  const float scale = 1.0f / std::sqrt(float(config_.head_dim));
  if (sp_step_) {
    ring_->Attend(q_.as<__nv_bfloat16>(), scale, attn_.as<__nv_bfloat16>(),
                  layer == ring_events_layer_ ? ring_events_ : nullptr);
    return;
  }
  const int num_decode = plan.num_decode_kernel_seqs();
  if (plan.num_seqs == 0) return;
  if (num_decode == plan.num_seqs) {
    kernels::PagedDecodeAttention(DecodeKernelParams(plan, kv, scale), decode_plan, stream_);
  } else if (num_decode == 0) {
    kernels::PrefillAttention(PrefillKernelParams(plan, kv, scale), stream_);
  } else if (options_.mixed_attention_launch) {
    kernels::MixedAttention(DecodeKernelParams(plan, kv, scale), decode_plan, PrefillKernelParams(plan, kv, scale),
                            stream_);
  } else {
    kernels::PagedDecodeAttention(DecodeKernelParams(plan, kv, scale), decode_plan, stream_);
    kernels::PrefillAttention(PrefillKernelParams(plan, kv, scale), stream_);
  }
}

void LlamaCuda::EnqueueMlp(const cuda::CudaLayerWeights& l, LayerRows mlp_rows) {
  const int hidden = int(config_.hidden_size), inter = int(config_.intermediate_size);
  const int rows = mlp_rows.count;
  if (rows == 0) return;
  auto* normed = normed_.as<__nv_bfloat16>();
  auto* gate_up = gate_up_.as<__nv_bfloat16>();
  auto* act = act_.as<__nv_bfloat16>();
  kernels::FusedAddRmsNorm({residual_.as<float>(), delta_.as<__nv_bfloat16>(), l.post_norm, mlp_rows.index, normed,
                            rows, hidden, float(config_.rms_norm_eps)},
                           stream_);
  // CublasLinear fuses SiLU·mul where its kernel can (Gemv's rows and WideGemm's).
  if (UseFusedEpilogues(rows) || rows > kernels::kGemvPreferredMaxRows) {
    linear_->ForwardSiluMul(normed, l.gate_up, gate_up, act, rows, hidden, inter);
  } else {
    linear_->Forward(normed, l.gate_up, gate_up, rows, hidden, 2 * inter);
    kernels::SiluAndMul(gate_up, act, rows, inter, stream_);
  }
  linear_->Forward(act, l.down, delta_.as<__nv_bfloat16>(), rows, inter, hidden);
}

void LlamaCuda::EnqueueFinalNorm(const cuda::StepPlan& plan, bool sample, LayerRows last_rows) {
  const int t = plan.num_tokens, hidden = int(config_.hidden_size);
  const float eps = float(config_.rms_norm_eps);
  auto* residual = residual_.as<float>();
  auto* delta = delta_.as<__nv_bfloat16>();
  if (plan.graph_batch == 0) {
    // The last MLP output joins the residual stream (the normalized copy is unused); EagerHead
    // normalizes the rows that give logits.
    kernels::FusedAddRmsNorm({residual, delta, weights_->final_norm(), last_rows.index, normed_.as<__nv_bfloat16>(),
                              last_rows.count, hidden, eps},
                             stream_);
    return;
  }
  // A graph's step: row i gives logits row i, and they all fit one head pass, so the last MLP
  // output joins the residual stream and the final norm writes the head's input in one kernel.
  DUET_CHECK(plan.num_logit_rows == t && t <= max_logit_rows_ && last_rows.index == nullptr);
  auto* final_normed = final_normed_.as<__nv_bfloat16>();
  kernels::FusedAddRmsNorm({residual, delta, weights_->final_norm(), nullptr, final_normed, t, hidden, eps}, stream_);
  linear_->ForwardF32(final_normed, weights_->lm_head(), logits_.as<float>(), plan.num_logit_rows, hidden,
                      int(config_.vocab_size));
  if (sample) EnqueueSampling(0, plan.num_logit_rows);
}

void LlamaCuda::EnqueueSampling(int first_row, int rows) {
  const cuda::StepMetadata& m = *metadata_;
  const int r = first_row;
  kernels::SampleTokens({logits_.as<float>(), rows, int(config_.vocab_size), m.temperature() + r, m.top_k() + r,
                         m.top_p() + r, m.min_p() + r, m.seeds() + r, m.offsets() + r, m.sampled_tokens() + r,
                         m.sampled_logprobs() + r, m.token_bitmasks(), m.bitmask_index() + r, m.bitmask_words()},
                        stream_);
}

absl::Status LlamaCuda::EagerHead(const cuda::StepPlan& plan, bool sample, std::vector<float>* logits) {
  const int64_t vocab = config_.vocab_size;
  for (int begin = 0; begin < plan.num_logit_rows; begin += max_logit_rows_) {
    const int rows = std::min(max_logit_rows_, plan.num_logit_rows - begin);
    kernels::FusedAddRmsNorm({residual_.as<float>(), nullptr, weights_->final_norm(), metadata_->logit_rows() + begin,
                              final_normed_.as<__nv_bfloat16>(), rows, int(config_.hidden_size),
                              float(config_.rms_norm_eps)},
                             stream_);
    linear_->ForwardF32(final_normed_.as<__nv_bfloat16>(), weights_->lm_head(), logits_.as<float>(), rows,
                        int(config_.hidden_size), int(vocab));
    if (sample) {
      EnqueueSampling(begin, rows);
      continue;
    }
    DUET_RETURN_IF_ERROR(CopyLogitsToHost(rows, logits->data() + size_t(begin) * size_t(vocab)));
  }
  return absl::OkStatus();
}

absl::Status LlamaCuda::CopyLogitsToHost(int rows, float* dst) {
  const size_t vocab = size_t(config_.vocab_size);
  for (int begin = 0; begin < rows; begin += options_.max_num_seqs) {
    const size_t bytes = size_t(std::min(options_.max_num_seqs, rows - begin)) * vocab * sizeof(float);
    DUET_RETURN_IF_ERROR(cuda::CudaStatus(cudaMemcpyAsync(results_host_.as<float>(), logits_.as<float>() + begin * vocab,
                                                          bytes, cudaMemcpyDeviceToHost, stream_),
                                          "logits copy"));
    DUET_RETURN_IF_ERROR(cuda::CudaStatus(cudaStreamSynchronize(stream_), "step"));
    std::memcpy(dst + begin * vocab, results_host_.as<float>(), bytes);
  }
  return absl::OkStatus();
}

absl::Status LlamaCuda::CopySamplesToHost(int rows, std::vector<DeviceSample>& samples) {
  int32_t* tokens = results_host_.as<int32_t>();
  auto* logprobs = reinterpret_cast<float*>(tokens + rows);
  DUET_CHECK_CUDA(cudaMemcpyAsync(tokens, metadata_->sampled_tokens(), size_t(rows) * 4, cudaMemcpyDeviceToHost,
                                  stream_));
  DUET_CHECK_CUDA(cudaMemcpyAsync(logprobs, metadata_->sampled_logprobs(), size_t(rows) * 4, cudaMemcpyDeviceToHost,
                                  stream_));
  DUET_RETURN_IF_ERROR(cuda::CudaStatus(cudaStreamSynchronize(stream_), "step"));
  samples.resize(size_t(rows));
  for (int i = 0; i < rows; ++i) samples[size_t(i)] = DeviceSample{tokens[i], logprobs[i]};
  return absl::OkStatus();
}

absl::Status LlamaCuda::RunLayers(absl::Span<const SequenceChunk> chunks, KvCache& kv_cache,
                                  absl::Span<const DeviceSamplingRow> sampling, const LayerDoneCallback& on_layer_done,
                                  std::vector<float>* logits, std::vector<DeviceSample>* samples, int num_layers,
                                  const FillMasksCallback& fill_masks, bool launch_ahead) {
  DUET_CHECK(num_layers >= 1 && num_layers <= int(weights_->num_layers()));
  DUET_ASSIGN_OR_RETURN(cuda::DeviceKvCache* const cache, OwnCache(kv_cache));
  if (launch_ahead ? launched_samples_.full() : !launched_samples_.empty()) {
    return absl::FailedPreconditionError(launch_ahead ? "two launched steps are not collected yet"
                                                      : "a step launched ahead is not collected yet");
  }
  if (group_ != nullptr && num_layers == int(weights_->num_layers()) && group_->Takes(chunks)) {
    return group_->Prefill(chunks, *cache, sampling, on_layer_done, logits, samples, fill_masks);
  }
  DUET_ASSIGN_OR_RETURN(cuda::StepPlan plan, metadata_->Plan(chunks, /*previous_samples=*/launch_ahead));
  const bool sample = samples != nullptr || launch_ahead;
  const int real_rows = plan.num_logit_rows;
  if (sample && size_t(real_rows) != sampling.size()) {
    return absl::InvalidArgumentError(absl::StrCat("device sampling needs one row per logits row (", real_rows,
                                                   " rows, ", sampling.size(), " given)"));
  }
  sp_step_ = RunsSequenceParallel(chunks);
  struct EndOfStep {  // no other step (a graph capture, say) may see a sequence-parallel flag
    bool& sp_step;
    ~EndOfStep() { sp_step = false; }
  } end_of_step{sp_step_};
  if (sp_step_) {
    const parallel::RingAttentionSchedule schedule =
        parallel::PlanRingAttention(int64_t(chunks[0].tokens.size()), ring_->size());
    metadata_->ReorderRows(plan, schedule.RowPositions());
    DUET_RETURN_IF_ERROR(ring_->Prepare(schedule));
  }
  const bool use_graph = !sp_step_ && PadForGraphIfEligible(plan, bool(on_layer_done));
  cache->FlushSlotMoves();
  // Masks filled by the caller go up once the model's work is enqueued, before the sampling.
  const bool masks_later = sample && fill_masks != nullptr;
  metadata_->Upload(plan, sampling, stream_, /*with_bitmasks=*/!masks_later);
  metadata_->ResolvePreviousSamples(plan, stream_);
  auto upload_masks = [&] {
    fill_masks();
    metadata_->UploadBitmasks(sampling, stream_);
  };

  if (!sample) logits->resize(size_t(real_rows) * size_t(config_.vocab_size));
  if (use_graph && masks_later) {  // the logits graph, then the sampling outside it
    DUET_RETURN_IF_ERROR(LaunchGraph(plan, *cache, /*sample=*/false, num_layers));
    upload_masks();
    EnqueueSampling(0, plan.num_logit_rows);
  } else if (use_graph) {
    DUET_RETURN_IF_ERROR(LaunchGraph(plan, *cache, sample, num_layers));
    if (!sample) DUET_RETURN_IF_ERROR(CopyLogitsToHost(real_rows, logits->data()));
  } else {
    Enqueue(plan, *cache, sample, chunks, on_layer_done, num_layers);
    if (masks_later) upload_masks();
    DUET_RETURN_IF_ERROR(EagerHead(plan, sample, logits));
  }
  if (launch_ahead) {
    return launched_samples_.Enqueue(metadata_->sampled_tokens(), metadata_->sampled_logprobs(), real_rows, stream_);
  }
  if (sample) return CopySamplesToHost(real_rows, *samples);
  return absl::OkStatus();
}

absl::Status LlamaCuda::EnableSequenceParallel(int ranks, int64_t min_tokens, const std::vector<int>& devices,
                                               const std::string& transport) {
  ring_.reset();
  group_.reset();
  sp_min_tokens_ = min_tokens;
  if (!devices.empty()) {
    if (int(devices.size()) != ranks) {
      return absl::InvalidArgumentError(
          absl::StrCat(devices.size(), " devices for ", ranks, " sequence-parallel ranks: give one device per rank"));
    }
    if (devices[0] != options_.device) {
      return absl::InvalidArgumentError(absl::StrCat("rank 0 runs on this executor's device ", options_.device,
                                                     ", not device ", devices[0]));
    }
    if (ranks <= 1) return absl::OkStatus();
    DUET_ASSIGN_OR_RETURN(group_, cuda::SequenceParallelGroup::Create(*this, devices, min_tokens, transport));
    return absl::OkStatus();
  }
  if (ranks <= 1) return absl::OkStatus();
  DUET_ASSIGN_OR_RETURN(ring_, cuda::VirtualRingAttention::Create(ranks, options_.max_num_batched_tokens,
                                                                 int(config_.num_heads), int(config_.num_kv_heads),
                                                                 int(config_.head_dim), arena_, stream_));
  return absl::OkStatus();
}

int LlamaCuda::sequence_parallel_ranks() const {
  if (group_ != nullptr) return group_->size();
  return ring_ ? ring_->size() : 1;
}

std::vector<int> LlamaCuda::sequence_parallel_devices() const {
  return group_ != nullptr ? group_->devices() : std::vector<int>{};
}

bool LlamaCuda::RunsSequenceParallel(absl::Span<const SequenceChunk> chunks) const {
  if (ring_ == nullptr || chunks.size() != 1) return false;
  const SequenceChunk& c = chunks[0];
  const int64_t n = int64_t(c.tokens.size());
  return c.start_position == 0 && c.tree_parents.empty() && n >= std::max<int64_t>(sp_min_tokens_, 2 * ring_->size());
}

absl::Status LlamaCuda::Forward(absl::Span<const SequenceChunk> chunks, KvCache& cache, std::vector<float>& logits,
                                const LayerDoneCallback& on_layer_done) {
  return RunLayers(chunks, cache, {}, on_layer_done, &logits, nullptr, int(weights_->num_layers()));
}

absl::Status LlamaCuda::ForwardSample(absl::Span<const SequenceChunk> chunks, KvCache& cache,
                                      absl::Span<const DeviceSamplingRow> rows, std::vector<DeviceSample>& samples,
                                      const LayerDoneCallback& on_layer_done, const FillMasksCallback& fill_masks) {
  return RunLayers(chunks, cache, rows, on_layer_done, nullptr, &samples, int(weights_->num_layers()), fill_masks);
}

absl::Status LlamaCuda::LaunchSample(absl::Span<const SequenceChunk> chunks, KvCache& cache,
                                     absl::Span<const DeviceSamplingRow> rows) {
  if (!CanLaunchAhead()) return absl::FailedPreconditionError("a sequence-parallel executor runs steps one at a time");
  return RunLayers(chunks, cache, rows, nullptr, nullptr, nullptr, int(weights_->num_layers()), nullptr,
                   /*launch_ahead=*/true);
}

absl::Status LlamaCuda::CollectSamples(std::vector<DeviceSample>& samples) { return launched_samples_.Collect(samples); }

absl::Status LlamaCuda::MoveKvSlots(KvCache& kv_cache, absl::Span<const int32_t> block_table,
                                   absl::Span<const KvSlotMove> moves) {
  DUET_ASSIGN_OR_RETURN(cuda::DeviceKvCache* const cache, OwnCache(kv_cache));
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
  using cuda::GraphBatchSize;
  using cuda::TreeGraphTokens;
  DUET_ASSIGN_OR_RETURN(cuda::DeviceKvCache* const cache, OwnCache(kv_cache));
  if (!options_.cuda_graphs) return absl::OkStatus();
  const int max_tokens = std::min(max_logit_rows_, options_.max_num_batched_tokens);
  const int max_decode_batch = std::min(options_.max_num_seqs, options_.max_num_batched_tokens);
  // Every row and sequence of the warm-up steps is padding: the eager and capture runs write
  // and read nothing.
  auto capture = [&](int batch, int tree_tokens) {
    const cuda::StepPlan plan = metadata_->PaddingOnly(batch, tree_tokens);
    metadata_->Upload(plan, {}, stream_);
    return LaunchGraph(plan, *cache, /*sample=*/true, num_layers);
  };
  for (int batch = 1; batch <= options_.max_num_seqs; batch = GraphBatchSize(batch + 1)) {
    // Speculation changes how many sequences a step decodes (requests finish at different
    // steps): every decode bucket's graph, every row padding.
    if (batch <= max_decode_batch) DUET_RETURN_IF_ERROR(capture(batch, 0));
    if (max_draft_tokens <= 0) continue;
    int fewest_seqs = batch;  // the fewest sequences a step of this bucket holds
    while (fewest_seqs > 1 && GraphBatchSize(fewest_seqs - 1) == batch) --fewest_seqs;
    const int most_tokens = batch * (1 + max_draft_tokens);
    for (int tokens = TreeGraphTokens(fewest_seqs + 1); tokens <= max_tokens; tokens = TreeGraphTokens(tokens + 1)) {
      DUET_RETURN_IF_ERROR(capture(batch, tokens));
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
  absl::StatusOr<std::unique_ptr<KvCache>> CreateKvCache(int64_t num_blocks, int64_t block_size) override {
    return model_.CreateKvCache(num_blocks, block_size);
  }
  absl::Status Forward(absl::Span<const SequenceChunk> chunks, KvCache& cache, std::vector<float>& logits,
                       const LayerDoneCallback& on_layer_done = nullptr) override {
    return model_.RunLayers(chunks, cache, {}, on_layer_done, &logits, nullptr, num_layers_);
  }
  bool CanSampleOnDevice() const override { return true; }
  absl::Status ForwardSample(absl::Span<const SequenceChunk> chunks, KvCache& cache,
                             absl::Span<const DeviceSamplingRow> rows, std::vector<DeviceSample>& samples,
                             const LayerDoneCallback& on_layer_done = nullptr,
                             const FillMasksCallback& fill_masks = nullptr) override {
    return model_.RunLayers(chunks, cache, rows, on_layer_done, nullptr, &samples, num_layers_, fill_masks);
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
  DUET_RETURN_IF_ERROR(CheckLayerPrefix(config_, num_layers));
  return std::make_unique<LlamaCudaLayerPrefix>(*this, int(num_layers));
}

}  // namespace duet

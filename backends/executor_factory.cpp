#include "backends/executor_factory.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "backends/cpu/llama_cpu.h"
#include "common/logging.h"
#include "model/model_config.h"
#ifdef DUET_HAVE_CUDA
#include "backends/cuda/device_memory.h"
#include "backends/cuda/llama_cuda.h"
#endif

namespace duet {

#ifdef DUET_HAVE_CUDA
namespace {

// A row count from the environment variable `name` when it is set, else `default_rows`. Two lets a
// benchmark compare kernel choices on one build:
//   $DUET_WIDE_GEMM_MIN_ROWS: bf16 products of at least this many rows go to WideGemm, 0 to none
//     (kernels/gemm/wide_gemm.h; default cuda::kWideGemmDefaultMinRows);
//   $DUET_GEMM_TUNING_MAX_ROWS: the projections' cuBLASLt algorithms are tuned at load up to this
//     many rows, 0: none (backends/cuda/gemm_tuning.h; default cuda::kGemmTuningDefaultMaxRows).
absl::StatusOr<int> RowsFromEnvironment(const char* name, int default_rows) {
  const char* env = std::getenv(name);
  if (env == nullptr) return default_rows;
  char* end = nullptr;
  const long rows = std::strtol(env, &end, 10);
  if (end == env || *end != '\0' || rows < 0 || rows > (1 << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(name, "=", env, " is not a row count (0 turns it off)"));
  }
  DUET_LOG(INFO) << name << "=" << rows;
  return int(rows);
}

// A switch from the environment variable `name` (0 or 1) when it is set, else `default_on`, for
// the same kind of comparison:
//   $DUET_LAST_LAYER_LOGIT_ROWS_ONLY: 0 runs the last layer's output projection and MLP on every
//     row of an eager step, 1 (the default) only on the rows that give logits.
absl::StatusOr<bool> SwitchFromEnvironment(const char* name, bool default_on) {
  const char* env = std::getenv(name);
  if (env == nullptr) return default_on;
  if (std::string_view(env) != "0" && std::string_view(env) != "1") {
    return absl::InvalidArgumentError(absl::StrCat(name, "=", env, " is not 0 or 1"));
  }
  DUET_LOG(INFO) << name << "=" << env;
  return env[0] == '1';
}

absl::StatusOr<std::unique_ptr<ModelExecutor>> LoadCudaExecutor(const EngineConfig& config) {
  LlamaCudaOptions options;
  absl::StatusOr<bool> last_layer_rows = SwitchFromEnvironment("DUET_LAST_LAYER_LOGIT_ROWS_ONLY", true);
  if (!last_layer_rows.ok()) return last_layer_rows.status();
  options.last_layer_logit_rows_only = *last_layer_rows;
  absl::StatusOr<int> wide_gemm_min_rows = RowsFromEnvironment("DUET_WIDE_GEMM_MIN_ROWS", cuda::kWideGemmDefaultMinRows);
  if (!wide_gemm_min_rows.ok()) return wide_gemm_min_rows.status();
  options.wide_gemm_min_rows = *wide_gemm_min_rows;
  absl::StatusOr<int> tuning_max_rows =
      RowsFromEnvironment("DUET_GEMM_TUNING_MAX_ROWS", cuda::kGemmTuningDefaultMaxRows);
  if (!tuning_max_rows.ok()) return tuning_max_rows.status();
  options.gemm_tuning_max_rows = *tuning_max_rows;
  const std::vector<int>& devices = config.sequence_parallel.devices;
  if (!devices.empty() && int(devices.size()) != config.sequence_parallel.ranks) {
    return absl::InvalidArgumentError(absl::StrCat("--devices names ", devices.size(), " GPUs for --sp-ranks ",
                                                   config.sequence_parallel.ranks, ": give one per rank"));
  }
  if (!devices.empty()) options.device = devices[0];
  options.max_num_seqs = config.scheduler.max_num_seqs;
  options.max_num_batched_tokens = config.scheduler.max_num_batched_tokens;
  options.max_model_len = config.scheduler.max_model_len;
  // Verification steps give a logits row per token: room for every sequence's draft tree in
  // one head pass, within 1 GiB of logits.
  if (absl::StatusOr<ModelConfig> m = LoadModelConfig(config.model_dir); m.ok()) {
    const int64_t rows = int64_t(options.max_num_seqs) * (1 + std::max(config.speculation.max_draft_tokens, 0));
    const int64_t cap = std::max<int64_t>(options.max_num_seqs, (int64_t(1) << 30) / (4 * m->vocab_size));
    options.max_logit_rows = int(std::min({rows, cap, int64_t(options.max_num_batched_tokens)}));
  }
  absl::StatusOr<std::unique_ptr<LlamaCuda>> cuda = LlamaCuda::Load(config.model_dir, options);
  if (!cuda.ok()) return cuda.status();
  // Without --devices the ranks are virtual (LlamaCuda::EnableSequenceParallel): the same
  // schedule and kernels a multi-GPU group runs, on one GPU; with them, one executor per rank.
  absl::Status sp = (*cuda)->EnableSequenceParallel(config.sequence_parallel.ranks, config.sequence_parallel.min_tokens,
                                                    devices, config.sequence_parallel.transport);
  if (!sp.ok()) return sp;
  if (config.sequence_parallel.ranks > 1) {
    DUET_LOG(INFO) << "sequence-parallel prefill: " << config.sequence_parallel.ranks << " ranks, "
                   << (devices.empty() ? "virtual on GPU " + std::to_string(options.device)
                                       : "one executor per rank on GPUs " + absl::StrJoin(devices, ",") +
                                             " (ring blocks by " + config.sequence_parallel.transport + ")")
                   << ", prompts of at least " << config.sequence_parallel.min_tokens << " tokens";
  }
  return std::unique_ptr<ModelExecutor>(std::move(*cuda));
}

}  // namespace
#endif

std::string ResolveBackend(const std::string& backend) {
  if (backend != "auto") return backend;
#ifdef DUET_HAVE_CUDA
  if (cuda::CudaDeviceAvailable()) return "cuda";
#endif
  return "cpu";
}

absl::StatusOr<std::unique_ptr<ModelExecutor>> LoadExecutor(const EngineConfig& config) {
  const std::string backend = ResolveBackend(config.backend);
  if (backend == "cpu") {
    if (!config.sequence_parallel.devices.empty()) {
      return absl::InvalidArgumentError("--devices is for the cuda backend (cpu ranks are threads)");
    }
    absl::StatusOr<std::unique_ptr<LlamaCpu>> cpu = LlamaCpu::Load(config.model_dir);
    if (cpu.ok()) (*cpu)->EnableSequenceParallel(config.sequence_parallel.ranks, config.sequence_parallel.min_tokens);
    return cpu;
  }
#ifdef DUET_HAVE_CUDA
  if (backend == "cuda") return LoadCudaExecutor(config);
  constexpr const char* kAvailable = "cpu or cuda";
#else
  constexpr const char* kAvailable = "cpu (this build has no CUDA)";
#endif
  return absl::UnimplementedError(
      absl::StrCat("backend '", config.backend, "' is not available; use ", kAvailable));
}

absl::StatusOr<std::unique_ptr<LlmEngine>> CreateEngine(const EngineConfig& config) {
  return LlmEngine::Create(config, LoadExecutor);
}

}  // namespace duet

// The one place that knows every backend: `--backend cpu|cuda|auto` → a ModelExecutor, and the
// engine built on it. Everything above the engine (workers, the CLI, benchmarks) makes its
// engine here; the engine itself knows only the ModelExecutor seam.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/llm_engine.h"
#include "engine/model_executor.h"

namespace duet {

// "auto" picks the GPU when this build has CUDA and a device is visible; other names pass through.
std::string ResolveBackend(const std::string& backend);

// The executor for `config.model_dir` on `config.backend`; Unimplemented for a backend this
// build lacks.
absl::StatusOr<std::unique_ptr<ModelExecutor>> LoadExecutor(const EngineConfig& config);

// LlmEngine::Create with LoadExecutor for the target and any draft model.
absl::StatusOr<std::unique_ptr<LlmEngine>> CreateEngine(const EngineConfig& config);

}  // namespace duet

// The `duet` subcommands. Each returns the process exit code.
#pragma once

#include <cstdint>
#include <string>

#include "engine/llm_engine.h"

namespace duet {

struct GenerateOptions {
  EngineConfig engine;
  std::string input_path;
  std::string output_path;
};
int RunGenerate(const GenerateOptions& options);

struct TokenizeOptions {
  std::string model_dir;
  std::string input_path;
  std::string output_path;
};
int RunTokenize(const TokenizeOptions& options);

}  // namespace duet

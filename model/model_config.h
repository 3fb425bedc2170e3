// Model hyper-parameters read from a Hugging Face `config.json` (Llama family: Llama 2/3/3.1,
// Mistral, Qwen2/2.5). Unknown architectures and unsupported fields are clear errors.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace duet {

struct RopeConfig {
  enum class Type { kDefault, kLlama3, kLinear };
  Type type = Type::kDefault;
  double theta = 10000.0;
  double factor = 1.0;                      // linear and llama3
  double low_freq_factor = 1.0;             // llama3
  double high_freq_factor = 4.0;            // llama3
  int64_t original_max_position_embeddings = 8192;  // llama3

  // The rotary inverse frequencies, head_dim / 2 of them, computed the way Hugging Face
  // transformers does (float32 arithmetic), including llama3 / linear scaling.
  std::vector<float> InverseFrequencies(int head_dim) const;
};

struct ModelConfig {
  std::string architecture;   // e.g. "LlamaForCausalLM"
  std::string model_type;     // "llama", "mistral", "qwen2"
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;       // config's head_dim, else hidden_size / num_heads
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  RopeConfig rope;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;      // Qwen2 always; Llama when attention_bias is true
  bool o_bias = false;        // Llama attention_bias also biases o_proj
  bool mlp_bias = false;
  int64_t sliding_window = 0; // 0: none. Only accepted when >= max_position_embeddings.
  int64_t bos_token_id = -1;
  std::vector<int64_t> eos_token_ids;  // config's eos_token_id (int or list)
  int64_t pad_token_id = -1;
};

// Parses config.json text. Validates sizes (positive, heads divide, head_dim consistent).
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& config_json);
// Reads `<model_dir>/config.json`; also merges eos ids from generation_config.json if present.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir);

}  // namespace duet

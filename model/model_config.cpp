#include "model/model_config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <numbers>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/check.h"
#include "common/mapped_file.h"
#include "nlohmann/json.hpp"

// The RoPE arithmetic below must round like PyTorch's float32 element-wise ops, one operation at a
// time; a fused multiply-add would round once instead of twice.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace duet {
namespace {

using Json = nlohmann::json;

// Sizes feed int32 index arithmetic in the kernels; anything larger is a broken config.
constexpr int64_t kMaxSize = std::numeric_limits<int32_t>::max();

// Field readers. A missing or null field yields std::nullopt; a present field of the wrong JSON
// type is an error naming the field (`where` is the enclosing object, e.g. "rope_scaling").
std::string FieldName(const std::string& where, const std::string& key) {
  return where.empty() ? key : absl::StrCat(where, ".", key);
}

const Json* FindField(const Json& object, const std::string& key) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::StatusOr<std::optional<int64_t>> OptionalInt(const Json& object, const std::string& key,
                                                   const std::string& where = "") {
  const Json* value = FindField(object, key);
  if (value == nullptr) return std::optional<int64_t>();
  if (value->is_number_unsigned()) {
    uint64_t unsigned_value = value->get<uint64_t>();
    if (unsigned_value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::InvalidArgumentError(
          absl::StrCat("config field '", FieldName(where, key), "' is out of range"));
    }
    return std::optional<int64_t>(static_cast<int64_t>(unsigned_value));
  }
  if (value->is_number_integer()) return std::optional<int64_t>(value->get<int64_t>());
  return absl::InvalidArgumentError(absl::StrCat("config field '", FieldName(where, key),
                                                 "' must be an integer, got ", value->dump()));
}

absl::StatusOr<std::optional<double>> OptionalDouble(const Json& object, const std::string& key,
                                                     const std::string& where = "") {
  const Json* value = FindField(object, key);
  if (value == nullptr) return std::optional<double>();
  if (!value->is_number()) {
    return absl::InvalidArgumentError(absl::StrCat("config field '", FieldName(where, key),
                                                   "' must be a number, got ", value->dump()));
  }
  return std::optional<double>(value->get<double>());
}

absl::StatusOr<std::optional<bool>> OptionalBool(const Json& object, const std::string& key) {
  const Json* value = FindField(object, key);
  if (value == nullptr) return std::optional<bool>();
  if (!value->is_boolean()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config field '", key, "' must be a boolean, got ", value->dump()));
  }
  return std::optional<bool>(value->get<bool>());
}

absl::StatusOr<std::optional<std::string>> OptionalString(const Json& object,
                                                          const std::string& key,
                                                          const std::string& where = "") {
  const Json* value = FindField(object, key);
  if (value == nullptr) return std::optional<std::string>();
  if (!value->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat("config field '", FieldName(where, key),
                                                   "' must be a string, got ", value->dump()));
  }
  return std::optional<std::string>(value->get<std::string>());
}

// A required size: present, an integer, and in [1, kMaxSize].
absl::StatusOr<int64_t> RequiredSize(const Json& object, const std::string& key) {
  absl::StatusOr<std::optional<int64_t>> value = OptionalInt(object, key);
  if (!value.ok()) return value.status();
  if (!value->has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("config is missing '", key, "'"));
  }
  int64_t size = **value;
  if (size <= 0 || size > kMaxSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("config field '", key, "' must be in [1, ", kMaxSize, "], got ", size));
  }
  return size;
}

// Token ids: an int, a list of ints, or absent/null (none).
absl::StatusOr<std::vector<int64_t>> TokenIds(const Json& object, const std::string& key,
                                              const std::string& file) {
  const Json* value = FindField(object, key);
  if (value == nullptr) return std::vector<int64_t>();
  std::vector<int64_t> ids;
  auto append = [&](const Json& id) -> absl::Status {
    if (!id.is_number_integer() || id.get<int64_t>() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          file, " field '", key, "' must be a non-negative integer or a list of them, got ",
          value->dump()));
    }
    ids.push_back(id.get<int64_t>());
    return absl::OkStatus();
  };
  if (value->is_array()) {
    for (const Json& id : *value) {
      if (absl::Status status = append(id); !status.ok()) return status;
    }
  } else if (absl::Status status = append(*value); !status.ok()) {
    return status;
  }
  return ids;
}

absl::StatusOr<int64_t> SingleTokenId(const Json& object, const std::string& key) {
  absl::StatusOr<std::vector<int64_t>> ids = TokenIds(object, key, "config");
  if (!ids.ok()) return ids.status();
  if (ids->empty()) return int64_t{-1};
  if (ids->size() > 1) {
    return absl::InvalidArgumentError(absl::StrCat("config field '", key, "' must be one id"));
  }
  return ids->front();
}

struct ArchitectureInfo {
  const char* architecture;
  const char* model_type;
};
constexpr ArchitectureInfo kSupportedArchitectures[] = {
    {"LlamaForCausalLM", "llama"},
    {"MistralForCausalLM", "mistral"},
    {"Qwen2ForCausalLM", "qwen2"},
};

std::string SupportedArchitectureList() {
  std::vector<std::string> names;
  for (const ArchitectureInfo& info : kSupportedArchitectures) names.push_back(info.architecture);
  return absl::StrJoin(names, ", ");
}

absl::Status ParseArchitecture(const Json& root, ModelConfig& config) {
  absl::StatusOr<std::optional<std::string>> model_type = OptionalString(root, "model_type");
  if (!model_type.ok()) return model_type.status();

  std::optional<std::string> architecture;
  if (const Json* architectures = FindField(root, "architectures")) {
    if (!architectures->is_array() || architectures->empty() ||
        !(*architectures)[0].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config field 'architectures' must be a non-empty list of strings, got ",
          architectures->dump()));
    }
    architecture = (*architectures)[0].get<std::string>();
  }
  if (!architecture && !model_type->has_value()) {
    return absl::InvalidArgumentError("config has neither 'architectures' nor 'model_type'");
  }
  for (const ArchitectureInfo& info : kSupportedArchitectures) {
    bool architecture_matches = architecture ? *architecture == info.architecture
                                             : **model_type == info.model_type;
    if (!architecture_matches) continue;
    if (model_type->has_value() && **model_type != info.model_type) {
      return absl::InvalidArgumentError(absl::StrCat("config architecture ", info.architecture,
                                                     " expects model_type '", info.model_type,
                                                     "', got '", **model_type, "'"));
    }
    config.architecture = info.architecture;
    config.model_type = info.model_type;
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unsupported model architecture '", architecture ? *architecture : **model_type,
      "' (supported: ", SupportedArchitectureList(), ")"));
}

// RoPE runs in float32, so its parameters must be positive, normal float32 numbers.
bool IsPositiveFloat32(double value) {
  return value >= std::numeric_limits<float>::min() && value <= std::numeric_limits<float>::max();
}

// A positive number from a rope scaling object.
absl::StatusOr<double> RequiredRopeNumber(const Json& scaling, const std::string& key,
                                          const std::string& where) {
  absl::StatusOr<std::optional<double>> value = OptionalDouble(scaling, key, where);
  if (!value.ok()) return value.status();
  if (!value->has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("config '", where, "' is missing '", key, "'"));
  }
  if (!IsPositiveFloat32(**value)) {
    return absl::InvalidArgumentError(absl::StrCat("config field '", FieldName(where, key),
                                                   "' must be a positive float32, got ", **value));
  }
  return **value;
}

// transformers rejects scaling factors below 1 (they would stretch, not compress, positions).
absl::StatusOr<double> RequiredScalingFactor(const Json& scaling, const std::string& where) {
  absl::StatusOr<double> factor = RequiredRopeNumber(scaling, "factor", where);
  if (factor.ok() && *factor < 1.0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config field '", where, ".factor' must be at least 1, got ", *factor));
  }
  return factor;
}

// RoPE settings come either from transformers 5's `rope_parameters` (theta inside) or from
// transformers 4's top-level `rope_theta` plus optional `rope_scaling`.
absl::Status ParseRope(const Json& root, RopeConfig& rope) {
  std::string where = "rope_parameters";
  const Json* scaling = FindField(root, where);
  if (scaling == nullptr) {
    where = "rope_scaling";
    scaling = FindField(root, where);
  }
  if (scaling != nullptr && !scaling->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config field '", where, "' must be an object, got ", scaling->dump()));
  }

  absl::StatusOr<std::optional<double>> theta = OptionalDouble(root, "rope_theta");
  if (!theta.ok()) return theta.status();
  if (scaling != nullptr) {
    absl::StatusOr<std::optional<double>> inner_theta =
        OptionalDouble(*scaling, "rope_theta", where);
    if (!inner_theta.ok()) return inner_theta.status();
    if (inner_theta->has_value()) *theta = *inner_theta;
  }
  rope.theta = theta->value_or(10000.0);
  if (!IsPositiveFloat32(rope.theta) || rope.theta < 1.0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config rope_theta must be in [1, FLT_MAX], got ", rope.theta));
  }

  std::string type = "default";
  if (scaling != nullptr) {
    // Older configs spell the key "type".
    for (const char* key : {"rope_type", "type"}) {
      absl::StatusOr<std::optional<std::string>> value = OptionalString(*scaling, key, where);
      if (!value.ok()) return value.status();
      if (value->has_value()) {
        type = **value;
        break;
      }
    }
  }

  if (type == "default") {
    rope.type = RopeConfig::Type::kDefault;
    return absl::OkStatus();
  }
  if (type == "linear") {
    rope.type = RopeConfig::Type::kLinear;
    absl::StatusOr<double> factor = RequiredScalingFactor(*scaling, where);
    if (!factor.ok()) return factor.status();
    rope.factor = *factor;
    return absl::OkStatus();
  }
  if (type == "llama3") {
    rope.type = RopeConfig::Type::kLlama3;
    absl::StatusOr<double> factor = RequiredScalingFactor(*scaling, where);
    if (!factor.ok()) return factor.status();
    absl::StatusOr<double> low = RequiredRopeNumber(*scaling, "low_freq_factor", where);
    if (!low.ok()) return low.status();
    absl::StatusOr<double> high = RequiredRopeNumber(*scaling, "high_freq_factor", where);
    if (!high.ok()) return high.status();
    absl::StatusOr<std::optional<int64_t>> original =
        OptionalInt(*scaling, "original_max_position_embeddings", where);
    if (!original.ok()) return original.status();
    if (!original->has_value() || **original <= 0 || **original > kMaxSize) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config '", where, "' needs a positive 'original_max_position_embeddings'"));
    }
    if (static_cast<float>(*high) <= static_cast<float>(*low)) {
      return absl::InvalidArgumentError(absl::StrCat("config '", where,
                                                     "' needs high_freq_factor (", *high,
                                                     ") > low_freq_factor (", *low, ")"));
    }
    rope.factor = *factor;
    rope.low_freq_factor = *low;
    rope.high_freq_factor = *high;
    rope.original_max_position_embeddings = **original;
    return absl::OkStatus();
  }
  if (type == "dynamic" || type == "yarn" || type == "longrope" || type == "su" ||
      type == "mrope") {
    return absl::UnimplementedError(absl::StrCat(
        "rope type '", type, "' is not supported (supported: default, linear, llama3)"));
  }
  return absl::InvalidArgumentError(absl::StrCat("config '", where, "' has unknown rope type '",
                                                 type, "'"));
}

absl::Status ParseSlidingWindow(const Json& root, ModelConfig& config) {
  if (config.model_type == "llama") return absl::OkStatus();  // Llama has no sliding window.
  if (config.model_type == "qwen2") {
    absl::StatusOr<std::optional<bool>> use = OptionalBool(root, "use_sliding_window");
    if (!use.ok()) return use.status();
    if (!use->value_or(false)) return absl::OkStatus();
  }
  absl::StatusOr<std::optional<int64_t>> window = OptionalInt(root, "sliding_window");
  if (!window.ok()) return window.status();
  // transformers' MistralConfig defaults sliding_window to 4096 when the key is absent; an
  // explicit null means none.
  if (config.model_type == "mistral" && !root.contains("sliding_window")) *window = 4096;
  if (!window->has_value()) return absl::OkStatus();
  if (**window <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config field 'sliding_window' must be positive, got ", **window));
  }
  if (**window < config.max_position_embeddings) {
    return absl::UnimplementedError(absl::StrCat(
        "sliding-window attention (sliding_window=", **window,
        " < max_position_embeddings=", config.max_position_embeddings, ") is not supported"));
  }
  config.sliding_window = **window;
  return absl::OkStatus();
}

absl::Status ParseBiases(const Json& root, ModelConfig& config) {
  if (config.model_type == "qwen2") {
    config.qkv_bias = true;
    return absl::OkStatus();
  }
  if (config.model_type != "llama") return absl::OkStatus();  // Mistral has no biases.
  absl::StatusOr<std::optional<bool>> attention_bias = OptionalBool(root, "attention_bias");
  if (!attention_bias.ok()) return attention_bias.status();
  absl::StatusOr<std::optional<bool>> mlp_bias = OptionalBool(root, "mlp_bias");
  if (!mlp_bias.ok()) return mlp_bias.status();
  config.qkv_bias = attention_bias->value_or(false);
  config.o_bias = config.qkv_bias;
  config.mlp_bias = mlp_bias->value_or(false);
  return absl::OkStatus();
}

absl::Status ParseSizes(const Json& root, ModelConfig& config) {
  struct SizeField {
    const char* key;
    int64_t* target;
  };
  for (const SizeField& field : {
           SizeField{"hidden_size", &config.hidden_size},
           SizeField{"intermediate_size", &config.intermediate_size},
           SizeField{"num_hidden_layers", &config.num_layers},
           SizeField{"num_attention_heads", &config.num_heads},
           SizeField{"vocab_size", &config.vocab_size},
           SizeField{"max_position_embeddings", &config.max_position_embeddings},
       }) {
    absl::StatusOr<int64_t> value = RequiredSize(root, field.key);
    if (!value.ok()) return value.status();
    *field.target = *value;
  }

  config.num_kv_heads = config.num_heads;
  if (FindField(root, "num_key_value_heads") != nullptr) {
    absl::StatusOr<int64_t> kv_heads = RequiredSize(root, "num_key_value_heads");
    if (!kv_heads.ok()) return kv_heads.status();
    config.num_kv_heads = *kv_heads;
  }
  if (config.num_heads % config.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config num_attention_heads (", config.num_heads,
        ") must be a multiple of num_key_value_heads (", config.num_kv_heads, ")"));
  }

  if (FindField(root, "head_dim") != nullptr) {
    absl::StatusOr<int64_t> head_dim = RequiredSize(root, "head_dim");
    if (!head_dim.ok()) return head_dim.status();
    config.head_dim = *head_dim;
  } else {
    if (config.hidden_size % config.num_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config hidden_size (", config.hidden_size, ") is not a multiple of ",
          "num_attention_heads (", config.num_heads, ") and no head_dim is given"));
    }
    config.head_dim = config.hidden_size / config.num_heads;
  }
  if (config.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config head_dim must be even for rotary embeddings, got ", config.head_dim));
  }
  return absl::OkStatus();
}

absl::Status ParseRoot(const Json& root, ModelConfig& config) {
  if (!root.is_object()) return absl::InvalidArgumentError("config.json must be a JSON object");
  if (absl::Status s = ParseArchitecture(root, config); !s.ok()) return s;

  absl::StatusOr<std::optional<std::string>> activation = OptionalString(root, "hidden_act");
  if (!activation.ok()) return activation.status();
  if (activation->value_or("silu") != "silu") {
    return absl::InvalidArgumentError(absl::StrCat(
        "config hidden_act '", **activation, "' is not supported (only 'silu')"));
  }

  if (absl::Status s = ParseSizes(root, config); !s.ok()) return s;

  absl::StatusOr<std::optional<double>> eps = OptionalDouble(root, "rms_norm_eps");
  if (!eps.ok()) return eps.status();
  config.rms_norm_eps = eps->value_or(1e-6);
  if (!std::isfinite(config.rms_norm_eps) || config.rms_norm_eps <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config rms_norm_eps must be positive, got ", config.rms_norm_eps));
  }

  if (absl::Status s = ParseRope(root, config.rope); !s.ok()) return s;

  absl::StatusOr<std::optional<bool>> tie = OptionalBool(root, "tie_word_embeddings");
  if (!tie.ok()) return tie.status();
  config.tie_word_embeddings = tie->value_or(false);

  if (absl::Status s = ParseBiases(root, config); !s.ok()) return s;
  if (absl::Status s = ParseSlidingWindow(root, config); !s.ok()) return s;

  absl::StatusOr<int64_t> bos = SingleTokenId(root, "bos_token_id");
  if (!bos.ok()) return bos.status();
  config.bos_token_id = *bos;
  absl::StatusOr<int64_t> pad = SingleTokenId(root, "pad_token_id");
  if (!pad.ok()) return pad.status();
  config.pad_token_id = *pad;
  absl::StatusOr<std::vector<int64_t>> eos = TokenIds(root, "eos_token_id", "config");
  if (!eos.ok()) return eos.status();
  config.eos_token_ids = *std::move(eos);
  return absl::OkStatus();
}

absl::StatusOr<Json> ParseJson(const std::string& text, const std::string& what) {
  try {
    return Json::parse(text);
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is not valid JSON: ", e.what()));
  }
}

}  // namespace

std::vector<float> RopeConfig::InverseFrequencies(int head_dim) const {
  DUET_CHECK(head_dim > 0 && head_dim % 2 == 0);
  // transformers: 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), all in float32.
  const float base = static_cast<float>(theta);
  std::vector<float> inv_freq(head_dim / 2);
  for (int i = 0; i < head_dim / 2; ++i) {
    float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv_freq[i] = 1.0f / std::pow(base, exponent);
  }

  if (type == Type::kLinear) {
    for (float& f : inv_freq) f = f / static_cast<float>(factor);
  } else if (type == Type::kLlama3) {
    // transformers `_compute_llama3_parameters`. Python scalars meet float32 tensors, so each is
    // rounded to float32 first; `c / tensor` is `tensor.reciprocal() * c` in torch.
    const float scale = static_cast<float>(factor);
    const float old_context = static_cast<float>(original_max_position_embeddings);
    const float low_freq_wavelen =
        static_cast<float>(static_cast<double>(original_max_position_embeddings) / low_freq_factor);
    const float high_freq_wavelen = static_cast<float>(
        static_cast<double>(original_max_position_embeddings) / high_freq_factor);
    const float low = static_cast<float>(low_freq_factor);
    const float band = static_cast<float>(high_freq_factor - low_freq_factor);
    const float two_pi = static_cast<float>(2.0 * std::numbers::pi);
    for (float& f : inv_freq) {
      float wavelen = (1.0f / f) * two_pi;
      float scaled = wavelen > low_freq_wavelen ? f / scale : f;
      bool is_medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
      if (is_medium) {
        float smooth = ((1.0f / wavelen) * old_context - low) / band;
        f = (1.0f - smooth) * scaled / scale + smooth * scaled;
      } else {
        f = scaled;
      }
    }
  }
  return inv_freq;
}

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& config_json) {
  absl::StatusOr<Json> root = ParseJson(config_json, "config.json");
  if (!root.ok()) return root.status();
  ModelConfig config;
  try {
    if (absl::Status status = ParseRoot(*root, config); !status.ok()) return status;
  } catch (const Json::exception& e) {  // Defensive: every access above is type-checked.
    return absl::InvalidArgumentError(absl::StrCat("config.json: ", e.what()));
  }
  return config;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir) {
  const std::string config_path = model_dir + "/config.json";
  absl::StatusOr<std::string> text = ReadFileToString(config_path);
  if (!text.ok()) return text.status();
  absl::StatusOr<ModelConfig> config = ParseModelConfig(*text);
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrCat(config_path, ": ", config.status().message()));
  }

  const std::string generation_path = model_dir + "/generation_config.json";
  std::error_code error;
  if (!std::filesystem::exists(generation_path, error)) return config;
  absl::StatusOr<std::string> generation_text = ReadFileToString(generation_path);
  if (!generation_text.ok()) return generation_text.status();
  absl::StatusOr<Json> generation = ParseJson(*generation_text, generation_path);
  if (!generation.ok()) return generation.status();
  if (!generation->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(generation_path, " must be a JSON object"));
  }
  absl::StatusOr<std::vector<int64_t>> extra_eos =
      TokenIds(*generation, "eos_token_id", generation_path);
  if (!extra_eos.ok()) return extra_eos.status();
  for (int64_t id : *extra_eos) {
    if (std::find(config->eos_token_ids.begin(), config->eos_token_ids.end(), id) ==
        config->eos_token_ids.end()) {
      config->eos_token_ids.push_back(id);
    }
  }
  return config;
}

}  // namespace duet

#include "model/model_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace duet {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// Real configs (trimmed of fields Duet ignores), as published on the Hugging Face Hub.
constexpr char kLlama2Config[] = R"({
  "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 11008,
  "max_position_embeddings": 4096, "model_type": "llama", "num_attention_heads": 32,
  "num_hidden_layers": 32, "num_key_value_heads": 32, "pretraining_tp": 1,
  "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 10000.0,
  "tie_word_embeddings": false, "torch_dtype": "float16", "vocab_size": 32000})";

constexpr char kLlama31Config[] = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
  "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": false,
  "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
  "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": false, "vocab_size": 128256})";

constexpr char kMistralConfig[] = R"({
  "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
  "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
  "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0, "sliding_window": null, "tie_word_embeddings": false,
  "vocab_size": 32000})";

constexpr char kQwen25Config[] = R"({
  "architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645,
  "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864,
  "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
  "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
  "tie_word_embeddings": true, "use_sliding_window": false, "vocab_size": 151936})";

// transformers 5 moved rope_theta and rope_scaling into rope_parameters.
constexpr char kTransformers5Llama31Config[] = R"({
  "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
  "max_position_embeddings": 131072, "model_type": "llama", "num_attention_heads": 32,
  "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
  "rope_parameters": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_theta": 500000.0,
                      "rope_type": "llama3"},
  "vocab_size": 128256})";

// Expected inverse frequencies, worked out step by step in float32 exactly as transformers does
// (each Python-scalar operation rounded to float32; pow correctly rounded).
const float kLlama31InvFreq[] = {
    0x1p+0f, 0x1.a11582p-1f, 0x1.53c38cp-1f, 0x1.14c708p-1f,
    0x1.c2ef78p-2f, 0x1.6f56fap-2f, 0x1.2b3dc6p-2f, 0x1.e788c2p-3f,
    0x1.8d276p-3f, 0x1.43874p-3f, 0x1.078d4p-3f, 0x1.ad6338p-4f,
    0x1.5dc95ap-4f, 0x1.1cf13p-4f, 0x1.d03ccep-5f, 0x1.7a2d08p-5f,
    0x1.34119p-5f, 0x1.f5ea7ep-6f, 0x1.98de92p-6f, 0x1.4d1272p-6f,
    0x1.0f5386p-6f, 0x1.ba0dd8p-7f, 0x1.681adap-7f, 0x1.2558fep-7f,
    0x1.ddee9ep-8f, 0x1.8554ecp-8f, 0x1.3d2804p-8f, 0x1.025c6ap-8f,
    0x1.a4ee4p-9f, 0x1.1bfa0cp-9f, 0x1.67a23ap-10f, 0x1.c12f3cp-11f,
    0x1.132ba4p-11f, 0x1.47e21p-12f, 0x1.765ba4p-13f, 0x1.90d10cp-14f,
    0x1.46831ap-14f, 0x1.09fb7ep-14f, 0x1.b15902p-15f, 0x1.610332p-15f,
    0x1.1f91fp-15f, 0x1.d484dep-16f, 0x1.7da9e8p-16f, 0x1.36e8eap-16f,
    0x1.fa8b86p-17f, 0x1.9ca3eap-17f, 0x1.5024d6p-17f, 0x1.11d41ep-17f,
    0x1.be2188p-18f, 0x1.6b6d0ep-18f, 0x1.280d96p-18f, 0x1.e257p-19f,
    0x1.88ec2p-19f, 0x1.4014d2p-19f, 0x1.04be68p-19f, 0x1.a8d01p-20f,
    0x1.5a0f4ep-20f, 0x1.19e8p-20f, 0x1.cb4a9ap-21f, 0x1.76258ep-21f,
    0x1.30c94ep-21f, 0x1.f09184p-22f, 0x1.94836p-22f, 0x1.4985fep-22f,
};
const float kTheta10000Dim128InvFreq[] = {
    0x1p+0f, 0x1.bb5faep-1f, 0x1.7ff222p-1f, 0x1.4c7bcp-1f,
    0x1.1feb34p-1f, 0x1.f2a79ep-2f, 0x1.afd136p-2f, 0x1.75f036p-2f,
    0x1.43d136p-2f, 0x1.186a08p-2f, 0x1.e5a846p-3f, 0x1.a48fdap-3f,
    0x1.6c310ep-3f, 0x1.3b608p-3f, 0x1.111aeep-3f, 0x1.d8ffacp-4f,
    0x1.99999ap-4f, 0x1.62b2fp-4f, 0x1.33281ap-4f, 0x1.09fc9ap-4f,
    0x1.ccab84p-5f, 0x1.8eec7ep-5f, 0x1.59742ap-5f, 0x1.2b269p-5f,
    0x1.030dc6p-5f, 0x1.c0a9a4p-6f, 0x1.84869ep-6f, 0x1.507316p-6f,
    0x1.235a72p-6f, 0x1.f89a66p-7f, 0x1.b4f7e4p-7f, 0x1.7a6622p-7f,
    0x1.47ae14p-7f, 0x1.1bc25ap-7f, 0x1.eb736p-8f, 0x1.a9942ap-8f,
    0x1.708938p-8f, 0x1.3f2398p-8f, 0x1.145ceep-8f, 0x1.dea41cp-9f,
    0x1.9e7c7p-9f, 0x1.66ee1ep-9f, 0x1.36d21ap-9f, 0x1.0d28dep-9f,
    0x1.d22a5p-10f, 0x1.93aeb8p-10f, 0x1.5d931cp-10f, 0x1.2eb81cp-10f,
    0x1.0624dep-10f, 0x1.c603c4p-11f, 0x1.892918p-11f, 0x1.547688p-11f,
    0x1.26d42cp-11f, 0x1.fe9f58p-12f, 0x1.ba2e4ap-12f, 0x1.7ee9aep-12f,
    0x1.4b96cp-12f, 0x1.1f24e4p-12f, 0x1.f1502ap-13f, 0x1.aea7c8p-13f,
    0x1.74eea6p-13f, 0x1.42f22cp-13f, 0x1.17a8e4p-13f, 0x1.e459c4p-14f,
};

ModelConfig ParseOrDie(const std::string& json) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(json);
  EXPECT_TRUE(config.ok()) << config.status();
  return config.ok() ? *config : ModelConfig{};
}

std::string MakeTempDir(const std::string& name) {
  std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) /
                              ("model_config_test_" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

TEST(ModelConfigTest, BundledTinyCodeLlama) {
  absl::StatusOr<ModelConfig> config = LoadModelConfig(DUET_MODELS_DIR "/tiny-code-llama");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->architecture, "LlamaForCausalLM");
  EXPECT_EQ(config->model_type, "llama");
  EXPECT_EQ(config->hidden_size, 512);
  EXPECT_EQ(config->intermediate_size, 1408);
  EXPECT_EQ(config->num_layers, 6);
  EXPECT_EQ(config->num_heads, 8);
  EXPECT_EQ(config->num_kv_heads, 4);
  EXPECT_EQ(config->head_dim, 64);
  EXPECT_EQ(config->vocab_size, 8192);
  EXPECT_EQ(config->max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(config->rms_norm_eps, 1e-5);
  EXPECT_EQ(config->rope.type, RopeConfig::Type::kDefault);
  EXPECT_DOUBLE_EQ(config->rope.theta, 500000.0);
  EXPECT_FALSE(config->tie_word_embeddings);
  EXPECT_FALSE(config->qkv_bias);
  EXPECT_FALSE(config->o_bias);
  EXPECT_FALSE(config->mlp_bias);
  EXPECT_EQ(config->sliding_window, 0);
  EXPECT_EQ(config->bos_token_id, 0);
  EXPECT_THAT(config->eos_token_ids, ElementsAre(1));
  EXPECT_EQ(config->pad_token_id, 2);
}

TEST(ModelConfigTest, BundledDraftModel) {
  absl::StatusOr<ModelConfig> config = LoadModelConfig(DUET_MODELS_DIR "/tiny-code-llama-draft");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->hidden_size, 256);
  EXPECT_EQ(config->intermediate_size, 704);
  EXPECT_EQ(config->num_layers, 2);
  EXPECT_EQ(config->num_heads, 4);
  EXPECT_EQ(config->num_kv_heads, 2);
  EXPECT_EQ(config->head_dim, 64);
  EXPECT_EQ(config->vocab_size, 8192);
  EXPECT_TRUE(config->tie_word_embeddings);
  EXPECT_DOUBLE_EQ(config->rope.theta, 500000.0);
  EXPECT_THAT(config->eos_token_ids, ElementsAre(1));
}

TEST(ModelConfigTest, Llama2) {
  ModelConfig config = ParseOrDie(kLlama2Config);
  EXPECT_EQ(config.head_dim, 128);  // 4096 / 32: Llama 2 has no head_dim
  EXPECT_EQ(config.num_kv_heads, 32);
  EXPECT_EQ(config.rope.type, RopeConfig::Type::kDefault);
  EXPECT_DOUBLE_EQ(config.rope.theta, 10000.0);
  EXPECT_EQ(config.vocab_size, 32000);
  EXPECT_EQ(config.bos_token_id, 1);
  EXPECT_THAT(config.eos_token_ids, ElementsAre(2));
  EXPECT_EQ(config.pad_token_id, -1);
  EXPECT_FALSE(config.tie_word_embeddings);
}

TEST(ModelConfigTest, Llama31WithLlama3RopeScaling) {
  ModelConfig config = ParseOrDie(kLlama31Config);
  EXPECT_EQ(config.num_kv_heads, 8);
  EXPECT_EQ(config.head_dim, 128);
  EXPECT_EQ(config.max_position_embeddings, 131072);
  EXPECT_EQ(config.rope.type, RopeConfig::Type::kLlama3);
  EXPECT_DOUBLE_EQ(config.rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(config.rope.factor, 8.0);
  EXPECT_DOUBLE_EQ(config.rope.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(config.rope.high_freq_factor, 4.0);
  EXPECT_EQ(config.rope.original_max_position_embeddings, 8192);
  EXPECT_THAT(config.eos_token_ids, ElementsAre(128001, 128008, 128009));
}

TEST(ModelConfigTest, Transformers5RopeParametersMatchTransformers4Layout) {
  ModelConfig v5 = ParseOrDie(kTransformers5Llama31Config);
  ModelConfig v4 = ParseOrDie(kLlama31Config);
  EXPECT_EQ(v5.rope.type, RopeConfig::Type::kLlama3);
  EXPECT_DOUBLE_EQ(v5.rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(v5.rope.factor, 8.0);
  EXPECT_EQ(v5.rope.original_max_position_embeddings, 8192);
  EXPECT_EQ(v5.rope.InverseFrequencies(128), v4.rope.InverseFrequencies(128));
  EXPECT_EQ(v5.rms_norm_eps, v4.rms_norm_eps);
}

TEST(ModelConfigTest, Mistral) {
  ModelConfig config = ParseOrDie(kMistralConfig);
  EXPECT_EQ(config.architecture, "MistralForCausalLM");
  EXPECT_EQ(config.model_type, "mistral");
  EXPECT_EQ(config.head_dim, 128);
  EXPECT_EQ(config.num_kv_heads, 8);
  EXPECT_DOUBLE_EQ(config.rope.theta, 1e6);
  EXPECT_EQ(config.sliding_window, 0);
  EXPECT_FALSE(config.qkv_bias);
}

TEST(ModelConfigTest, Qwen25HasQkvBiasAndTiedEmbeddings) {
  ModelConfig config = ParseOrDie(kQwen25Config);
  EXPECT_EQ(config.architecture, "Qwen2ForCausalLM");
  EXPECT_EQ(config.head_dim, 64);  // 896 / 14
  EXPECT_EQ(config.num_kv_heads, 2);
  EXPECT_TRUE(config.qkv_bias);
  EXPECT_FALSE(config.o_bias);
  EXPECT_FALSE(config.mlp_bias);
  EXPECT_TRUE(config.tie_word_embeddings);
  EXPECT_EQ(config.sliding_window, 0);  // use_sliding_window is false
  EXPECT_DOUBLE_EQ(config.rms_norm_eps, 1e-6);
  EXPECT_THAT(config.eos_token_ids, ElementsAre(151645));
}

Json Patched(const char* base, const std::string& patch) {
  Json config = Json::parse(base);
  config.merge_patch(Json::parse(patch));  // a null in the patch removes the key
  return config;
}

TEST(ModelConfigTest, DefaultsAndOptionalFields) {
  // No num_key_value_heads: MHA. No tie_word_embeddings: false, as in HF LlamaConfig.
  ModelConfig config = ParseOrDie(
      Patched(kLlama31Config,
              R"({"num_key_value_heads": null, "tie_word_embeddings": null,
                  "rope_scaling": null, "rope_theta": null, "rms_norm_eps": null,
                  "hidden_act": null, "bos_token_id": null, "eos_token_id": null})")
          .dump());
  EXPECT_EQ(config.num_kv_heads, 32);
  EXPECT_FALSE(config.tie_word_embeddings);
  EXPECT_EQ(config.rope.type, RopeConfig::Type::kDefault);
  EXPECT_DOUBLE_EQ(config.rope.theta, 10000.0);
  EXPECT_DOUBLE_EQ(config.rms_norm_eps, 1e-6);
  EXPECT_EQ(config.bos_token_id, -1);
  EXPECT_TRUE(config.eos_token_ids.empty());
}

TEST(ModelConfigTest, ExplicitHeadDimWins) {
  ModelConfig config = ParseOrDie(Patched(kMistralConfig, R"({"head_dim": 160, "hidden_size": 5120})").dump());
  EXPECT_EQ(config.head_dim, 160);
}

TEST(ModelConfigTest, LlamaAttentionBiasBiasesQkvAndOutput) {
  ModelConfig config =
      ParseOrDie(Patched(kLlama31Config, R"({"attention_bias": true, "mlp_bias": true})").dump());
  EXPECT_TRUE(config.qkv_bias);
  EXPECT_TRUE(config.o_bias);
  EXPECT_TRUE(config.mlp_bias);
}

TEST(ModelConfigTest, LinearRopeScalingAndLegacyTypeKey) {
  ModelConfig config =
      ParseOrDie(Patched(kLlama2Config, R"({"rope_scaling": {"type": "linear", "factor": 2.0}})")
                     .dump());
  EXPECT_EQ(config.rope.type, RopeConfig::Type::kLinear);
  EXPECT_DOUBLE_EQ(config.rope.factor, 2.0);
}

TEST(ModelConfigTest, SlidingWindowCoveringTheContextIsAccepted) {
  ModelConfig config =
      ParseOrDie(Patched(kMistralConfig, R"({"sliding_window": 32768})").dump());
  EXPECT_EQ(config.sliding_window, 32768);
}

TEST(ModelConfigTest, LoadMergesGenerationConfigEosIds) {
  std::string dir = MakeTempDir("eos_merge");
  WriteText(dir + "/config.json", Patched(kLlama31Config, R"({"eos_token_id": 128001})").dump());
  WriteText(dir + "/generation_config.json",
            R"({"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]})");
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_THAT(config->eos_token_ids, ElementsAre(128001, 128008, 128009));
}

TEST(ModelConfigTest, LoadErrors) {
  std::string dir = MakeTempDir("load_errors");
  absl::StatusOr<ModelConfig> missing = LoadModelConfig(dir);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("config.json"));

  WriteText(dir + "/config.json", R"({"architectures": ["GPT2LMHeadModel"]})");
  absl::StatusOr<ModelConfig> bad = LoadModelConfig(dir);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr(dir + "/config.json"));
  EXPECT_THAT(bad.status().message(), HasSubstr("GPT2LMHeadModel"));

  WriteText(dir + "/config.json", kLlama2Config);
  WriteText(dir + "/generation_config.json", "{not json");
  EXPECT_EQ(LoadModelConfig(dir).status().code(), absl::StatusCode::kInvalidArgument);
  WriteText(dir + "/generation_config.json", R"({"eos_token_id": "2"})");
  absl::StatusOr<ModelConfig> bad_eos = LoadModelConfig(dir);
  EXPECT_EQ(bad_eos.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_eos.status().message(), HasSubstr("eos_token_id"));
}

struct ErrorCase {
  const char* name;
  const char* base;
  const char* patch;  // JSON merge patch applied to `base`
  absl::StatusCode code;
  const char* message;  // expected in the error
};

class ModelConfigErrorTest : public ::testing::TestWithParam<ErrorCase> {};

TEST_P(ModelConfigErrorTest, ReturnsClearError) {
  const ErrorCase& c = GetParam();
  absl::StatusOr<ModelConfig> config = ParseModelConfig(Patched(c.base, c.patch).dump());
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), c.code) << config.status();
  EXPECT_THAT(config.status().message(), HasSubstr(c.message));
}

constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
constexpr auto kUnimplemented = absl::StatusCode::kUnimplemented;

INSTANTIATE_TEST_SUITE_P(
    AllErrors, ModelConfigErrorTest,
    ::testing::Values(
        ErrorCase{"UnknownArchitecture", kLlama2Config,
                  R"({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"})", kInvalid,
                  "GemmaForCausalLM"},
        ErrorCase{"UnknownModelTypeOnly", kLlama2Config,
                  R"({"architectures": null, "model_type": "gpt2"})", kInvalid, "gpt2"},
        ErrorCase{"NoArchitectureAtAll", kLlama2Config,
                  R"({"architectures": null, "model_type": null})", kInvalid, "architectures"},
        ErrorCase{"ArchitecturesNotAList", kLlama2Config, R"({"architectures": "Llama"})",
                  kInvalid, "architectures"},
        ErrorCase{"ModelTypeMismatch", kLlama2Config, R"({"model_type": "qwen2"})", kInvalid,
                  "model_type"},
        ErrorCase{"MissingHiddenSize", kLlama2Config, R"({"hidden_size": null})", kInvalid,
                  "hidden_size"},
        ErrorCase{"StringHiddenSize", kLlama2Config, R"({"hidden_size": "4096"})", kInvalid,
                  "'hidden_size' must be an integer"},
        ErrorCase{"FractionalLayerCount", kLlama2Config, R"({"num_hidden_layers": 32.5})",
                  kInvalid, "num_hidden_layers"},
        ErrorCase{"ZeroHiddenSize", kLlama2Config, R"({"hidden_size": 0})", kInvalid,
                  "hidden_size"},
        ErrorCase{"NegativeIntermediate", kLlama2Config, R"({"intermediate_size": -1})",
                  kInvalid, "intermediate_size"},
        ErrorCase{"HugeVocab", kLlama2Config, R"({"vocab_size": 99999999999})", kInvalid,
                  "vocab_size"},
        ErrorCase{"ZeroVocab", kLlama2Config, R"({"vocab_size": 0})", kInvalid, "vocab_size"},
        ErrorCase{"OutOfRangeInteger", kLlama2Config,
                  R"({"vocab_size": 18446744073709551615})", kInvalid, "vocab_size"},
        ErrorCase{"ZeroKvHeads", kLlama2Config, R"({"num_key_value_heads": 0})", kInvalid,
                  "num_key_value_heads"},
        ErrorCase{"KvHeadsDoNotDivide", kLlama2Config, R"({"num_key_value_heads": 5})", kInvalid,
                  "multiple of num_key_value_heads"},
        ErrorCase{"HiddenNotDivisibleByHeads", kLlama2Config,
                  R"({"hidden_size": 4000, "num_attention_heads": 48, "num_key_value_heads": 8})",
                  kInvalid, "not a multiple"},
        ErrorCase{"OddHeadDim", kLlama2Config, R"({"head_dim": 63})", kInvalid, "even"},
        ErrorCase{"StringHeadDim", kLlama2Config, R"({"head_dim": "128"})", kInvalid,
                  "head_dim"},
        ErrorCase{"ZeroEps", kLlama2Config, R"({"rms_norm_eps": 0})", kInvalid, "rms_norm_eps"},
        ErrorCase{"NegativeEps", kLlama2Config, R"({"rms_norm_eps": -1e-5})", kInvalid,
                  "rms_norm_eps"},
        ErrorCase{"StringEps", kLlama2Config, R"({"rms_norm_eps": "1e-5"})", kInvalid,
                  "rms_norm_eps"},
        ErrorCase{"GeluActivation", kLlama2Config, R"({"hidden_act": "gelu"})", kInvalid,
                  "gelu"},
        ErrorCase{"StringTie", kLlama2Config, R"({"tie_word_embeddings": "true"})", kInvalid,
                  "tie_word_embeddings"},
        ErrorCase{"StringAttentionBias", kLlama2Config, R"({"attention_bias": 1})", kInvalid,
                  "attention_bias"},
        ErrorCase{"StringEos", kLlama2Config, R"({"eos_token_id": "2"})", kInvalid,
                  "eos_token_id"},
        ErrorCase{"NegativeEosInList", kLlama2Config, R"({"eos_token_id": [2, -1]})", kInvalid,
                  "eos_token_id"},
        ErrorCase{"BosList", kLlama2Config, R"({"bos_token_id": [1, 2]})", kInvalid,
                  "bos_token_id"},
        ErrorCase{"StringRopeTheta", kLlama2Config, R"({"rope_theta": "10000"})", kInvalid,
                  "rope_theta"},
        ErrorCase{"NegativeRopeTheta", kLlama2Config, R"({"rope_theta": -5})", kInvalid,
                  "rope_theta"},
        ErrorCase{"RopeScalingNotObject", kLlama2Config, R"({"rope_scaling": 8})", kInvalid,
                  "rope_scaling"},
        ErrorCase{"YarnRope", kLlama2Config,
                  R"({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})", kUnimplemented,
                  "yarn"},
        ErrorCase{"DynamicRope", kLlama2Config,
                  R"({"rope_scaling": {"type": "dynamic", "factor": 2.0}})", kUnimplemented,
                  "dynamic"},
        ErrorCase{"LongRopeV5", kLlama2Config,
                  R"({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000}})",
                  kUnimplemented, "longrope"},
        ErrorCase{"UnknownRopeType", kLlama2Config,
                  R"({"rope_scaling": {"rope_type": "spiral", "factor": 2.0}})", kInvalid,
                  "spiral"},
        ErrorCase{"RopeTypeNotString", kLlama2Config,
                  R"({"rope_scaling": {"rope_type": 3, "factor": 2.0}})", kInvalid,
                  "rope_scaling.rope_type"},
        ErrorCase{"LinearWithoutFactor", kLlama2Config,
                  R"({"rope_scaling": {"rope_type": "linear"}})", kInvalid, "factor"},
        ErrorCase{"LinearZeroFactor", kLlama2Config,
                  R"({"rope_scaling": {"rope_type": "linear", "factor": 0}})", kInvalid,
                  "factor"},
        ErrorCase{"LinearFactorBelowOne", kLlama2Config,
                  R"({"rope_scaling": {"rope_type": "linear", "factor": 0.5}})", kInvalid,
                  "at least 1"},
        ErrorCase{"RopeThetaBeyondFloat", kLlama2Config, R"({"rope_theta": 1e39})", kInvalid,
                  "rope_theta"},
        ErrorCase{"Llama3TinyLowFreqFactor", kLlama31Config,
                  R"({"rope_scaling": {"low_freq_factor": 1e-300}})", kInvalid,
                  "low_freq_factor"},
        ErrorCase{"Llama3MissingLowFreqFactor", kLlama31Config,
                  R"({"rope_scaling": {"low_freq_factor": null}})", kInvalid, "low_freq_factor"},
        ErrorCase{"Llama3StringFactor", kLlama31Config,
                  R"({"rope_scaling": {"factor": "8"}})", kInvalid, "rope_scaling.factor"},
        ErrorCase{"Llama3MissingOriginalContext", kLlama31Config,
                  R"({"rope_scaling": {"original_max_position_embeddings": null}})", kInvalid,
                  "original_max_position_embeddings"},
        ErrorCase{"Llama3HighNotAboveLow", kLlama31Config,
                  R"({"rope_scaling": {"high_freq_factor": 1.0}})", kInvalid,
                  "high_freq_factor"},
        ErrorCase{"MistralSlidingWindow", kMistralConfig, R"({"sliding_window": 4096})",
                  kUnimplemented, "sliding_window=4096"},
        ErrorCase{"MistralDefaultSlidingWindow", kMistralConfig, R"({"sliding_window": null})",
                  kUnimplemented, "sliding_window=4096"},
        ErrorCase{"MistralStringSlidingWindow", kMistralConfig, R"({"sliding_window": "4096"})",
                  kInvalid, "sliding_window"},
        ErrorCase{"Qwen2SlidingWindowInUse", kQwen25Config,
                  R"({"use_sliding_window": true, "sliding_window": 4096})", kUnimplemented,
                  "sliding"}),
    [](const ::testing::TestParamInfo<ErrorCase>& info) { return info.param.name; });

TEST(ModelConfigTest, MalformedJson) {
  for (const char* text : {"", "{", "[]", "42", "null", "{\"hidden_size\": }", "\xff\xfe"}) {
    absl::StatusOr<ModelConfig> config = ParseModelConfig(text);
    ASSERT_FALSE(config.ok()) << text;
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << text;
  }
}

// Element-by-element against tables worked out independently (see top of file).
TEST(RopeConfigTest, DefaultMatchesTransformers) {
  RopeConfig rope;  // theta 10000
  EXPECT_EQ(rope.InverseFrequencies(128),
            std::vector<float>(std::begin(kTheta10000Dim128InvFreq),
                               std::end(kTheta10000Dim128InvFreq)));
  // 10000 ** 0.5 is exactly 100.
  EXPECT_THAT(rope.InverseFrequencies(4), ElementsAre(1.0f, 1.0f / 100.0f));
}

TEST(RopeConfigTest, Llama31MatchesTransformers) {
  ModelConfig config = ParseOrDie(kLlama31Config);
  std::vector<float> inv_freq = config.rope.InverseFrequencies(128);
  ASSERT_EQ(inv_freq.size(), 64u);
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    EXPECT_EQ(inv_freq[i], kLlama31InvFreq[i]) << "index " << i;
  }

  // The three bands: wavelengths under 2048 keep their frequency, over 8192 are divided by 8,
  // and indices 29..34 are interpolated between the two.
  RopeConfig plain;
  plain.theta = 500000.0;
  std::vector<float> unscaled = plain.InverseFrequencies(128);
  for (int i = 0; i < 64; ++i) {
    if (i <= 28) {
      EXPECT_EQ(inv_freq[i], unscaled[i]) << i;
    } else if (i >= 35) {
      EXPECT_EQ(inv_freq[i], unscaled[i] / 8.0f) << i;
    } else {
      EXPECT_LT(inv_freq[i], unscaled[i]) << i;
      EXPECT_GT(inv_freq[i], unscaled[i] / 8.0f) << i;
    }
  }
}

TEST(RopeConfigTest, DefaultIsWithinOneUlpOfExactMath) {
  for (double theta : {10000.0, 500000.0, 1000000.0}) {
    RopeConfig rope;
    rope.theta = theta;
    for (int head_dim : {64, 128}) {
      std::vector<float> inv_freq = rope.InverseFrequencies(head_dim);
      for (int i = 0; i < head_dim / 2; ++i) {
        double exact = 1.0 / std::pow(theta, static_cast<float>(2 * i) / head_dim);
        EXPECT_NEAR(inv_freq[i], exact, exact * 1.2e-7) << theta << " " << head_dim << " " << i;
      }
    }
  }
}

TEST(RopeConfigTest, LinearDividesByFactor) {
  RopeConfig plain;
  RopeConfig linear;
  linear.type = RopeConfig::Type::kLinear;
  linear.factor = 4.0;
  std::vector<float> unscaled = plain.InverseFrequencies(64);
  std::vector<float> scaled = linear.InverseFrequencies(64);
  for (size_t i = 0; i < scaled.size(); ++i) EXPECT_EQ(scaled[i], unscaled[i] / 4.0f);
}

}  // namespace
}  // namespace duet

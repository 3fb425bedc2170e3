// A standalone driver for LLVMFuzzerTestOneInput, for compilers without libFuzzer: runs the
// seeds, then N inputs made by stacking random mutations on them (bit flips, byte edits,
// insertions, deletions, splices, header-length tweaks, JSON token and number injection).
//
//   fuzz_weights [iterations] [random_seed]   run; exits non-zero only by crashing
//   fuzz_weights --write-corpus DIR           write the seeds as files, for a libFuzzer run
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "common/check.h"
#include "model/model_config.h"
#include "model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace duet {
namespace {

// Selector bytes understood by weights_fuzz_target.cpp.
constexpr char kSafetensorsTarget = 0;
constexpr char kConfigTarget = 1;

struct Seed {
  char target;
  std::string payload;
  bool valid = true;  // the parser must accept it unmutated
};

std::string LittleEndian64(uint64_t value) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  return bytes;
}

uint64_t ReadLittleEndian64(const std::string& bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | static_cast<uint8_t>(bytes[i]);
  return value;
}

std::string SafetensorsImage(const std::string& header, const std::string& data) {
  return LittleEndian64(header.size()) + header + data;
}

std::string ReadFileOrEmpty(const std::string& path, size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes(max_bytes, '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(max_bytes));
  bytes.resize(static_cast<size_t>(in.gcount()));
  return bytes;
}

std::vector<Seed> MakeSeeds() {
  std::vector<Seed> seeds;
  auto safetensors = [&](const std::string& header, const std::string& data) {
    seeds.push_back({kSafetensorsTarget, SafetensorsImage(header, data)});
  };
  safetensors(R"({"__metadata__":{"format":"pt"},)"
              R"("w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
              R"("b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]}})",
              std::string("\x00\x00\x80\x3f\x00\x00\x00\x40\x00\x00\x40\x40\x00\x00\x80\x40"
                          "\x80\x3f\x00\xc0\x01\x00",
                          22));
  safetensors(R"({"h":{"dtype":"F16","shape":[4],"data_offsets":[0,8]},)"
              R"("d":{"dtype":"F64","shape":[1],"data_offsets":[8,16]},)"
              R"("l":{"dtype":"I64","shape":[1],"data_offsets":[16,24]},)"
              R"("i":{"dtype":"I32","shape":[1],"data_offsets":[24,28]},)"
              R"("s":{"dtype":"I16","shape":[1],"data_offsets":[28,30]},)"
              R"("c":{"dtype":"I8","shape":[1],"data_offsets":[30,31]},)"
              R"("u":{"dtype":"U8","shape":[],"data_offsets":[31,32]},)"
              R"("t":{"dtype":"BOOL","shape":[1,1],"data_offsets":[32,33]},)"
              R"("e":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[33,34]},)"
              R"("m":{"dtype":"F8_E5M2","shape":[1],"data_offsets":[34,35]},)"
              R"("z":{"dtype":"F32","shape":[0,3],"data_offsets":[35,35]}})",
              std::string("\x00\x3c\x01\x00\xff\x7b\x00\xfc", 8) + std::string(27, '\x11'));
  safetensors("{}", "");
  safetensors("{}        ", "");  // the format allows trailing-space padding
  // A real shard's header (with only the start of its data): fails on offsets after parsing all.
  std::string shard = ReadFileOrEmpty(
      std::string(DUET_MODELS_DIR) + "/tiny-code-llama-draft/model.safetensors", 4096);
  if (shard.size() >= 8) seeds.push_back({kSafetensorsTarget, shard, /*valid=*/false});

  for (const char* model : {"tiny-code-llama", "tiny-code-llama-draft"}) {
    std::string config =
        ReadFileOrEmpty(std::string(DUET_MODELS_DIR) + "/" + model + "/config.json", 1 << 20);
    if (!config.empty()) seeds.push_back({kConfigTarget, config});
  }
  for (const char* config : {
           R"({"architectures":["LlamaForCausalLM"],"attention_bias":false,"bos_token_id":128000,
              "eos_token_id":[128001,128008,128009],"hidden_act":"silu","hidden_size":4096,
              "intermediate_size":14336,"max_position_embeddings":131072,"mlp_bias":false,
              "model_type":"llama","num_attention_heads":32,"num_hidden_layers":32,
              "num_key_value_heads":8,"rms_norm_eps":1e-05,"rope_scaling":{"factor":8.0,
              "low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192,
              "rope_type":"llama3"},"rope_theta":500000.0,"tie_word_embeddings":false,
              "vocab_size":128256})",
           R"({"architectures":["Qwen2ForCausalLM"],"bos_token_id":151643,"eos_token_id":151645,
              "hidden_act":"silu","hidden_size":896,"intermediate_size":4864,
              "max_position_embeddings":32768,"model_type":"qwen2","num_attention_heads":14,
              "num_hidden_layers":24,"num_key_value_heads":2,"rms_norm_eps":1e-06,
              "rope_theta":1000000.0,"sliding_window":32768,"tie_word_embeddings":true,
              "use_sliding_window":false,"vocab_size":151936})",
           R"({"architectures":["MistralForCausalLM"],"hidden_size":4096,"intermediate_size":14336,
              "max_position_embeddings":32768,"model_type":"mistral","num_attention_heads":32,
              "num_hidden_layers":32,"num_key_value_heads":8,"rope_theta":1000000.0,
              "sliding_window":null,"vocab_size":32000})",
           R"({"model_type":"llama","hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,
              "num_attention_heads":4,"max_position_embeddings":256,"vocab_size":100,
              "head_dim":32,"rope_parameters":{"rope_type":"linear","factor":2.0,
              "rope_theta":10000.0}})",
       }) {
    seeds.push_back({kConfigTarget, config});
  }
  return seeds;
}

// Valid seeds must be accepted, or the fuzzer would only ever explore early rejections.
void CheckSeedsAccepted(const std::vector<Seed>& seeds) {
  for (const Seed& seed : seeds) {
    if (!seed.valid) continue;
    bool accepted;
    if (seed.target == kConfigTarget) {
      accepted = ParseModelConfig(seed.payload).ok();
    } else {
      accepted = SafetensorsFile::Parse(
                     absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(seed.payload.data()),
                                         seed.payload.size()),
                     "seed")
                     .ok();
    }
    DUET_CHECK_MSG(accepted, seed.target == kConfigTarget ? "a config seed" : "a safetensors seed");
  }
}

class Mutator {
 public:
  Mutator(uint64_t random_seed, const std::vector<Seed>& seeds)
      : random_(random_seed), seeds_(seeds) {}

  // A random seed with 1..5 stacked mutations, as selector byte + payload.
  std::string Next() {
    const Seed& seed = seeds_[Below(seeds_.size())];
    std::string payload = seed.payload;
    // Half the safetensors inputs mutate only the JSON header and keep the length prefix right,
    // so mutations get past the length check into the header and offset validation.
    bool header_only = seed.target == kSafetensorsTarget && Below(2) == 0 &&
                       payload.size() >= 8 && ReadLittleEndian64(payload) <= payload.size() - 8;
    size_t count = 1 + Below(5);
    if (header_only) {
      uint64_t header_len = ReadLittleEndian64(payload);
      std::string header = payload.substr(8, header_len);
      std::string data = payload.substr(8 + header_len);
      for (size_t i = 0; i < count; ++i) MutateText(header, seed.target);
      payload = SafetensorsImage(header, data);
    } else {
      for (size_t i = 0; i < count; ++i) {
        if (seed.target == kSafetensorsTarget && Below(6) == 0) {
          TweakHeaderLength(payload);
        } else {
          MutateText(payload, seed.target);
        }
      }
    }
    return std::string(1, seed.target) + payload;
  }

 private:
  size_t Below(size_t bound) { return bound == 0 ? 0 : random_() % bound; }
  size_t Position(const std::string& text) { return Below(text.size() + 1); }

  void MutateText(std::string& text, char target) {
    static const char* const kTokens[] = {
        "{", "}", "[", "]", ",", ":", "\"", "\\", "null", "true", "false", "-", "0", "-1",
        "1e400", "-0.0", "18446744073709551616", "9223372036854775807", "\"F32\"", "\"BF16\"",
        "\"F16\"", "\"Q4\"", "\"shape\"", "\"dtype\"", "\"data_offsets\"", "\"__metadata__\"",
        "\"rope_type\"", "\"llama3\"", "\"yarn\"", "\"head_dim\"", "\"num_key_value_heads\"",
        "\"rope_parameters\"", "\"rope_scaling\"", "\"eos_token_id\"", "\\u0000", "\xc3\x28",
        "[[[[[[[[", "{\"a\":{\"a\":{\"a\":", "[0,8]", "[8,0]", "[]", "{}"};
    static const char* const kNumbers[] = {
        "0", "1", "2", "-1", "7", "8", "9", "16", "64", "65535", "4294967296", "2147483648",
        "9223372036854775807", "9223372036854775808", "-9223372036854775808",
        "18446744073709551615", "99999999999999999999999", "1e308", "1e-320", "0.5", "2.5",
        "-0", "1e400"};
    switch (Below(9)) {
      case 0:  // flip one bit
        if (!text.empty()) text[Below(text.size())] ^= static_cast<char>(1 << Below(8));
        break;
      case 1: {  // overwrite a byte with a structurally interesting or random value
        static const char kBytes[] = {0, '\xff', '\x7f', '\x80', '"', '{', '}', '[', ']', ',',
                                      ':', '-', '0', '9', ' ', '\n'};
        if (text.empty()) break;
        text[Below(text.size())] = Below(4) == 0 ? static_cast<char>(random_())
                                                 : kBytes[Below(sizeof(kBytes))];
        break;
      }
      case 2: {  // insert random bytes
        std::string bytes(1 + Below(8), '\0');
        for (char& c : bytes) c = static_cast<char>(random_());
        text.insert(Position(text), bytes);
        break;
      }
      case 3:  // delete a range
        if (!text.empty()) {
          size_t at = Below(text.size());
          text.erase(at, 1 + Below(16));
        }
        break;
      case 4:  // duplicate a range somewhere else
        if (!text.empty()) {
          size_t at = Below(text.size());
          std::string piece = text.substr(at, 1 + Below(32));
          text.insert(Position(text), piece);
        }
        break;
      case 5: {  // splice: our prefix, another same-target seed's suffix
        const Seed& other = seeds_[Below(seeds_.size())];
        if (other.target != target) break;
        text = text.substr(0, Position(text)) + other.payload.substr(Below(other.payload.size()));
        break;
      }
      case 6:
      case 7:  // insert a JSON token
        text.insert(Position(text), kTokens[Below(std::size(kTokens))]);
        break;
      case 8: {  // replace the next number with an interesting one
        size_t begin = text.find_first_of("0123456789", Position(text));
        if (begin == std::string::npos) break;
        size_t end = text.find_first_not_of("0123456789.eE+-", begin);
        if (end == std::string::npos) end = text.size();
        text.replace(begin, end - begin, kNumbers[Below(std::size(kNumbers))]);
        break;
      }
    }
  }

  void TweakHeaderLength(std::string& image) {
    if (image.size() < 8) {
      image.resize(8 + Below(8), '\0');
      return;
    }
    const uint64_t length = ReadLittleEndian64(image);
    const uint64_t remaining = image.size() - 8;
    const uint64_t choices[] = {0,
                                length + 1,
                                length - 1,
                                length + 1 + Below(64),
                                remaining,
                                remaining + 1,
                                100'000'000,
                                100'000'001,
                                uint64_t{1} << 63,
                                ~uint64_t{0},
                                random_()};
    image.replace(0, 8, LittleEndian64(choices[Below(std::size(choices))]));
  }

  std::mt19937_64 random_;
  const std::vector<Seed>& seeds_;
};

int WriteCorpus(const std::string& dir, const std::vector<Seed>& seeds) {
  std::filesystem::create_directories(dir);
  for (size_t i = 0; i < seeds.size(); ++i) {
    std::ofstream(dir + "/seed-" + std::to_string(i), std::ios::binary)
        << seeds[i].target << seeds[i].payload;
  }
  std::printf("wrote %zu seeds to %s\n", seeds.size(), dir.c_str());
  return 0;
}

int Run(int argc, char** argv) {
  const std::vector<Seed> seeds = MakeSeeds();
  if (argc == 3 && std::string(argv[1]) == "--write-corpus") return WriteCorpus(argv[2], seeds);
  const long iterations = argc > 1 ? std::strtol(argv[1], nullptr, 10) : 20000;
  const uint64_t random_seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1;

  CheckSeedsAccepted(seeds);
  auto run = [](const std::string& input) {
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(input.data()), input.size());
  };
  for (const Seed& seed : seeds) run(std::string(1, seed.target) + seed.payload);

  Mutator mutator(random_seed, seeds);
  const auto start = std::chrono::steady_clock::now();
  for (long i = 0; i < iterations; ++i) run(mutator.Next());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("fuzz_weights: %zu seeds + %ld mutated inputs (random seed %llu) in %.2f s, "
              "no crashes\n",
              seeds.size(), iterations, static_cast<unsigned long long>(random_seed), seconds);
  return 0;
}

}  // namespace
}  // namespace duet

int main(int argc, char** argv) { return duet::Run(argc, argv); }

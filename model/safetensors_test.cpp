#include "model/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace duet {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Json = nlohmann::json;

constexpr char kShardedModel[] = DUET_MODELS_DIR "/tiny-code-llama";
constexpr char kDraftModel[] = DUET_MODELS_DIR "/tiny-code-llama-draft";

// A safetensors image: little-endian header length, header text, data bytes.
std::string Image(const std::string& header, const std::string& data) {
  std::string bytes(8, '\0');
  uint64_t length = header.size();
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  return bytes + header + data;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> ParseBytes(const std::string& bytes,
                                                            const std::string& label = "mem") {
  return SafetensorsFile::Parse(
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()), label);
}

std::string MakeTempDir(const std::string& name) {
  std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / ("safetensors_test_" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

template <typename T>
std::string Raw(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF64), 8u);
  EXPECT_EQ(DTypeSize(DType::kI64), 8u);
  EXPECT_EQ(DTypeSize(DType::kI32), 4u);
  EXPECT_EQ(DTypeSize(DType::kI16), 2u);
  EXPECT_EQ(DTypeSize(DType::kI8), 1u);
  EXPECT_EQ(DTypeSize(DType::kU8), 1u);
  EXPECT_EQ(DTypeSize(DType::kBool), 1u);
  EXPECT_EQ(DTypeSize(DType::kF8E4M3), 1u);
  EXPECT_EQ(DTypeSize(DType::kF8E5M2), 1u);
  EXPECT_STREQ(DTypeName(DType::kBF16), "BF16");
  EXPECT_STREQ(DTypeName(DType::kF8E4M3), "F8_E4M3");
  EXPECT_STREQ(DTypeName(DType::kBool), "BOOL");
}

TEST(ConversionTest, BFloat16EdgeValues) {
  EXPECT_EQ(BFloat16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(BFloat16ToFloat(0xc000), -2.0f);
  EXPECT_EQ(BFloat16ToFloat(0x0000), 0.0f);
  EXPECT_TRUE(std::signbit(BFloat16ToFloat(0x8000)));
  EXPECT_EQ(BFloat16ToFloat(0x7f80), std::numeric_limits<float>::infinity());
  EXPECT_EQ(BFloat16ToFloat(0xff80), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(0x7fc0)));
  EXPECT_EQ(BFloat16ToFloat(0x0001), std::ldexp(1.0f, -133));  // smallest subnormal
  EXPECT_EQ(BFloat16ToFloat(0x7f7f), std::ldexp(255.0f, 120));  // largest finite
}

TEST(ConversionTest, Float16EdgeValues) {
  EXPECT_EQ(Float16ToFloat(0x3c00), 1.0f);
  EXPECT_EQ(Float16ToFloat(0xc000), -2.0f);
  EXPECT_EQ(Float16ToFloat(0x3555), 0.333251953125f);
  EXPECT_EQ(Float16ToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(Float16ToFloat(0x0400), std::ldexp(1.0f, -14));        // smallest normal
  EXPECT_EQ(Float16ToFloat(0x03ff), std::ldexp(1023.0f, -24));     // largest subnormal
  EXPECT_EQ(Float16ToFloat(0x0001), std::ldexp(1.0f, -24));        // smallest subnormal
  EXPECT_EQ(Float16ToFloat(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_EQ(Float16ToFloat(0x0000), 0.0f);
  EXPECT_TRUE(std::signbit(Float16ToFloat(0x8000)));
  EXPECT_EQ(Float16ToFloat(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(Float16ToFloat(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(Float16ToFloat(0x7e00)));
  EXPECT_TRUE(std::isnan(Float16ToFloat(0x7c01)));  // signalling nan stays nan
  EXPECT_TRUE(std::isnan(Float16ToFloat(0xfe00)));
}

// Every half-precision value against the format's definition.
TEST(ConversionTest, Float16AllValuesExact) {
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const int sign = (bits & 0x8000) ? -1 : 1;
    const int exponent = (bits >> 10) & 0x1f;
    const int mantissa = bits & 0x3ff;
    const float actual = Float16ToFloat(static_cast<uint16_t>(bits));
    if (exponent == 0x1f) {
      if (mantissa == 0) {
        EXPECT_EQ(actual, sign * std::numeric_limits<float>::infinity()) << bits;
      } else {
        EXPECT_TRUE(std::isnan(actual)) << bits;
      }
      continue;
    }
    const double expected = exponent == 0 ? sign * std::ldexp(mantissa, -24)
                                          : sign * std::ldexp(1024 + mantissa, exponent - 25);
    ASSERT_EQ(actual, static_cast<float>(expected)) << bits;
    ASSERT_EQ(std::signbit(actual), sign < 0) << bits;
  }
}

TEST(ConversionTest, FloatToBFloat16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToBFloat16(std::bit_cast<float>(0x3f808000u)), 0x3f80);  // tie, even below
  EXPECT_EQ(FloatToBFloat16(std::bit_cast<float>(0x3f818000u)), 0x3f82);  // tie, even above
  EXPECT_EQ(FloatToBFloat16(std::bit_cast<float>(0x3f808001u)), 0x3f81);  // above the tie
  EXPECT_EQ(FloatToBFloat16(std::bit_cast<float>(0x3f807fffu)), 0x3f80);  // below the tie
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7f80);  // rounds to inf
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(FloatToBFloat16(-0.0f), 0x8000);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::nanf("")))));
  // A nan whose payload lives only in the low bits must not round into infinity.
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::bit_cast<float>(0x7f800001u)))));
  // Every non-nan bf16 survives the round trip.
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    float value = BFloat16ToFloat(static_cast<uint16_t>(bits));
    if (std::isnan(value)) continue;
    ASSERT_EQ(FloatToBFloat16(value), bits);
  }
}

TEST(SafetensorsFileTest, ParsesValidImage) {
  std::vector<float> weights = {1, 2, 3, 4};
  std::vector<uint16_t> bias = {0x3f80, 0xc000, 0x0000};
  std::string data = Raw(weights) + Raw(bias);
  std::string header = R"({"__metadata__": {"format": "pt"},
    "w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
    "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]},
    "empty": {"dtype": "I64", "shape": [0, 5], "data_offsets": [22, 22]},
    "scalar": {"dtype": "U8", "shape": [], "data_offsets": [22, 23]}})";
  std::string bytes = Image(header, data + "x");
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = ParseBytes(bytes, "good.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  const auto& tensors = (*file)->tensors();
  ASSERT_EQ(tensors.size(), 4u);
  EXPECT_THAT((*file)->metadata(), ElementsAre(std::pair<const std::string, std::string>(
                                       "format", "pt")));
  const TensorView& w = tensors.at("w");
  EXPECT_EQ(w.name, "w");
  EXPECT_EQ(w.dtype, DType::kF32);
  EXPECT_THAT(w.shape, ElementsAre(2, 2));
  EXPECT_EQ(w.numel(), 4);
  EXPECT_EQ(w.nbytes, 16u);
  EXPECT_EQ(w.file, "good.safetensors");
  EXPECT_EQ(std::memcmp(w.data, weights.data(), 16), 0);
  EXPECT_EQ(tensors.at("b").data, w.data + 16);
  EXPECT_EQ(tensors.at("empty").numel(), 0);
  EXPECT_EQ(tensors.at("scalar").numel(), 1);
  EXPECT_EQ(*tensors.at("scalar").data, 'x');
}

struct CorruptCase {
  const char* name;
  std::string bytes;
  const char* message;  // expected in the error, besides the file label
};

// Every corruption of the format the loader must reject with a clear error.
std::vector<CorruptCase> CorruptCases() {
  const std::string data16(16, '\0');
  auto entry = [](const std::string& tensor, const std::string& body) {
    return "{\"" + tensor + "\": " + body + "}";
  };
  std::string huge_length = Image("{}", "");
  huge_length[7] = '\x01';  // header length 2^56
  std::string length_past_end = Image("{}", "");
  length_past_end[0] = 3;  // claims 3 header bytes, 2 present
  return {
      {"Empty", "", "too short"},
      {"SevenBytes", std::string(7, '\0'), "too short"},
      {"HeaderLengthAbsurd", huge_length, "exceeds the 100000000-byte limit"},
      {"HeaderLengthPastEnd", length_past_end, "truncated"},
      {"HeaderNotJson", Image("{\"w\": {\"dtype\": ", data16), "not valid JSON"},
      {"HeaderBinaryGarbage", Image(std::string("\x00\xff{", 3), data16), "not valid JSON"},
      {"HeaderNotObject", Image("[1, 2]", data16), "not a JSON object"},
      {"EntryNotObject", Image(entry("w", "[1]"), data16), "'w': header entry is not an object"},
      {"MissingDtype", Image(entry("w", R"({"shape": [4], "data_offsets": [0, 16]})"), data16),
       "'w': missing 'dtype'"},
      {"MissingShape", Image(entry("w", R"({"dtype": "F32", "data_offsets": [0, 16]})"), data16),
       "'w': missing 'shape'"},
      {"MissingOffsets", Image(entry("w", R"({"dtype": "F32", "shape": [4]})"), data16),
       "'w': missing 'data_offsets'"},
      {"UnknownDtype",
       Image(entry("w", R"({"dtype": "Q4_K", "shape": [4], "data_offsets": [0, 16]})"), data16),
       "unknown dtype 'Q4_K'"},
      {"DtypeNotString",
       Image(entry("w", R"({"dtype": 4, "shape": [4], "data_offsets": [0, 16]})"), data16),
       "'dtype' is not a string"},
      {"ShapeNotList",
       Image(entry("w", R"({"dtype": "F32", "shape": 4, "data_offsets": [0, 16]})"), data16),
       "'shape' is not a list"},
      {"NegativeDim",
       Image(entry("w", R"({"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]})"), data16),
       "not a non-negative integer"},
      {"FractionalDim",
       Image(entry("w", R"({"dtype": "F32", "shape": [2.5], "data_offsets": [0, 16]})"), data16),
       "not a non-negative integer"},
      {"NumelOverflow",
       Image(entry("w", R"({"dtype": "U8", "shape": [4294967296, 4294967296],
                            "data_offsets": [0, 16]})"),
             data16),
       "overflows"},
      {"ByteCountOverflow",
       Image(entry("w", R"({"dtype": "F32", "shape": [4611686018427387904],
                            "data_offsets": [0, 16]})"),
             data16),
       "overflows"},
      {"OffsetsWrongArity",
       Image(entry("w", R"({"dtype": "F32", "shape": [4], "data_offsets": [0]})"), data16),
       "not two non-negative integers"},
      {"NegativeOffset",
       Image(entry("w", R"({"dtype": "F32", "shape": [4], "data_offsets": [-16, 0]})"), data16),
       "not two non-negative integers"},
      {"EndBeforeBegin",
       Image(entry("w", R"({"dtype": "F32", "shape": [0], "data_offsets": [8, 4]})"), data16),
       "end before begin"},
      {"EndPastDataSection",
       Image(entry("w", R"({"dtype": "F32", "shape": [8], "data_offsets": [0, 32]})"), data16),
       "past the data section"},
      {"SizeMismatch",
       Image(entry("w", R"({"dtype": "F32", "shape": [3], "data_offsets": [0, 16]})"), data16),
       "needs 12 bytes"},
      {"Overlap",
       Image(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                 "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
             data16),
       "'b': data overlaps tensor 'a'"},
      {"EmptyTensorInsideAnother",
       Image(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                 "z": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}})",
             data16),
       "overlaps"},
      {"DuplicateName",
       Image(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                 "a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
             data16),
       "'a' twice"},
      {"MetadataNotObject", Image(R"({"__metadata__": "pt"})", ""), "__metadata__"},
      {"MetadataValueNotString", Image(R"({"__metadata__": {"format": 1}})", ""),
       "__metadata__ value for 'format'"},
  };
}

class SafetensorsCorruptionTest : public ::testing::TestWithParam<CorruptCase> {};

TEST_P(SafetensorsCorruptionTest, RejectedInMemoryAndOnDisk) {
  const CorruptCase& c = GetParam();
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> parsed = ParseBytes(c.bytes, "bad.bin");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(parsed.status().message(), HasSubstr("bad.bin: "));
  EXPECT_THAT(parsed.status().message(), HasSubstr(c.message));

  std::string path = MakeTempDir(std::string("corrupt_") + c.name) + "/model.safetensors";
  WriteBytes(path, c.bytes);
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> opened = SafetensorsFile::Open(path);
  ASSERT_FALSE(opened.ok());
  EXPECT_THAT(opened.status().message(), HasSubstr(path));
  EXPECT_THAT(opened.status().message(), HasSubstr(c.message));
}

INSTANTIATE_TEST_SUITE_P(AllCorruptions, SafetensorsCorruptionTest,
                         ::testing::ValuesIn(CorruptCases()),
                         [](const ::testing::TestParamInfo<CorruptCase>& info) {
                           return info.param.name;
                         });

TEST(SafetensorsFileTest, MissingFileIsNotFound) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::Open(MakeTempDir("missing") + "/nope.safetensors");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
}

TEST(SafetensorsFileTest, TruncatedRealShardIsRejected) {
  const std::string shard = ReadBytes(std::string(kShardedModel) +
                                      "/model-00001-of-00004.safetensors");
  ASSERT_GT(shard.size(), 1000u);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(shard[i]);
  const size_t data_start = 8 + header_len;
  ASSERT_TRUE(ParseBytes(shard).ok());
  for (size_t cut : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{100},
                     data_start - 1, data_start, data_start + 1, data_start + 4096,
                     shard.size() / 2, shard.size() - 2, shard.size() - 1}) {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
        ParseBytes(shard.substr(0, cut), "cut.safetensors");
    ASSERT_FALSE(file.ok()) << "cut at " << cut;
    EXPECT_THAT(file.status().message(), HasSubstr("cut.safetensors")) << cut;
  }
  // Past the header, the error names the first tensor that no longer fits.
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> tail_cut =
      ParseBytes(shard.substr(0, shard.size() - 1), "cut.safetensors");
  EXPECT_THAT(tail_cut.status().message(), HasSubstr("model.layers.0.self_attn.v_proj.weight"));
  EXPECT_THAT(tail_cut.status().message(), HasSubstr("truncated"));

  // And a truncated file on disk, through Open.
  std::string path = MakeTempDir("truncated_shard") + "/shard.safetensors";
  WriteBytes(path, shard.substr(0, shard.size() / 3));
  EXPECT_FALSE(SafetensorsFile::Open(path).ok());
}

TEST(WeightStoreTest, OpensBundledShardedCheckpoint) {
  absl::StatusOr<std::unique_ptr<WeightStore>> store = WeightStore::Open(kShardedModel);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->Names().size(), 57u);  // embed, norm, lm_head, 6 layers × 9
  for (const char* name : {"model.embed_tokens.weight", "lm_head.weight"}) {
    absl::StatusOr<const TensorView*> tensor = (*store)->Get(name);
    ASSERT_TRUE(tensor.ok()) << tensor.status();
    EXPECT_EQ((*tensor)->dtype, DType::kBF16);
    EXPECT_THAT((*tensor)->shape, ElementsAre(8192, 512));
    EXPECT_EQ((*tensor)->nbytes, 8192u * 512 * 2);
  }
  absl::StatusOr<const TensorView*> k_proj = (*store)->Get("model.layers.5.self_attn.k_proj.weight");
  ASSERT_TRUE(k_proj.ok());
  EXPECT_THAT((*k_proj)->shape, ElementsAre(256, 512));  // 4 kv heads × 64
  EXPECT_THAT((*store)->Get("model.embed_tokens.weight").value()->file,
              HasSubstr("model-00001-of-00004.safetensors"));
  EXPECT_TRUE((*store)->Has("model.norm.weight"));
  EXPECT_FALSE((*store)->Has("model.layers.6.mlp.up_proj.weight"));
  absl::StatusOr<const TensorView*> missing = (*store)->Get("model.layers.6.mlp.up_proj.weight");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("model.layers.6.mlp.up_proj.weight"));

  // ReadFloat32 of bf16 agrees with converting the raw bytes one by one.
  const TensorView* norm = (*store)->Get("model.norm.weight").value();
  std::vector<float> values(512);
  ASSERT_TRUE((*store)->ReadFloat32("model.norm.weight", {512}, absl::MakeSpan(values)).ok());
  for (size_t i = 0; i < values.size(); ++i) {
    uint16_t bits;
    std::memcpy(&bits, norm->data + 2 * i, 2);
    ASSERT_EQ(std::bit_cast<uint32_t>(values[i]), std::bit_cast<uint32_t>(BFloat16ToFloat(bits)));
  }
}

TEST(WeightStoreTest, ReadFloat32ChecksShapeAndBuffer) {
  absl::StatusOr<std::unique_ptr<WeightStore>> store = WeightStore::Open(kShardedModel);
  ASSERT_TRUE(store.ok()) << store.status();
  std::vector<float> values(8192 * 512);
  absl::Status transposed = (*store)->ReadFloat32("model.embed_tokens.weight", {512, 8192},
                                                  absl::MakeSpan(values));
  EXPECT_EQ(transposed.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(transposed.message(), HasSubstr("model.embed_tokens.weight"));
  EXPECT_THAT(transposed.message(), HasSubstr("expected shape [512, 8192], got [8192, 512]"));
  absl::Status flattened = (*store)->ReadFloat32("model.embed_tokens.weight", {8192 * 512},
                                                 absl::MakeSpan(values));
  EXPECT_EQ(flattened.code(), absl::StatusCode::kInvalidArgument);
  absl::Status small_buffer = (*store)->ReadFloat32("model.embed_tokens.weight", {8192, 512},
                                                    absl::MakeSpan(values).subspan(1));
  EXPECT_EQ(small_buffer.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*store)->ReadFloat32("nope", {1}, absl::MakeSpan(values).first(1)).code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE((*store)->ReadFloat32("model.embed_tokens.weight", {8192, 512},
                                    absl::MakeSpan(values)).ok());
}

TEST(WeightStoreTest, OpensBundledSingleFileDraft) {
  absl::StatusOr<std::unique_ptr<WeightStore>> store = WeightStore::Open(kDraftModel);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->Names().size(), 20u);  // embed, norm, 2 layers × 9; lm_head is tied
  EXPECT_FALSE((*store)->Has("lm_head.weight"));
  absl::StatusOr<const TensorView*> embed = (*store)->Get("model.embed_tokens.weight");
  ASSERT_TRUE(embed.ok());
  EXPECT_EQ((*embed)->dtype, DType::kBF16);
  EXPECT_THAT((*embed)->shape, ElementsAre(8192, 256));
  absl::StatusOr<const TensorView*> gate = (*store)->Get("model.layers.1.mlp.gate_proj.weight");
  ASSERT_TRUE(gate.ok());
  EXPECT_THAT((*gate)->shape, ElementsAre(704, 256));
}

TEST(WeightStoreTest, ReadFloat32ConvertsEveryFloatDtype) {
  std::vector<float> f32 = {1.5f, -2.25f};
  std::vector<uint16_t> f16 = {0x3c00, 0x0001, 0xfc00};
  std::vector<uint16_t> bf16 = {0x3f80, 0xc000};
  std::vector<int32_t> i32 = {7};
  std::string data = Raw(f32) + Raw(f16) + Raw(bf16) + Raw(i32);
  std::string header = R"({
    "f32": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    "f16": {"dtype": "F16", "shape": [3], "data_offsets": [8, 14]},
    "bf16": {"dtype": "BF16", "shape": [1, 2], "data_offsets": [14, 18]},
    "i32": {"dtype": "I32", "shape": [1], "data_offsets": [18, 22]}})";
  std::string dir = MakeTempDir("dtypes");
  WriteBytes(dir + "/model.safetensors", Image(header, data));
  absl::StatusOr<std::unique_ptr<WeightStore>> store = WeightStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();

  std::vector<float> out(3);
  ASSERT_TRUE((*store)->ReadFloat32("f32", {2}, absl::MakeSpan(out).first(2)).ok());
  EXPECT_THAT(std::vector<float>(out.begin(), out.begin() + 2), ElementsAre(1.5f, -2.25f));
  ASSERT_TRUE((*store)->ReadFloat32("f16", {3}, absl::MakeSpan(out)).ok());
  EXPECT_THAT(out, ElementsAre(1.0f, std::ldexp(1.0f, -24), -std::numeric_limits<float>::infinity()));
  ASSERT_TRUE((*store)->ReadFloat32("bf16", {1, 2}, absl::MakeSpan(out).first(2)).ok());
  EXPECT_THAT(std::vector<float>(out.begin(), out.begin() + 2), ElementsAre(1.0f, -2.0f));
  absl::Status integer = (*store)->ReadFloat32("i32", {1}, absl::MakeSpan(out).first(1));
  EXPECT_EQ(integer.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(integer.message(), HasSubstr("I32"));
}

// A sharded checkpoint in a temp dir: `shards` maps file name → header; the index is given.
std::string WriteShardedDir(const std::string& name,
                            const std::vector<std::pair<std::string, std::string>>& shards,
                            const std::string& index) {
  std::string dir = MakeTempDir(name);
  for (const auto& [file, header] : shards) WriteBytes(dir + "/" + file, Image(header, std::string(8, '\0')));
  WriteBytes(dir + "/model.safetensors.index.json", index);
  return dir;
}

constexpr char kShardA[] = R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})";
constexpr char kShardB[] = R"({"b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})";

TEST(WeightStoreTest, SmallShardedCheckpoint) {
  std::string dir = WriteShardedDir(
      "sharded_ok", {{"a.safetensors", kShardA}, {"b.safetensors", kShardB}},
      R"({"metadata": {}, "weight_map": {"a": "a.safetensors", "b": "b.safetensors"}})");
  absl::StatusOr<std::unique_ptr<WeightStore>> store = WeightStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_THAT((*store)->Names(), ElementsAre("a", "b"));
}

struct ShardErrorCase {
  const char* name;
  std::vector<std::pair<std::string, std::string>> shards;
  const char* index;
  absl::StatusCode code;
  const char* message;
};

class WeightStoreShardErrorTest : public ::testing::TestWithParam<ShardErrorCase> {};

TEST_P(WeightStoreShardErrorTest, ReturnsClearError) {
  const ShardErrorCase& c = GetParam();
  std::string dir = WriteShardedDir(std::string("shard_error_") + c.name, c.shards, c.index);
  absl::StatusOr<std::unique_ptr<WeightStore>> store = WeightStore::Open(dir);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), c.code) << store.status();
  EXPECT_THAT(store.status().message(), HasSubstr(c.message));
}

INSTANTIATE_TEST_SUITE_P(
    AllShardErrors, WeightStoreShardErrorTest,
    ::testing::Values(
        ShardErrorCase{"EscapingShardPath",
                       {{"a.safetensors", kShardA}},
                       R"({"weight_map": {"a": "../a.safetensors"}})",
                       absl::StatusCode::kInvalidArgument, "leaves the model directory"},
        ShardErrorCase{"NestedEscape",
                       {{"a.safetensors", kShardA}},
                       R"({"weight_map": {"a": "sub/../../a.safetensors"}})",
                       absl::StatusCode::kInvalidArgument, "leaves the model directory"},
        ShardErrorCase{"AbsoluteShardPath",
                       {{"a.safetensors", kShardA}},
                       R"({"weight_map": {"a": "/etc/passwd"}})",
                       absl::StatusCode::kInvalidArgument, "leaves the model directory"},
        ShardErrorCase{"EmptyShardPath",
                       {{"a.safetensors", kShardA}},
                       R"({"weight_map": {"a": ""}})", absl::StatusCode::kInvalidArgument,
                       "leaves the model directory"},
        ShardErrorCase{"TensorNotInItsShard",
                       {{"a.safetensors", kShardA}, {"b.safetensors", kShardB}},
                       R"({"weight_map": {"a": "a.safetensors", "b": "a.safetensors"}})",
                       absl::StatusCode::kNotFound, "places tensor 'b' in a.safetensors"},
        ShardErrorCase{"MissingShardFile",
                       {{"a.safetensors", kShardA}},
                       R"({"weight_map": {"a": "a.safetensors", "b": "b.safetensors"}})",
                       absl::StatusCode::kNotFound, "b.safetensors"},
        ShardErrorCase{"CorruptShard",
                       {{"a.safetensors", "{\"a\": 1}"}},
                       R"({"weight_map": {"a": "a.safetensors"}})",
                       absl::StatusCode::kInvalidArgument, "a.safetensors: tensor 'a'"},
        ShardErrorCase{"IndexNotJson", {}, "{\"weight_map\": ", absl::StatusCode::kInvalidArgument,
                       "not valid JSON"},
        ShardErrorCase{"IndexWithoutWeightMap", {}, R"({"metadata": {}})",
                       absl::StatusCode::kInvalidArgument, "weight_map"},
        ShardErrorCase{"IndexNotObject", {}, "[]", absl::StatusCode::kInvalidArgument,
                       "weight_map"},
        ShardErrorCase{"ShardNameNotString", {}, R"({"weight_map": {"a": 3}})",
                       absl::StatusCode::kInvalidArgument, "'a' is not a string"},
        ShardErrorCase{"EmptyWeightMap", {}, R"({"weight_map": {}})",
                       absl::StatusCode::kInvalidArgument, "no tensors"}),
    [](const ::testing::TestParamInfo<ShardErrorCase>& info) { return info.param.name; });

// The same tensor name in two shards (each shard otherwise consistent with the index).
TEST(WeightStoreTest, DuplicateTensorAcrossShardsIsRejected) {
  std::string both = R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                         "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})";
  std::string dir = WriteShardedDir(
      "duplicate_across_shards", {{"a.safetensors", kShardA}, {"ab.safetensors", both}},
      R"({"weight_map": {"a": "a.safetensors", "b": "ab.safetensors"}})");
  absl::StatusOr<std::unique_ptr<WeightStore>> store = WeightStore::Open(dir);
  ASSERT_FALSE(store.ok());
  EXPECT_THAT(store.status().message(), HasSubstr("tensor 'a' appears in both"));
  EXPECT_THAT(store.status().message(), HasSubstr("a.safetensors"));
  EXPECT_THAT(store.status().message(), HasSubstr("ab.safetensors"));
}

TEST(WeightStoreTest, EmptyDirectoryIsNotFound) {
  std::string dir = MakeTempDir("empty_dir");
  absl::StatusOr<std::unique_ptr<WeightStore>> store = WeightStore::Open(dir);
  EXPECT_EQ(store.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(store.status().message(), HasSubstr(dir));
  EXPECT_EQ(WeightStore::Open(dir + "/does-not-exist").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace duet

#include "model/safetensors.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <system_error>
#include <tuple>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/check.h"
#include "nlohmann/json.hpp"

namespace duet {
namespace {

using Json = nlohmann::json;

// The safetensors format caps the JSON header at 100 MB.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DTypeInfo {
  DType dtype;
  const char* name;  // as spelled in safetensors headers
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::kF32, "F32", 4},         {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2},       {DType::kF64, "F64", 8},
    {DType::kI64, "I64", 8},         {DType::kI32, "I32", 4},
    {DType::kI16, "I16", 2},         {DType::kI8, "I8", 1},
    {DType::kU8, "U8", 1},           {DType::kBool, "BOOL", 1},
    {DType::kF8E4M3, "F8_E4M3", 1},  {DType::kF8E5M2, "F8_E5M2", 1},
};

const DTypeInfo& Info(DType dtype) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.dtype == dtype) return info;
  }
  DUET_CHECK_MSG(false, "DType missing from kDTypes");
  return kDTypes[0];
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status HeaderError(const std::string& label, const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat(label, ": ", message));
}

absl::Status TensorError(const std::string& label, const std::string& tensor,
                         const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat(label, ": tensor '", tensor, "': ", message));
}

// Reads a JSON integer that must be >= 0 and fit in int64.
bool NonNegativeInt(const Json& value, int64_t& out) {
  if (!value.is_number_unsigned()) return false;  // nlohmann stores non-negative ints unsigned
  uint64_t v = value.get<uint64_t>();
  if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
  out = static_cast<int64_t>(v);
  return true;
}

// Fills `view` from one header entry, checking it against the data section's size.
absl::Status ParseEntry(const std::string& label, const std::string& name, const Json& entry,
                        const uint8_t* data_section, uint64_t data_size, TensorView& view) {
  if (!entry.is_object()) return TensorError(label, name, "header entry is not an object");
  auto dtype_it = entry.find("dtype");
  auto shape_it = entry.find("shape");
  auto offsets_it = entry.find("data_offsets");
  if (dtype_it == entry.end()) return TensorError(label, name, "missing 'dtype'");
  if (shape_it == entry.end()) return TensorError(label, name, "missing 'shape'");
  if (offsets_it == entry.end()) return TensorError(label, name, "missing 'data_offsets'");

  if (!dtype_it->is_string()) return TensorError(label, name, "'dtype' is not a string");
  const std::string& dtype_name = dtype_it->get_ref<const std::string&>();
  const DTypeInfo* dtype = nullptr;
  for (const DTypeInfo& info : kDTypes) {
    if (dtype_name == info.name) dtype = &info;
  }
  if (dtype == nullptr) return TensorError(label, name, absl::StrCat("unknown dtype '", dtype_name, "'"));

  if (!shape_it->is_array()) return TensorError(label, name, "'shape' is not a list");
  std::vector<int64_t> shape;
  int64_t numel = 1;
  for (const Json& dim_json : *shape_it) {
    int64_t dim = 0;
    if (!NonNegativeInt(dim_json, dim)) {
      return TensorError(label, name, absl::StrCat("shape ", shape_it->dump(),
                                                   " has a dimension that is not a non-negative "
                                                   "integer"));
    }
    if (__builtin_mul_overflow(numel, dim, &numel)) {
      return TensorError(label, name, absl::StrCat("shape ", shape_it->dump(), " overflows"));
    }
    shape.push_back(dim);
  }
  uint64_t nbytes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(numel), dtype->size, &nbytes)) {
    return TensorError(label, name, absl::StrCat("shape ", shape_it->dump(), " overflows"));
  }

  int64_t begin = 0;
  int64_t end = 0;
  if (!offsets_it->is_array() || offsets_it->size() != 2 ||
      !NonNegativeInt((*offsets_it)[0], begin) || !NonNegativeInt((*offsets_it)[1], end)) {
    return TensorError(label, name, absl::StrCat("'data_offsets' ", offsets_it->dump(),
                                                 " is not two non-negative integers"));
  }
  if (end < begin) {
    return TensorError(label, name,
                       absl::StrCat("data_offsets [", begin, ", ", end, "] end before begin"));
  }
  if (static_cast<uint64_t>(end) > data_size) {
    return TensorError(label, name,
                       absl::StrCat("data_offsets [", begin, ", ", end,
                                    "] run past the data section (", data_size,
                                    " bytes); is the file truncated?"));
  }
  if (static_cast<uint64_t>(end - begin) != nbytes) {
    return TensorError(label, name,
                       absl::StrCat("shape ", ShapeString(shape), " of ", dtype->name, " needs ",
                                    nbytes, " bytes but data_offsets [", begin, ", ", end,
                                    "] span ", end - begin));
  }

  view.name = name;
  view.dtype = dtype->dtype;
  view.shape = std::move(shape);
  view.data = data_section + begin;
  view.nbytes = nbytes;
  view.file = label;
  return absl::OkStatus();
}

// Element-wise conversions into float32; tight loops the compiler can keep in registers.
void ConvertBFloat16(const uint8_t* src, float* out, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    uint16_t bits;
    std::memcpy(&bits, src + 2 * i, sizeof(bits));
    out[i] = std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
  }
}

void ConvertFloat16(const uint8_t* src, float* out, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    uint16_t bits;
    std::memcpy(&bits, src + 2 * i, sizeof(bits));
    out[i] = Float16ToFloat(bits);
  }
}

bool EscapesDirectory(const std::string& relative_path) {
  std::filesystem::path path(relative_path);
  if (relative_path.empty() || path.is_absolute() || path.has_root_name()) return true;
  for (const std::filesystem::path& part : path) {
    if (part == "..") return true;
  }
  return false;
}

}  // namespace

size_t DTypeSize(DType dtype) { return Info(dtype).size; }
const char* DTypeName(DType dtype) { return Info(dtype).name; }

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t dim : shape) n *= dim;
  return n;
}

float BFloat16ToFloat(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

float Float16ToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  uint32_t result;
  if (exponent == 0x1f) {  // inf, or nan keeping its payload
    result = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent == 0) {  // zero or subnormal: mantissa × 2^-24, exact in float32
    result = sign | std::bit_cast<uint32_t>(static_cast<float>(mantissa) * 0x1p-24f);
  } else {  // rebias the exponent from 15 to 127
    result = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  return std::bit_cast<float>(result);
}

uint16_t FloatToBFloat16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // nan: truncate, forcing it to stay quiet
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  uint32_t round_to_nearest_even = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + round_to_nearest_even) >> 16);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  absl::StatusOr<std::unique_ptr<MappedFile>> mapped = MappedFile::Open(path);
  if (!mapped.ok()) return mapped.status();
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      Parse(absl::MakeConstSpan((*mapped)->data(), (*mapped)->size()), path);
  if (!file.ok()) return file.status();
  (*file)->file_ = *std::move(mapped);
  return file;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Parse(
    absl::Span<const uint8_t> bytes, const std::string& label) {
  if (bytes.size() < 8) {
    return HeaderError(label, absl::StrCat("file is ", bytes.size(),
                                           " bytes, too short for the 8-byte header length"));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];  // little-endian
  if (header_len > kMaxHeaderBytes) {
    return HeaderError(label, absl::StrCat("header length ", header_len, " exceeds the ",
                                           kMaxHeaderBytes, "-byte limit"));
  }
  if (header_len > bytes.size() - 8) {
    return HeaderError(label, absl::StrCat("header length ", header_len, " exceeds the ",
                                           bytes.size() - 8,
                                           " bytes after it; is the file truncated?"));
  }
  const char* header_begin = reinterpret_cast<const char*>(bytes.data() + 8);
  const uint8_t* data_section = bytes.data() + 8 + header_len;
  const uint64_t data_size = bytes.size() - 8 - header_len;

  // nlohmann keeps the last of duplicate keys; a duplicated tensor name is corruption.
  std::set<std::string> seen_names;
  std::string duplicate_name;
  auto find_duplicates = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (depth == 1 && event == Json::parse_event_t::key && duplicate_name.empty() &&
        !seen_names.insert(parsed.get<std::string>()).second) {
      duplicate_name = parsed.get<std::string>();
    }
    return true;
  };
  Json header;
  try {
    header = Json::parse(header_begin, header_begin + header_len, find_duplicates);
  } catch (const Json::exception& e) {
    return HeaderError(label, absl::StrCat("header is not valid JSON: ", e.what()));
  }
  if (!header.is_object()) return HeaderError(label, "header is not a JSON object");
  if (!duplicate_name.empty()) {
    return HeaderError(label, absl::StrCat("header lists tensor '", duplicate_name, "' twice"));
  }

  auto file = std::unique_ptr<SafetensorsFile>(new SafetensorsFile());
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return HeaderError(label, "__metadata__ is not an object");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) {
          return HeaderError(label, absl::StrCat("__metadata__ value for '", key,
                                                 "' is not a string"));
        }
        file->metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    TensorView view;
    if (absl::Status status = ParseEntry(label, name, entry, data_section, data_size, view);
        !status.ok()) {
      return status;
    }
    file->tensors_.emplace(name, std::move(view));
  }

  // Sorted by start (then end), any tensor starting before its predecessor ends overlaps it.
  std::vector<const TensorView*> by_offset;
  for (const auto& [name, view] : file->tensors_) by_offset.push_back(&view);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorView* a, const TensorView* b) {
    return std::tuple(a->data, a->data + a->nbytes) < std::tuple(b->data, b->data + b->nbytes);
  });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const TensorView& previous = *by_offset[i - 1];
    const TensorView& current = *by_offset[i];
    if (current.data < previous.data + previous.nbytes) {
      return TensorError(label, current.name,
                         absl::StrCat("data overlaps tensor '", previous.name, "'"));
    }
  }
  return file;
}

absl::Status WeightStore::AddFile(std::unique_ptr<SafetensorsFile> file) {
  for (const auto& [name, view] : file->tensors()) {
    auto [it, inserted] = index_.emplace(name, &view);
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' appears in both ",
                                                     it->second->file, " and ", view.file));
    }
  }
  files_.push_back(std::move(file));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<WeightStore>> WeightStore::Open(const std::string& model_dir) {
  auto store = std::unique_ptr<WeightStore>(new WeightStore());
  store->model_dir_ = model_dir;
  const std::string index_path = model_dir + "/model.safetensors.index.json";
  const std::string single_path = model_dir + "/model.safetensors";
  std::error_code error;

  if (!std::filesystem::exists(index_path, error)) {
    if (!std::filesystem::exists(single_path, error)) {
      return absl::NotFoundError(absl::StrCat("no model.safetensors or ",
                                              "model.safetensors.index.json in ", model_dir));
    }
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(single_path);
    if (!file.ok()) return file.status();
    if (absl::Status status = store->AddFile(*std::move(file)); !status.ok()) return status;
    return store;
  }

  absl::StatusOr<std::string> index_text = ReadFileToString(index_path);
  if (!index_text.ok()) return index_text.status();
  // Shard file → the tensors the index places in it.
  std::map<std::string, std::vector<std::string>> shard_tensors;
  try {
    Json index = Json::parse(*index_text);
    auto weight_map = index.is_object() ? index.find("weight_map") : index.end();
    if (weight_map == index.end() || !weight_map->is_object()) {
      return HeaderError(index_path, "has no 'weight_map' object");
    }
    for (const auto& [tensor, shard] : weight_map->items()) {
      if (!shard.is_string()) {
        return HeaderError(index_path,
                           absl::StrCat("weight_map entry for '", tensor, "' is not a string"));
      }
      const std::string& shard_name = shard.get_ref<const std::string&>();
      if (EscapesDirectory(shard_name)) {
        return HeaderError(index_path, absl::StrCat("shard path '", shard_name, "' for '", tensor,
                                                    "' leaves the model directory"));
      }
      shard_tensors[shard_name].push_back(tensor);
    }
  } catch (const Json::exception& e) {
    return HeaderError(index_path, absl::StrCat("is not valid JSON: ", e.what()));
  }
  if (shard_tensors.empty()) return HeaderError(index_path, "weight_map lists no tensors");

  for (const auto& [shard_name, tensors] : shard_tensors) {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> shard =
        SafetensorsFile::Open(model_dir + "/" + shard_name);
    if (!shard.ok()) {
      return absl::Status(shard.status().code(),
                          absl::StrCat(shard.status().message(), " (listed in ", index_path, ")"));
    }
    for (const std::string& tensor : tensors) {
      if ((*shard)->tensors().count(tensor) == 0) {
        return absl::NotFoundError(absl::StrCat(index_path, " places tensor '", tensor, "' in ",
                                                shard_name, ", which does not contain it"));
      }
    }
    if (absl::Status status = store->AddFile(*std::move(shard)); !status.ok()) return status;
  }
  return store;
}

bool WeightStore::Has(const std::string& name) const { return index_.count(name) > 0; }

absl::StatusOr<const TensorView*> WeightStore::Get(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    return absl::NotFoundError(
        absl::StrCat("tensor '", name, "' is not in the checkpoint at ", model_dir_));
  }
  return it->second;
}

absl::Status WeightStore::ReadFloat32(const std::string& name, absl::Span<const int64_t> shape,
                                      absl::Span<float> out) const {
  absl::StatusOr<const TensorView*> found = Get(name);
  if (!found.ok()) return found.status();
  const TensorView& view = **found;
  if (!std::equal(view.shape.begin(), view.shape.end(), shape.begin(), shape.end())) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' in ", view.file,
                                                   ": expected shape ", ShapeString(shape),
                                                   ", got ", ShapeString(view.shape)));
  }
  const size_t count = static_cast<size_t>(view.numel());
  if (out.size() != count) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has ", count,
                                                   " elements but the output holds ",
                                                   out.size()));
  }
  switch (view.dtype) {
    case DType::kF32:
      if (count > 0) std::memcpy(out.data(), view.data, count * sizeof(float));
      return absl::OkStatus();
    case DType::kBF16:
      ConvertBFloat16(view.data, out.data(), count);
      return absl::OkStatus();
    case DType::kF16:
      ConvertFloat16(view.data, out.data(), count);
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' in ", view.file,
                                                     " has dtype ", DTypeName(view.dtype),
                                                     "; only F32, F16 and BF16 convert to float32"));
  }
}

std::vector<std::string> WeightStore::Names() const {
  std::vector<std::string> names;
  names.reserve(index_.size());
  for (const auto& [name, view] : index_) names.push_back(name);
  return names;
}

}  // namespace duet

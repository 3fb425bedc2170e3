// safetensors checkpoints: one file or sharded (`model.safetensors.index.json`), memory-mapped,
// with the header validated before any tensor is touched.
//
// File layout: [u64 little-endian header_len][header_len bytes of JSON][data bytes]. Each header
// entry {"dtype", "shape", "data_offsets": [begin, end]} is relative to the data section; the
// optional "__metadata__" entry is a string→string map.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/mapped_file.h"

namespace duet {

enum class DType { kF32, kF16, kBF16, kF64, kI64, kI32, kI16, kI8, kU8, kBool, kF8E4M3, kF8E5M2 };

size_t DTypeSize(DType dtype);
const char* DTypeName(DType dtype);

struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // points into the mapping
  size_t nbytes = 0;
  std::string file;  // the file it lives in, for error messages

  int64_t numel() const;
};

class SafetensorsFile {
 public:
  // Maps and validates: header length within the file, JSON well-formed, every dtype known,
  // shape × dtype size == byte length, offsets within the data section, no two tensors
  // overlapping. Errors name the file and, where there is one, the tensor.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  // The same validation over a safetensors image already in memory (used by Open and by the
  // fuzzer). `label` stands for the file in errors and in TensorView::file. The views point into
  // `bytes`, which must outlive the result.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Parse(absl::Span<const uint8_t> bytes,
                                                                const std::string& label);

  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::unique_ptr<MappedFile> file_;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a checkpoint directory: `model.safetensors`, or the shards listed in
// `model.safetensors.index.json` (every listed shard must exist and hold the tensors the index
// says it does).
class WeightStore {
 public:
  static absl::StatusOr<std::unique_ptr<WeightStore>> Open(const std::string& model_dir);

  bool Has(const std::string& name) const;
  absl::StatusOr<const TensorView*> Get(const std::string& name) const;
  // Converts a f32/f16/bf16 tensor to float32 into `out`, checking its shape equals `shape`.
  absl::Status ReadFloat32(const std::string& name, absl::Span<const int64_t> shape,
                           absl::Span<float> out) const;
  std::vector<std::string> Names() const;

 private:
  absl::Status AddFile(std::unique_ptr<SafetensorsFile> file);

  std::string model_dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> index_;
};

// Element conversions used by the loader (exact: bf16/f16 → f32 loses nothing).
float BFloat16ToFloat(uint16_t bits);
float Float16ToFloat(uint16_t bits);
uint16_t FloatToBFloat16(float value);  // round to nearest even

}  // namespace duet

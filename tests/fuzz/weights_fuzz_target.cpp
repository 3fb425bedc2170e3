// libFuzzer entry point for the weight-file parsers. The first input byte picks the parser (even:
// safetensors image, odd: config.json text); the rest is that parser's input. Whatever the
// bytes, a parser must return a status, never crash; what it accepts must satisfy the invariants
// checked below.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "common/check.h"
#include "model/model_config.h"
#include "model/safetensors.h"

namespace duet {
namespace {

void CheckSafetensors(absl::Span<const uint8_t> bytes) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Parse(bytes, "fuzz");
  if (!file.ok()) {
    DUET_CHECK(!file.status().message().empty());
    return;
  }
  std::vector<const TensorView*> views;
  float checksum = 0;
  for (const auto& [name, view] : (*file)->tensors()) {
    DUET_CHECK(view.name == name);
    DUET_CHECK(view.data >= bytes.data() && view.nbytes <= bytes.size());
    DUET_CHECK(view.data + view.nbytes <= bytes.data() + bytes.size());
    DUET_CHECK(static_cast<uint64_t>(view.numel()) * DTypeSize(view.dtype) == view.nbytes);
    // Touch every byte the view claims, so a sanitizer sees any out-of-bounds view.
    for (size_t i = 0; i + 1 < view.nbytes; i += 2) {
      uint16_t bits = static_cast<uint16_t>(view.data[i] | (view.data[i + 1] << 8));
      checksum += view.dtype == DType::kF16 ? Float16ToFloat(bits) : BFloat16ToFloat(bits);
    }
    if (view.nbytes % 2 == 1) checksum += view.data[view.nbytes - 1];
    views.push_back(&view);
  }
  std::sort(views.begin(), views.end(),
            [](const TensorView* a, const TensorView* b) { return a->data < b->data; });
  for (size_t i = 1; i < views.size(); ++i) {
    DUET_CHECK(views[i - 1]->nbytes == 0 || views[i]->nbytes == 0 ||
               views[i - 1]->data + views[i - 1]->nbytes <= views[i]->data);
  }
  volatile float sink = checksum;
  (void)sink;
}

void CheckModelConfig(const std::string& text) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(text);
  if (!config.ok()) {
    DUET_CHECK(!config.status().message().empty());
    return;
  }
  DUET_CHECK(config->hidden_size > 0 && config->intermediate_size > 0 && config->num_layers > 0);
  DUET_CHECK(config->vocab_size > 0 && config->max_position_embeddings > 0);
  DUET_CHECK(config->num_kv_heads > 0 && config->num_heads % config->num_kv_heads == 0);
  DUET_CHECK(config->head_dim > 0 && config->head_dim % 2 == 0);
  DUET_CHECK(config->rms_norm_eps > 0);
  if (config->head_dim > 65536) return;  // valid, but not worth a huge allocation here
  for (float inv_freq : config->rope.InverseFrequencies(static_cast<int>(config->head_dim))) {
    DUET_CHECK(std::isfinite(inv_freq) && inv_freq >= 0);
  }
}

}  // namespace
}  // namespace duet

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  if (data[0] % 2 == 0) {
    duet::CheckSafetensors(absl::MakeConstSpan(data + 1, size - 1));
  } else {
    duet::CheckModelConfig(std::string(reinterpret_cast<const char*>(data + 1), size - 1));
  }
  return 0;
}

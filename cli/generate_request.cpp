#include "cli/generate_request.h"

#include <cmath>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"

namespace duet {
namespace {

using nlohmann::json;

absl::Status TypeError(const std::string& field, const char* want) {
  return absl::InvalidArgumentError(absl::StrCat("field '", field, "' must be ", want));
}

absl::Status ReadFloat(const json& row, const std::string& field, float* out) {
  auto it = row.find(field);
  if (it == row.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number()) return TypeError(field, "a number");
  const double v = it->get<double>();
  if (!std::isfinite(v) || std::fabs(v) > 1e6) return TypeError(field, "a finite number");
  *out = static_cast<float>(v);
  return absl::OkStatus();
}

absl::Status ReadInt(const json& row, const std::string& field, int64_t lo, int64_t hi, int64_t* out) {
  auto it = row.find(field);
  if (it == row.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number_integer()) return TypeError(field, "an integer");
  if (it->is_number_unsigned() && it->get<uint64_t>() > uint64_t(hi)) {
    return absl::InvalidArgumentError(absl::StrCat("field '", field, "' is out of range"));
  }
  const int64_t v = it->get<int64_t>();
  if (v < lo || v > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat("field '", field, "' must be in [", lo, ", ", hi, "], got ", v));
  }
  *out = v;
  return absl::OkStatus();
}

absl::Status ReadTokenIds(const json& row, const std::string& field, std::vector<int32_t>* out) {
  auto it = row.find(field);
  if (it == row.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_array()) return TypeError(field, "a list of token ids");
  for (const json& v : *it) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 ||
        v.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return TypeError(field, "a list of non-negative integer token ids");
    }
    out->push_back(static_cast<int32_t>(v.get<int64_t>()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<GenerateRequest> ParseGenerateRequest(const json& row) {
  static const std::set<std::string> kFields = {
      "id", "prompt", "prompt_token_ids", "max_tokens", "temperature", "top_p", "top_k", "min_p",
      "seed", "stop", "stop_token_ids", "ignore_eos", "repetition_penalty", "presence_penalty",
      "frequency_penalty", "logprobs", "prompt_logprobs"};
  for (const auto& [key, value] : row.items()) {
    if (!kFields.count(key)) return absl::InvalidArgumentError(absl::StrCat("unknown field '", key, "'"));
  }
  GenerateRequest req;
  auto id = row.find("id");
  if (id == row.end()) return absl::InvalidArgumentError("missing field 'id'");
  if (id->is_string()) {
    req.id = id->get<std::string>();
  } else if (id->is_number_integer()) {
    req.id = id->dump();
  } else {
    return TypeError("id", "a string or an integer");
  }

  auto prompt = row.find("prompt");
  const bool has_prompt = prompt != row.end() && !prompt->is_null();
  const bool has_ids = row.contains("prompt_token_ids") && !row["prompt_token_ids"].is_null();
  if (has_prompt == has_ids) {
    return absl::InvalidArgumentError("give exactly one of 'prompt' and 'prompt_token_ids'");
  }
  if (has_prompt) {
    if (!prompt->is_string()) return TypeError("prompt", "a string");
    req.prompt = prompt->get<std::string>();
  }
  if (absl::Status s = ReadTokenIds(row, "prompt_token_ids", &req.prompt_token_ids); !s.ok()) return s;
  if (has_ids && req.prompt_token_ids.empty()) return absl::InvalidArgumentError("'prompt_token_ids' is empty");

  SamplingParams& p = req.params;
  int64_t max_tokens = p.max_tokens, top_k = p.top_k, logprobs = p.logprobs, prompt_logprobs = p.prompt_logprobs;
  absl::Status s;
  if (s.ok()) s = ReadInt(row, "max_tokens", 1, std::numeric_limits<int32_t>::max(), &max_tokens);
  if (s.ok()) s = ReadInt(row, "top_k", -1, std::numeric_limits<int32_t>::max(), &top_k);
  if (s.ok()) s = ReadInt(row, "logprobs", 0, SamplingParams::kMaxLogprobs, &logprobs);
  if (s.ok()) s = ReadInt(row, "prompt_logprobs", 0, SamplingParams::kMaxLogprobs, &prompt_logprobs);
  if (s.ok()) s = ReadFloat(row, "temperature", &p.temperature);
  if (s.ok()) s = ReadFloat(row, "top_p", &p.top_p);
  if (s.ok()) s = ReadFloat(row, "min_p", &p.min_p);
  if (s.ok()) s = ReadFloat(row, "repetition_penalty", &p.repetition_penalty);
  if (s.ok()) s = ReadFloat(row, "presence_penalty", &p.presence_penalty);
  if (s.ok()) s = ReadFloat(row, "frequency_penalty", &p.frequency_penalty);
  if (s.ok()) s = ReadTokenIds(row, "stop_token_ids", &p.stop_token_ids);
  if (!s.ok()) return s;
  p.max_tokens = static_cast<int32_t>(max_tokens);
  p.top_k = static_cast<int32_t>(top_k);
  p.logprobs = static_cast<int32_t>(logprobs);
  p.prompt_logprobs = static_cast<int32_t>(prompt_logprobs);

  if (auto seed = row.find("seed"); seed != row.end() && !seed->is_null()) {
    if (!seed->is_number_integer()) return TypeError("seed", "an integer");
    p.seed = seed->is_number_unsigned() ? seed->get<uint64_t>() : uint64_t(seed->get<int64_t>());
  }
  if (auto stop = row.find("stop"); stop != row.end() && !stop->is_null()) {
    if (stop->is_string()) {
      p.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (const json& v : *stop) {
        if (!v.is_string()) return TypeError("stop", "a string or a list of strings");
        p.stop.push_back(v.get<std::string>());
      }
    } else {
      return TypeError("stop", "a string or a list of strings");
    }
  }
  if (auto ignore = row.find("ignore_eos"); ignore != row.end() && !ignore->is_null()) {
    if (!ignore->is_boolean()) return TypeError("ignore_eos", "a boolean");
    p.ignore_eos = ignore->get<bool>();
  }
  if (absl::Status v = p.Validate(); !v.ok()) return v;
  return req;
}

}  // namespace duet

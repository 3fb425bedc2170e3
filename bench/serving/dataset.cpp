#include "bench/serving/dataset.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "nlohmann/json.hpp"

namespace duet::bench {
namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

// ShareGPT filters, as vLLM's: drop very short turns and very long conversations.
constexpr int kShareGptMinTokens = 4;
constexpr int kShareGptMaxPromptTokens = 1024;
constexpr int kShareGptMaxTotalTokens = 2048;
constexpr uintmax_t kMaxCodeFileBytes = 1 << 20;
constexpr size_t kMaxCodeFiles = 10000;
constexpr int kMinCodeFileTokens = 16;

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* what) {
  if (path.empty()) return absl::InvalidArgumentError(absl::StrCat("the ", what, " dataset needs --dataset-path"));
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", what, " dataset file '", path, "'"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

int Encoded(const Tokenizer* tokenizer, const std::string& text) {
  return tokenizer == nullptr ? 0 : int(tokenizer->Encode(text).size());
}

// A length uniform in [len·(1−ratio), len·(1+ratio)], at least 1.
int SampleLength(int len, double ratio, std::mt19937_64& rng) {
  const int low = std::max(1, int(std::floor(len * (1 - ratio))));
  const int high = std::max(low, int(std::ceil(len * (1 + ratio))));
  return std::uniform_int_distribution<int>(low, high)(rng);
}

// Token ids a random prompt may use: those that are not special and whose text encodes back to
// the same single id (so no partial UTF-8 sequences, which decode to U+FFFD and re-encode longer).
std::vector<int32_t> OrdinaryTokenIds(const Tokenizer& tokenizer) {
  std::vector<int32_t> ids;
  for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    if (tokenizer.IsSpecial(id)) continue;
    const int32_t one[] = {id};
    const std::vector<int32_t> again = tokenizer.Encode(tokenizer.Decode(one));
    if (again.size() == 1 && again[0] == id) ids.push_back(id);
  }
  return ids;
}

// Text of random tokens that encodes to exactly `length` tokens. Decoding and re-encoding
// random ids can merge or split tokens, so this trims or tops up until it is a fixed point;
// if that does not settle, the closest text is returned and *actual says its length.
std::string RandomText(const Tokenizer& tokenizer, const std::vector<int32_t>& vocabulary, int length,
                       std::mt19937_64& rng, int* actual) {
  std::uniform_int_distribution<size_t> pick(0, vocabulary.size() - 1);
  std::vector<int32_t> ids;
  auto top_up = [&] {
    while (int(ids.size()) < length) ids.push_back(vocabulary[pick(rng)]);
  };
  top_up();
  std::string text;
  for (int attempt = 0; attempt < 16; ++attempt) {
    text = tokenizer.Decode(ids);
    std::vector<int32_t> again = tokenizer.Encode(text);
    *actual = int(again.size());
    if (*actual == length) return text;
    ids = std::move(again);
    if (int(ids.size()) > length) ids.resize(size_t(length));
    top_up();
  }
  return text;
}

absl::StatusOr<std::vector<BenchRequest>> Random(const DatasetOptions& o, std::mt19937_64& rng) {
  const std::vector<int32_t> vocabulary = OrdinaryTokenIds(*o.tokenizer);
  if (vocabulary.empty()) return absl::InvalidArgumentError("the tokenizer has no ordinary tokens");
  std::vector<BenchRequest> out;
  for (int i = 0; i < o.num_prompts; ++i) {
    BenchRequest r;
    const int input = SampleLength(o.input_len, o.range_ratio, rng);
    r.output_tokens = SampleLength(o.output_len, o.range_ratio, rng);
    r.prompt = RandomText(*o.tokenizer, vocabulary, input, rng, &r.prompt_tokens);
    out.push_back(std::move(r));
  }
  return out;
}

absl::StatusOr<std::vector<BenchRequest>> SharedPrefix(const DatasetOptions& o, std::mt19937_64& rng) {
  if (o.num_prefix_groups < 1 || o.prefix_len < 1) {
    return absl::InvalidArgumentError("shared-prefix needs --num-prefix-groups >= 1 and --prefix-len >= 1");
  }
  const std::vector<int32_t> vocabulary = OrdinaryTokenIds(*o.tokenizer);
  if (vocabulary.empty()) return absl::InvalidArgumentError("the tokenizer has no ordinary tokens");
  std::vector<std::string> prefixes;
  for (int g = 0; g < o.num_prefix_groups; ++g) {
    int unused = 0;
    prefixes.push_back(RandomText(*o.tokenizer, vocabulary, o.prefix_len, rng, &unused));
  }
  std::vector<BenchRequest> out;
  for (int i = 0; i < o.num_prompts; ++i) {
    BenchRequest r;
    int question_tokens = 0;
    const std::string question =
        RandomText(*o.tokenizer, vocabulary, SampleLength(o.input_len, o.range_ratio, rng), rng, &question_tokens);
    r.prompt = absl::StrCat(prefixes[size_t(i % o.num_prefix_groups)], "\n\n", question);
    r.prompt_tokens = Encoded(o.tokenizer, r.prompt);
    r.output_tokens = SampleLength(o.output_len, o.range_ratio, rng);
    out.push_back(std::move(r));
  }
  std::shuffle(out.begin(), out.end(), rng);
  return out;
}

absl::StatusOr<std::vector<BenchRequest>> Jsonl(const DatasetOptions& o) {
  absl::StatusOr<std::string> text = ReadFile(o.path, "jsonl");
  if (!text.ok()) return text.status();
  std::vector<BenchRequest> entries;
  std::istringstream lines(*text);
  std::string line;
  for (int number = 1; std::getline(lines, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto where = [&] { return absl::StrCat(o.path, ":", number, ": "); };
    Json row = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (row.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(where(), "not valid JSON"));
    if (!row.is_object()) return absl::InvalidArgumentError(absl::StrCat(where(), "expected a JSON object"));
    auto prompt = row.find("prompt");
    if (prompt == row.end() || !prompt->is_string() || prompt->get_ref<const std::string&>().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where(), "\"prompt\" must be a non-empty string"));
    }
    BenchRequest r;
    r.prompt = prompt->get<std::string>();
    r.prompt_tokens = Encoded(o.tokenizer, r.prompt);
    r.output_tokens = o.output_len;
    for (const char* field : {"output_len", "max_tokens"}) {
      auto it = row.find(field);
      if (it == row.end() || o.fixed_output_len) continue;
      if (!it->is_number_integer() || it->get<int64_t>() < 1 || it->get<int64_t>() > (1 << 24)) {
        return absl::InvalidArgumentError(absl::StrCat(where(), "\"", field, "\" must be a positive integer"));
      }
      r.output_tokens = it->get<int>();
    }
    entries.push_back(std::move(r));
  }
  if (entries.empty()) return absl::InvalidArgumentError(absl::StrCat(o.path, ": no prompts in the file"));
  return entries;
}

absl::StatusOr<std::vector<BenchRequest>> ShareGpt(const DatasetOptions& o, std::mt19937_64& rng) {
  if (o.tokenizer == nullptr && !o.fixed_output_len) {
    return absl::InvalidArgumentError("sharegpt needs --tokenizer to count reply lengths, or a fixed --output-len");
  }
  absl::StatusOr<std::string> text = ReadFile(o.path, "sharegpt");
  if (!text.ok()) return text.status();
  Json data = Json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (data.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(o.path, ": not valid JSON"));
  if (!data.is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(o.path, ": a ShareGPT file is a JSON array of conversations"));
  }
  std::vector<BenchRequest> entries;
  for (size_t i = 0; i < data.size(); ++i) {
    auto where = [&] { return absl::StrCat(o.path, ": entry ", i, ": "); };
    const Json& entry = data[i];
    auto turns = entry.is_object() ? entry.find("conversations") : entry.end();
    if (!entry.is_object() || turns == entry.end() || !turns->is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(where(), "expected {\"conversations\": [...]}"));
    }
    if (turns->size() < 2) continue;  // no reply to measure
    for (size_t t = 0; t < 2; ++t) {
      auto value = (*turns)[t].is_object() ? (*turns)[t].find("value") : (*turns)[t].end();
      if (value == (*turns)[t].end() || !value->is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(where(), "turn ", t, " needs a string \"value\""));
      }
    }
    BenchRequest r;
    r.prompt = (*turns)[0]["value"].get<std::string>();
    r.prompt_tokens = Encoded(o.tokenizer, r.prompt);
    r.output_tokens = o.fixed_output_len ? o.output_len : Encoded(o.tokenizer, (*turns)[1]["value"].get<std::string>());
    if (o.tokenizer != nullptr &&
        (r.prompt_tokens < kShareGptMinTokens || r.output_tokens < kShareGptMinTokens ||
         r.prompt_tokens > kShareGptMaxPromptTokens || r.prompt_tokens + r.output_tokens > kShareGptMaxTotalTokens)) {
      continue;
    }
    entries.push_back(std::move(r));
  }
  if (entries.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(o.path, ": no usable conversations (each needs a prompt and a reply",
                                                   o.tokenizer ? " of 4..1024 tokens, 2048 in all)" : ")"));
  }
  std::shuffle(entries.begin(), entries.end(), rng);
  return entries;
}

bool IsSourceFile(const fs::path& path) {
  static const std::vector<std::string> kExtensions = {".py", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".cuh", ".rs",
                                                       ".go", ".java", ".js", ".mjs", ".ts", ".rb", ".sh", ".proto"};
  return std::find(kExtensions.begin(), kExtensions.end(), path.extension().string()) != kExtensions.end();
}

absl::StatusOr<std::vector<BenchRequest>> Code(const DatasetOptions& o, std::mt19937_64& rng) {
  if (o.code_dir.empty()) return absl::InvalidArgumentError("the code dataset needs --code-dir");
  std::error_code ec;
  if (!fs::is_directory(o.code_dir, ec)) {
    return absl::NotFoundError(absl::StrCat("--code-dir '", o.code_dir, "' is not a directory"));
  }
  std::vector<fs::path> files;
  fs::recursive_directory_iterator it(o.code_dir, fs::directory_options::skip_permission_denied, ec), end;
  for (; it != end; it.increment(ec)) {
    if (ec) return absl::InvalidArgumentError(absl::StrCat("reading --code-dir '", o.code_dir, "': ", ec.message()));
    const std::string name = it->path().filename().string();
    if (it->is_directory(ec) && name.starts_with(".")) {
      it.disable_recursion_pending();  // .git and friends
      continue;
    }
    if (it->is_regular_file(ec) && IsSourceFile(it->path()) && it->file_size(ec) <= kMaxCodeFileBytes) {
      files.push_back(it->path());
    }
  }
  // Directory order is not stable; the seed's choice must be.
  std::sort(files.begin(), files.end());
  if (files.size() > kMaxCodeFiles) files.resize(kMaxCodeFiles);
  // Token ids of each file long enough to cut from, read on first use.
  std::vector<std::vector<int32_t>> tokens(files.size());
  std::vector<bool> loaded(files.size(), false);
  std::vector<size_t> usable(files.size());
  for (size_t i = 0; i < files.size(); ++i) usable[i] = i;
  std::vector<BenchRequest> out;
  while (int(out.size()) < o.num_prompts) {
    if (usable.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--code-dir '", o.code_dir, "' has no source files of at least ",
                                                     kMinCodeFileTokens, " tokens"));
    }
    const size_t slot = std::uniform_int_distribution<size_t>(0, usable.size() - 1)(rng);
    const size_t f = usable[slot];
    if (!loaded[f]) {
      loaded[f] = true;
      absl::StatusOr<std::string> text = ReadFile(files[f].string(), "code");
      if (text.ok()) tokens[f] = o.tokenizer->Encode(*text);
    }
    const std::vector<int32_t>& ids = tokens[f];
    if (int(ids.size()) < kMinCodeFileTokens) {
      usable.erase(usable.begin() + std::ptrdiff_t(slot));
      continue;
    }
    // The cursor: somewhere after enough context for the prompt when the file is long enough.
    const int length = std::min(SampleLength(o.input_len, o.range_ratio, rng), int(ids.size()));
    const int cursor = std::uniform_int_distribution<int>(length, int(ids.size()))(rng);
    BenchRequest r;
    r.prompt = o.tokenizer->Decode(absl::MakeConstSpan(ids).subspan(size_t(cursor - length), size_t(length)));
    r.prompt_tokens = Encoded(o.tokenizer, r.prompt);
    r.output_tokens = SampleLength(o.output_len, o.range_ratio, rng);
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<ChatSession>> LoadChatSessions(const DatasetOptions& o) {
  if (o.kind != DatasetKind::kMultiTurn) return absl::InvalidArgumentError("LoadChatSessions is for multi-turn");
  if (o.num_sessions < 1 || o.num_turns < 1) {
    return absl::InvalidArgumentError("multi-turn needs --num-sessions >= 1 and --num-turns >= 1");
  }
  if (o.num_prefix_groups < 1 || o.prefix_len < 1 || o.input_len < 1 || o.output_len < 1) {
    return absl::InvalidArgumentError(
        "multi-turn needs --num-prefix-groups, --prefix-len, --input-len and --output-len >= 1");
  }
  if (!(o.range_ratio >= 0 && o.range_ratio < 1)) return absl::InvalidArgumentError("--range-ratio must be in [0, 1)");
  if (o.tokenizer == nullptr) {
    return absl::InvalidArgumentError("this dataset needs --tokenizer (a model directory with tokenizer.json)");
  }
  const std::vector<int32_t> vocabulary = OrdinaryTokenIds(*o.tokenizer);
  if (vocabulary.empty()) return absl::InvalidArgumentError("the tokenizer has no ordinary tokens");
  std::mt19937_64 rng(o.seed);
  int unused = 0;
  std::vector<std::string> system_prompts;
  for (int g = 0; g < o.num_prefix_groups; ++g) {
    system_prompts.push_back(RandomText(*o.tokenizer, vocabulary, o.prefix_len, rng, &unused));
  }
  std::vector<ChatSession> sessions(static_cast<size_t>(o.num_sessions));
  for (int s = 0; s < o.num_sessions; ++s) {
    ChatSession& session = sessions[size_t(s)];
    session.system_prompt = system_prompts[size_t(s % o.num_prefix_groups)];
    for (int t = 0; t < o.num_turns; ++t) {
      session.user_messages.push_back(
          RandomText(*o.tokenizer, vocabulary, SampleLength(o.input_len, o.range_ratio, rng), rng, &unused));
      session.output_tokens.push_back(SampleLength(o.output_len, o.range_ratio, rng));
    }
  }
  return sessions;
}

std::string ChatPrompt(const ChatSession& session, const std::vector<std::string>& answers) {
  DUET_CHECK(answers.size() < session.user_messages.size());
  std::string prompt = session.system_prompt;
  for (size_t t = 0; t <= answers.size(); ++t) {
    absl::StrAppend(&prompt, "\n\nUser: ", session.user_messages[t], "\n\nAssistant:");
    if (t < answers.size()) prompt += answers[t];
  }
  return prompt;
}

std::vector<ChatMessage> ChatMessages(const ChatSession& session, const std::vector<std::string>& answers) {
  DUET_CHECK(answers.size() < session.user_messages.size());
  std::vector<ChatMessage> messages = {{"system", session.system_prompt}};
  for (size_t t = 0; t <= answers.size(); ++t) {
    messages.push_back({"user", session.user_messages[t]});
    if (t < answers.size()) messages.push_back({"assistant", answers[t]});
  }
  return messages;
}

absl::StatusOr<DatasetKind> ParseDatasetKind(const std::string& name) {
  if (name == "random") return DatasetKind::kRandom;
  if (name == "jsonl") return DatasetKind::kJsonl;
  if (name == "sharegpt") return DatasetKind::kShareGpt;
  if (name == "shared-prefix") return DatasetKind::kSharedPrefix;
  if (name == "code") return DatasetKind::kCode;
  if (name == "multi-turn") return DatasetKind::kMultiTurn;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dataset '", name, "' (random, jsonl, sharegpt, shared-prefix, code, multi-turn)"));
}

absl::StatusOr<std::vector<BenchRequest>> LoadDataset(const DatasetOptions& o) {
  if (o.num_prompts < 1) return absl::InvalidArgumentError("--num-prompts must be at least 1");
  if (o.input_len < 1 || o.output_len < 1) return absl::InvalidArgumentError("--input-len and --output-len must be >= 1");
  if (!(o.range_ratio >= 0 && o.range_ratio < 1)) return absl::InvalidArgumentError("--range-ratio must be in [0, 1)");
  const bool needs_tokenizer =
      o.kind == DatasetKind::kRandom || o.kind == DatasetKind::kSharedPrefix || o.kind == DatasetKind::kCode;
  if (needs_tokenizer && o.tokenizer == nullptr) {
    return absl::InvalidArgumentError("this dataset needs --tokenizer (a model directory with tokenizer.json)");
  }
  std::mt19937_64 rng(o.seed);
  absl::StatusOr<std::vector<BenchRequest>> entries;
  switch (o.kind) {
    case DatasetKind::kMultiTurn:
      return absl::InvalidArgumentError("multi-turn prompts depend on the answers: use LoadChatSessions");
    case DatasetKind::kRandom: return Random(o, rng);
    case DatasetKind::kSharedPrefix: return SharedPrefix(o, rng);
    case DatasetKind::kCode: return Code(o, rng);
    case DatasetKind::kJsonl: entries = Jsonl(o); break;
    case DatasetKind::kShareGpt: entries = ShareGpt(o, rng); break;
  }
  if (!entries.ok()) return entries.status();
  std::vector<BenchRequest> out;
  for (int i = 0; i < o.num_prompts; ++i) out.push_back((*entries)[size_t(i) % entries->size()]);
  return out;
}

std::string GenerateInputJsonl(const std::vector<BenchRequest>& requests, const Tokenizer& tokenizer,
                               bool ignore_eos) {
  std::string out;
  for (size_t i = 0; i < requests.size(); ++i) {
    const Json row = {{"id", absl::StrCat(i)},
                      {"prompt_token_ids", tokenizer.Encode(requests[i].prompt, /*add_special_tokens=*/true)},
                      {"max_tokens", requests[i].output_tokens},
                      {"temperature", 0},
                      {"ignore_eos", ignore_eos}};
    absl::StrAppend(&out, row.dump(), "\n");
  }
  return out;
}

}  // namespace duet::bench

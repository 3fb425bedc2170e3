#include "frontend/tokenizer/tokenizer_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cctype>

#include "absl/strings/str_cat.h"
#include "frontend/tokenizer/tokenizer_unicode.h"

namespace duet {
namespace {

// One JIT stack per thread: a JIT stack must not be used by two matches at once. The default
// 32 KiB stack is too small for patterns like \s+(?!\S) on long whitespace runs.
pcre2_jit_stack* ThreadJitStack() {
  struct Holder {
    pcre2_jit_stack* stack = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
    ~Holder() { pcre2_jit_stack_free(stack); }
  };
  thread_local Holder holder;
  return holder.stack;
}

}  // namespace

struct TokenizerRegex::Code {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Code() { pcre2_code_free(code); }
};

absl::StatusOr<TokenizerRegex> TokenizerRegex::Compile(std::string_view pattern) {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    return absl::InvalidArgumentError(absl::StrCat("invalid regex '", std::string(pattern), "' at offset ",
                                                   error_offset, ": ",
                                                   reinterpret_cast<const char*>(message)));
  }
  auto holder = std::make_shared<Code>();
  holder->code = code;
  holder->jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  return TokenizerRegex(std::move(holder));
}

absl::StatusOr<TokenizerRegex> TokenizerRegex::Literal(std::string_view literal) {
  std::string escaped;
  for (char c : literal) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x80 && !std::isalnum(byte)) escaped.push_back('\\');
    escaped.push_back(c);
  }
  return Compile(escaped);
}

std::vector<std::pair<size_t, size_t>> TokenizerRegex::FindAll(std::string_view text) const {
  std::vector<std::pair<size_t, size_t>> matches;
  pcre2_match_data* match_data = pcre2_match_data_create_from_pattern(code_->code, nullptr);
  pcre2_match_context* context = nullptr;
  if (code_->jit) {
    context = pcre2_match_context_create(nullptr);
    pcre2_jit_stack_assign(context, nullptr, ThreadJitStack());
  }
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t offset = 0;
  while (offset <= text.size()) {
    const int rc = pcre2_match(code_->code, subject, text.size(), offset, PCRE2_NO_UTF_CHECK,
                               match_data, context);
    if (rc < 0) break;  // PCRE2_ERROR_NOMATCH, or a resource limit: no further matches
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match_data);
    const size_t begin = ovector[0], end = ovector[1];
    matches.emplace_back(begin, end);
    if (end > begin) {
      offset = end;
    } else {
      if (end >= text.size()) break;
      offset = end + unicode::Utf8SequenceLength(static_cast<unsigned char>(text[end]));
    }
  }
  pcre2_match_context_free(context);
  pcre2_match_data_free(match_data);
  return matches;
}

std::string TokenizerRegex::ReplaceAll(std::string_view text, std::string_view replacement) const {
  std::string out;
  size_t last = 0;
  for (const auto& [begin, end] : FindAll(text)) {
    out.append(text.substr(last, begin - last));
    out.append(replacement);
    last = end;
  }
  out.append(text.substr(last));
  return out;
}

}  // namespace duet

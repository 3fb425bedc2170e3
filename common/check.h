// Invariant checks. A failed DUET_CHECK is a bug in Duet, never a bad input: bad input gets an
// absl::Status. The check writes a FATAL log line naming the file, line and condition (and the
// message, for DUET_CHECK_MSG), then the process aborts. The failure path is one out-of-line
// noreturn call, so a check costs a hot loop only its comparison.
#pragma once

#include <string_view>

namespace duet::internal {

[[noreturn]] void CheckFailed(const char* file, int line, const char* condition);
[[noreturn]] void CheckFailed(const char* file, int line, const char* condition, std::string_view message);

}  // namespace duet::internal

#define DUET_CHECK(cond)                                                \
  do {                                                                  \
    if (__builtin_expect(!(cond), 0)) {                                 \
      ::duet::internal::CheckFailed(__FILE__, __LINE__, #cond);         \
    }                                                                   \
  } while (0)

#define DUET_CHECK_MSG(cond, msg)                                       \
  do {                                                                  \
    if (__builtin_expect(!(cond), 0)) {                                 \
      ::duet::internal::CheckFailed(__FILE__, __LINE__, #cond, (msg));  \
    }                                                                   \
  } while (0)

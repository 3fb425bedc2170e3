// Invariant checks. A failed DUET_CHECK is a bug in Duet, never a bad input: bad input gets an
// absl::Status. The check writes a FATAL log line naming the file, line and condition (and the
// message, for DUET_CHECK_MSG), then the process aborts.
#pragma once

#include "common/logging.h"

#define DUET_CHECK(cond)                                                                      \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      ::duet::LogMessage(::duet::LogLevel::kFatal, __FILE__, __LINE__).stream()               \
          << "DUET_CHECK failed: " #cond;                                                     \
    }                                                                                         \
  } while (0)

#define DUET_CHECK_MSG(cond, msg)                                                             \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      ::duet::LogMessage(::duet::LogLevel::kFatal, __FILE__, __LINE__).stream()               \
          << "DUET_CHECK failed: " #cond " (" << (msg) << ")";                                \
    }                                                                                         \
  } while (0)

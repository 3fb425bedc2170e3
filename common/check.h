// Invariant checks. A failed DUET_CHECK is a bug in Duet, never a bad input: bad input gets an
// absl::Status. The message names the file, line and condition, then the process aborts.
#pragma once

#include <cstdio>
#include <cstdlib>

#define DUET_CHECK(cond)                                                                      \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      std::fprintf(stderr, "%s:%d: DUET_CHECK failed: %s\n", __FILE__, __LINE__, #cond);     \
      std::abort();                                                                           \
    }                                                                                         \
  } while (0)

#define DUET_CHECK_MSG(cond, msg)                                                             \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      std::fprintf(stderr, "%s:%d: DUET_CHECK failed: %s (%s)\n", __FILE__, __LINE__, #cond, \
                   (msg));                                                                    \
      std::abort();                                                                           \
    }                                                                                         \
  } while (0)

// Early returns for absl::Status / absl::StatusOr, the one pair every module uses (Abseil
// 20220623, Debian 12's, ships none).
//
//   DUET_RETURN_IF_ERROR(DoThing());            // returns the Status if it is not OK
//   DUET_ASSIGN_OR_RETURN(Thing t, MakeThing()); // returns the StatusOr's status if not OK
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define DUET_STATUS_CONCAT_INNER(a, b) a##b
#define DUET_STATUS_CONCAT(a, b) DUET_STATUS_CONCAT_INNER(a, b)

#define DUET_RETURN_IF_ERROR(expr)                                 \
  do {                                                             \
    if (::absl::Status duet_status_ = (expr); !duet_status_.ok()) { \
      return duet_status_;                                         \
    }                                                              \
  } while (0)

#define DUET_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return std::move(tmp).status();   \
  lhs = std::move(*tmp)

#define DUET_ASSIGN_OR_RETURN(lhs, expr) \
  DUET_ASSIGN_OR_RETURN_IMPL(DUET_STATUS_CONCAT(duet_statusor_, __LINE__), lhs, expr)

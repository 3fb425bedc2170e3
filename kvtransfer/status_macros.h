// Early-return helpers for absl::Status / absl::StatusOr (abseil 20220623 ships none).
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KV_CONCAT_INNER(a, b) a##b
#define KV_CONCAT(a, b) KV_CONCAT_INNER(a, b)

#define KV_RETURN_IF_ERROR(expr)                  \
  do {                                            \
    ::absl::Status kv_status_ = (expr);           \
    if (!kv_status_.ok()) return kv_status_;      \
  } while (0)

#define KV_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(*tmp)

#define KV_ASSIGN_OR_RETURN(lhs, expr) \
  KV_ASSIGN_OR_RETURN_IMPL(KV_CONCAT(kv_statusor_, __LINE__), lhs, expr)

// Small status helpers missing from Debian 12's Abseil (20220623).
#ifndef LEAP_COMMON_STATUS_MACROS_H_
#define LEAP_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define LEAP_STATUS_CONCAT_INNER_(a, b) a##b
#define LEAP_STATUS_CONCAT_(a, b) LEAP_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status); returns it from the enclosing function
// when it is not OK.
#define RETURN_IF_ERROR(expr)                   \
  do {                                          \
    ::absl::Status leap_status_ = (expr);       \
    if (!leap_status_.ok()) return leap_status_; \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, F())`: evaluates F() (an absl::StatusOr<T>),
// returns its status when not OK, otherwise moves the value into `lhs`.
#define ASSIGN_OR_RETURN(lhs, expr)                                        \
  ASSIGN_OR_RETURN_IMPL_(LEAP_STATUS_CONCAT_(leap_statusor_, __LINE__), lhs, \
                         expr)
#define ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                           \
  if (!tmp.ok()) return std::move(tmp).status(); \
  lhs = std::move(tmp).value()

#endif  // LEAP_COMMON_STATUS_MACROS_H_

// The one logging facility of every Duet process: leveled lines on stderr, one format,
//
//   2026-12-01 08:40:00.123456 W 1234 decode_service.cpp:120] [cmpl-9f2c] lease expired
//   (date and time UTC, level D/I/W/E/F, thread id, source, the request id when given, message)
//
// The threshold comes from DUET_LOG_LEVEL (debug, info, warning, error; default info) or
// SetMinLogLevel. A line is formatted whole and written with one call, so lines of different
// threads never interleave. FATAL writes its line and aborts (DUET_CHECK uses it).
//
//   DUET_LOG(INFO) << "serving on port " << port;
//   DUET_LOG_REQUEST(WARNING, request_id) << "transfer failed: " << status;
#pragma once

#include <sstream>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace duet {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kFatal = 4 };

void SetMinLogLevel(LogLevel level);
LogLevel MinLogLevel();
inline bool LogEnabled(LogLevel level) { return level >= MinLogLevel(); }
// "debug", "info", "warning" (or "warn"), "error"; InvalidArgument otherwise.
absl::StatusOr<LogLevel> ParseLogLevel(std::string_view name);

// One line being built; written (and for kFatal, the process aborted) when it is destroyed.
class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line, std::string_view request_id = {});
  ~LogMessage();
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  std::ostream& stream() { return stream_; }

 private:
  const LogLevel level_;
  std::ostringstream stream_;
};

// Turns a streamed line into void, so DUET_LOG can be one expression (`&` binds after `<<`). An
// expression, unlike an if/else, leaves no dangling else after `if (x) DUET_LOG(INFO) << ...;`.
struct LogVoidify {
  void operator&(std::ostream&) {}
};

}  // namespace duet

#define DUET_LOG_LEVEL_DEBUG ::duet::LogLevel::kDebug
#define DUET_LOG_LEVEL_INFO ::duet::LogLevel::kInfo
#define DUET_LOG_LEVEL_WARNING ::duet::LogLevel::kWarning
#define DUET_LOG_LEVEL_ERROR ::duet::LogLevel::kError
#define DUET_LOG_LEVEL_FATAL ::duet::LogLevel::kFatal

// The stream is evaluated only when the level is enabled.
#define DUET_LOG(severity)                                       \
  !::duet::LogEnabled(DUET_LOG_LEVEL_##severity)                 \
      ? (void)0                                                  \
      : ::duet::LogVoidify() &                                   \
            ::duet::LogMessage(DUET_LOG_LEVEL_##severity, __FILE__, __LINE__).stream()

#define DUET_LOG_REQUEST(severity, request_id)                   \
  !::duet::LogEnabled(DUET_LOG_LEVEL_##severity)                 \
      ? (void)0                                                  \
      : ::duet::LogVoidify() &                                   \
            ::duet::LogMessage(DUET_LOG_LEVEL_##severity, __FILE__, __LINE__, (request_id)).stream()

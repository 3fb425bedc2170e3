#include "common/logging.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/check.h"

namespace duet {
namespace {

LogLevel LevelFromEnvironment() {
  const char* env = std::getenv("DUET_LOG_LEVEL");
  if (env == nullptr || *env == '\0') return LogLevel::kInfo;
  absl::StatusOr<LogLevel> level = ParseLogLevel(env);
  return level.ok() ? *level : LogLevel::kInfo;
}

std::atomic<LogLevel>& MinLevel() {
  static std::atomic<LogLevel> level{LevelFromEnvironment()};
  return level;
}

char LevelLetter(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return 'D';
    case LogLevel::kInfo: return 'I';
    case LogLevel::kWarning: return 'W';
    case LogLevel::kError: return 'E';
    case LogLevel::kFatal: return 'F';
  }
  return '?';
}

std::string_view Basename(std::string_view path) {
  const size_t slash = path.rfind('/');
  return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

std::string Timestamp() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t seconds = std::chrono::system_clock::to_time_t(now);
  const auto micros =
      std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() % 1000000;
  std::tm utc;
  gmtime_r(&seconds, &utc);
  return absl::StrFormat("%04d-%02d-%02d %02d:%02d:%02d.%06d", utc.tm_year + 1900, utc.tm_mon + 1,
                         utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec, micros);
}

}  // namespace

void SetMinLogLevel(LogLevel level) { MinLevel().store(level, std::memory_order_relaxed); }

LogLevel MinLogLevel() { return MinLevel().load(std::memory_order_relaxed); }

absl::StatusOr<LogLevel> ParseLogLevel(std::string_view name) {
  const std::string lower = absl::AsciiStrToLower(std::string(name));
  if (lower == "debug") return LogLevel::kDebug;
  if (lower == "info") return LogLevel::kInfo;
  if (lower == "warning" || lower == "warn") return LogLevel::kWarning;
  if (lower == "error") return LogLevel::kError;
  return absl::InvalidArgumentError(
      absl::StrCat("log level '", std::string(name), "' is not one of debug, info, warning, error"));
}

LogMessage::LogMessage(LogLevel level, const char* file, int line, std::string_view request_id)
    : level_(level) {
  stream_ << Timestamp() << ' ' << LevelLetter(level) << ' ' << syscall(SYS_gettid) << ' '
          << Basename(file) << ':' << line << "] ";
  if (!request_id.empty()) stream_ << '[' << request_id << "] ";
}

LogMessage::~LogMessage() {
  std::string text = std::move(stream_).str();
  if (text.empty() || text.back() != '\n') text.push_back('\n');
  std::fwrite(text.data(), 1, text.size(), stderr);  // one write per line: no interleaving
  if (level_ == LogLevel::kFatal) {
    std::fflush(stderr);
    std::abort();
  }
}

namespace internal {

void CheckFailed(const char* file, int line, const char* condition) {
  LogMessage(LogLevel::kFatal, file, line).stream() << "DUET_CHECK failed: " << condition;
  std::abort();  // not reached: a FATAL line aborts
}

void CheckFailed(const char* file, int line, const char* condition, std::string_view message) {
  LogMessage(LogLevel::kFatal, file, line).stream() << "DUET_CHECK failed: " << condition << " (" << message << ")";
  std::abort();
}

}  // namespace internal
}  // namespace duet

#include "cli/generate_progress.h"

#include <unistd.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace duet {
namespace {

constexpr int kBarWidth = 25;
constexpr auto kTerminalRedraw = std::chrono::milliseconds(100);
constexpr auto kLineEvery = std::chrono::seconds(1);

// tqdm's clock: MM:SS, or H:MM:SS from an hour on.
std::string FormatClock(double seconds) {
  const int64_t s = static_cast<int64_t>(std::llround(std::max(seconds, 0.0)));
  if (s >= 3600) return absl::StrFormat("%d:%02d:%02d", s / 3600, s / 60 % 60, s % 60);
  return absl::StrFormat("%02d:%02d", s / 60, s % 60);
}

}  // namespace

std::string FormatGenerateProgress(const GenerateProgressFigures& f) {
  const double fraction = f.total > 0 ? double(f.done) / double(f.total) : 1.0;
  const int filled = static_cast<int>(fraction * kBarWidth);
  const double per_s = f.elapsed_s > 0 ? 1.0 / f.elapsed_s : 0.0;
  const std::string remaining =
      f.done > 0 ? FormatClock(f.elapsed_s * double(f.total - f.done) / double(f.done)) : std::string("?");
  return absl::StrFormat(
      "Processed prompts: %3d%%|%s%s| %d/%d [%s<%s, %.2f it/s, est. speed input: %.2f toks/s, output: %.2f toks/s]",
      static_cast<int>(fraction * 100), std::string(static_cast<size_t>(filled), '#'),
      std::string(static_cast<size_t>(kBarWidth - filled), ' '), f.done, f.total, FormatClock(f.elapsed_s), remaining,
      double(f.done) * per_s, double(f.prompt_tokens) * per_s, double(f.output_tokens) * per_s);
}

GenerateProgress::GenerateProgress(int64_t total, ProgressMode mode, FILE* out)
    : out_(out),
      terminal_(::isatty(::fileno(out)) == 1),
      enabled_(mode == ProgressMode::kOn || (mode == ProgressMode::kAuto && terminal_)),
      start_(std::chrono::steady_clock::now()) {
  figures_.total = total;
  Draw();
}

GenerateProgress::~GenerateProgress() {
  if (!enabled_) return;
  if (!drawn_) Draw();
  if (terminal_) std::fputc('\n', out_);
  std::fflush(out_);
}

void GenerateProgress::Update(int64_t done, int64_t prompt_tokens, int64_t output_tokens) {
  if (done != figures_.done || prompt_tokens != figures_.prompt_tokens || output_tokens != figures_.output_tokens) {
    drawn_ = false;
  }
  figures_.done = done;
  figures_.prompt_tokens = prompt_tokens;
  figures_.output_tokens = output_tokens;
  const auto now = std::chrono::steady_clock::now();
  if (done == figures_.total || now - last_draw_ >= (terminal_ ? kTerminalRedraw : kLineEvery)) Draw();
}

void GenerateProgress::Draw() {
  if (!enabled_ || drawn_) return;
  last_draw_ = std::chrono::steady_clock::now();
  figures_.elapsed_s = std::chrono::duration<double>(last_draw_ - start_).count();
  const std::string line = FormatGenerateProgress(figures_);
  // In place on a terminal (\r, the line, erase what an older longer line left); else a line each.
  std::fputs(terminal_ ? absl::StrCat("\r", line, "\x1b[K").c_str() : absl::StrCat(line, "\n").c_str(), out_);
  std::fflush(out_);
  drawn_ = true;
}

}  // namespace duet

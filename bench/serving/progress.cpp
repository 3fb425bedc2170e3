#include "bench/serving/progress.h"

#include <unistd.h>

#include <cstdio>
#include <string>

namespace duet::bench {
namespace {
constexpr int kBarWidth = 40;
constexpr auto kRedrawEvery = std::chrono::milliseconds(100);
}  // namespace

ProgressBar::ProgressBar(int total, bool enabled)
    : total_(total), enabled_(enabled && ::isatty(STDERR_FILENO) == 1), start_(std::chrono::steady_clock::now()) {
  std::lock_guard lock(mu_);
  Draw();
}

ProgressBar::~ProgressBar() {
  if (enabled_) std::fputc('\n', stderr);
}

void ProgressBar::Finished(bool success) {
  std::lock_guard lock(mu_);
  ++done_;
  if (!success) ++failed_;
  const auto now = std::chrono::steady_clock::now();
  if (done_ == total_ || now - last_draw_ >= kRedrawEvery) Draw();
}

void ProgressBar::Draw() {
  if (!enabled_) return;
  last_draw_ = std::chrono::steady_clock::now();
  const int filled = total_ > 0 ? done_ * kBarWidth / total_ : kBarWidth;
  const double elapsed = std::chrono::duration<double>(last_draw_ - start_).count();
  std::fprintf(stderr, "\r[%s%s] %d/%d requests, %d failed, %.1f s", std::string(size_t(filled), '#').c_str(),
               std::string(size_t(kBarWidth - filled), '.').c_str(), done_, total_, failed_, elapsed);
  std::fflush(stderr);
}

}  // namespace duet::bench

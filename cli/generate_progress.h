// `duet generate`'s progress line on stderr, after vLLM's tqdm bar:
//
//   Processed prompts:  37%|#########                | 37/100 [00:12<00:20, 3.08 it/s, est. speed input: 123.45 toks/s, output: 456.78 toks/s]
//
// (requests done/total, elapsed<remaining, requests/s, prompt tokens of the finished requests
// and tokens generated so far, per second). A terminal gets the line redrawn in place; anything
// else (--progress with stderr redirected) a line per update. The JSONL output never sees it.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace duet {

enum class ProgressMode { kAuto, kOn, kOff };  // kAuto: when stderr is a terminal

struct GenerateProgressFigures {
  int64_t done = 0;
  int64_t total = 0;
  int64_t prompt_tokens = 0;  // of the finished requests
  int64_t output_tokens = 0;  // generated so far
  double elapsed_s = 0;
};
std::string FormatGenerateProgress(const GenerateProgressFigures& figures);

class GenerateProgress {
 public:
  // Draws on `out` when `mode` (and, for kAuto, `out` being a terminal) says so.
  GenerateProgress(int64_t total, ProgressMode mode, FILE* out = stderr);
  ~GenerateProgress();  // draws the last figures, once more if they changed, and ends the line
  GenerateProgress(const GenerateProgress&) = delete;
  GenerateProgress& operator=(const GenerateProgress&) = delete;

  bool enabled() const { return enabled_; }
  // The figures so far; drawn at most every 100 ms on a terminal, every second elsewhere, and
  // always when the last request is done.
  void Update(int64_t done, int64_t prompt_tokens, int64_t output_tokens);

 private:
  void Draw();

  FILE* const out_;
  const bool terminal_;
  const bool enabled_;
  const std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
  GenerateProgressFigures figures_;
  bool drawn_ = false;  // figures_ as they are now have been drawn
};

}  // namespace duet

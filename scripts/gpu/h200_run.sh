#!/usr/bin/env bash
# One call on the GPU machine (see docs/BENCHMARKS.md): kernel and CUDA-backend tests, a
# random-weight Llama-3-8B-shaped bf16 checkpoint made with transformers, the CUDA logits against
# transformers' float32 forward, then the kernel benchmarks, Duet's decode/prefill benchmark and
# (with --timings) transformers' own figures. Logs go to $OUT.
#
# Every timed figure has the GPU to itself: the checkpoint and its float32 reference (untimed) are
# made in the background only while the tests (untimed) run, and are waited for before the first
# benchmark; each benchmark then runs alone, one after another.
#
#   scripts/gpu/make_bundle.sh                     # here: builds and packs $BUNDLE_DIR (default .devbundle)
#   device run: [BUNDLE_DIR=.devbundle] bash scripts/gpu/h200_run.sh [--timings] [--compare] [--quick]
#                                                                    [--batch LIST] [--prefill LIST]
#
#   --timings  also time transformers (eager, sdpa), after Duet's benchmark
#   --compare  decode only (no prefill figures), Duet's benchmark four times: as built and with
#              one early GEMV group (--early-groups 1, as before) at every batch size, then both
#              again at batch 1 (the spread of the repeats is the noise); a decode table of all four
#   --quick    no tests and no kernel benchmarks: the checkpoint, the logits check, Duet's benchmark
#   --batch, --prefill  Duet's decode batch sizes and prefill lengths (default: cuda_llama_bench's;
#              --compare takes no prefill)
set -uo pipefail
OUT=${OUT:-/tmp/duet-gpu-out}
BUNDLE_DIR=${BUNDLE_DIR:-.devbundle}
mkdir -p "$OUT"
export OUT
timings=0 compare=0 quick=0 batch_args=() prefill_args=()
while (( $# )); do
  case $1 in
    --timings) timings=1 ;;
    --compare) compare=1 ;;
    --quick) quick=1 ;;
    --batch) batch_args=(--batch "$2"); shift ;;
    --prefill) prefill_args=(--prefill "$2"); shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
tar -xJf "$BUNDLE_DIR/bundle.tar.xz" -C /tmp || exit 1
source /tmp/devbundle/env.sh
export DUET_MODELS_DIR=$PWD/models
section() { echo "== [${SECONDS}s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

make_checkpoint() {
  PYTHONUNBUFFERED=1 python3 scripts/gpu/hf_reference.py --out /tmp/llama8b 2>&1 | grep -v Warning > "$OUT/hf.log"
}

if (( quick )); then
  section "transformers: checkpoint + float32 reference"
  make_checkpoint
else
  # Untimed work only while the checkpoint is made.
  section "transformers: checkpoint + float32 reference (background, during the tests)"
  make_checkpoint &
  hf_pid=$!
  if [[ -f scripts/gpu/h200_tests.sh ]]; then
    bash scripts/gpu/h200_tests.sh
  else
    section "kernel tests"
    kernels_tests > "$OUT/kernels_tests.log" 2>&1; echo "kernels_tests exit $?"
    grep -E "^\[  (PASSED|FAILED) |FAILED  \]" "$OUT/kernels_tests.log" | head -20
    section "CUDA backend tests (tiny-code-llama)"
    llama_cuda_tests > "$OUT/llama_cuda_tests.log" 2>&1; echo "llama_cuda_tests exit $?"
    grep -E "relative error|CUDA greedy|diverges|^\[  (PASSED|FAILED) |FAILED  \]|Failure|error:" \
      "$OUT/llama_cuda_tests.log" | head -30
  fi
  section "waiting for the checkpoint"
  wait $hf_pid
fi
tail -5 "$OUT/hf.log"
[[ -f /tmp/llama8b/logits.f32 ]] || { echo "no checkpoint: see $OUT/hf.log"; exit 1; }
section "CUDA logits vs transformers float32 (Llama-3-8B shape, random weights)"
cuda_logits_check --model /tmp/llama8b --tokens /tmp/llama8b/tokens.json --logits /tmp/llama8b/logits.f32 \
  --baseline-logits /tmp/llama8b/logits_bf16.f32 2>&1 | tee "$OUT/logits_check.log"

# From here on every step is timed, and each runs alone.
if (( ! quick )); then
  section "kernel benchmarks"
  for b in attention_bench elementwise_bench gemv_bench; do
    command -v $b >/dev/null && { $b > "$OUT/$b.log" 2>&1; grep -v SampleTokens "$OUT/$b.log" | tail -25; }
  done
fi
section "Duet CUDA benchmark"
if (( compare )); then
  before="--early-groups 1"
  bench() { local log=$1; shift; cuda_llama_bench --model /tmp/llama8b --prefill none "$@" 2>&1 | tee "$OUT/$log.log"; }
  bench bench "${batch_args[@]}"
  bench bench_before $before "${batch_args[@]}"
  bench bench_again --batch 1
  bench bench_before_again --batch 1 $before
  section "decode ms/step by batch size"
  for log in bench bench_before bench_again bench_before_again; do
    printf "%-20s " "$log"
    awk '/^batch/ {on = 1; next} on && NF == 8 {printf "b%s=%s ", $1, $2} END {print ""}' "$OUT/$log.log"
  done
else
  cuda_llama_bench --model /tmp/llama8b "${batch_args[@]}" "${prefill_args[@]}" 2>&1 | tee "$OUT/bench.log"
fi
if (( timings )); then
  section "transformers timings (eager, sdpa)"
  PYTHONUNBUFFERED=1 python3 scripts/gpu/hf_reference.py --out /tmp/llama8b --timings-only 2>&1 | grep -v Warning \
    | tee "$OUT/hf_timings.log"
  [[ -f /tmp/llama8b/timings.json ]] && cp /tmp/llama8b/timings.json "$OUT/"
fi
# At most 8 files come back: the benchmark logs as they are, everything else in one archive.
(cd "$OUT" && tar -czf /tmp/logs.tgz --exclude 'bench*.log' ./* && find . -maxdepth 1 -type f ! -name 'bench*.log' -delete \
  && mv /tmp/logs.tgz .)
section "done"

#!/usr/bin/env bash
# The long libFuzzer runs of tests/fuzz (issue 17: >= 10M executions per target), both targets at
# once in libFuzzer's fork mode, on whatever machine has the cores (the GPU machine's 16 serve).
#
#   here:  a clang build of the two targets (tests/fuzz/README.md), then
#          bash /work/shared/device/bundle.sh /tmp/s/devbundle B/bin/fuzz_frontend_libfuzzer B/bin/fuzz_weights_libfuzzer
#          tar -C /tmp/s -cJf .devbundle/f/bundle.tar.xz devbundle
#          fuzz_frontend --write-corpus .devbundle/f/corpus; fuzz_weights --write-corpus .devbundle/f/corpus_w
#          cp models/tiny-code-llama/{tokenizer.json,tokenizer_config.json} .devbundle/f/
#   there: BUNDLE_DIR=.devbundle/f SECONDS_EACH=420 FRONTEND_JOBS=13 WEIGHTS_JOBS=3 bash scripts/fuzz_long.sh
#
# Inputs up to MAX_LEN bytes (4096: the HTTP, JSON, descriptor and template parsers see whole
# inputs; the 540 KB tokenizer.json seed is cut, so its loader sees truncated files). Logs and any
# crash, leak or timeout input under $OUT; the final totals are printed last.
set -uo pipefail
OUT=${OUT:-/tmp/duet-fuzz-out}
BUNDLE_DIR=${BUNDLE_DIR:-.devbundle/f}
mkdir -p "$OUT/artifacts" /tmp/fuzz-corpus/frontend /tmp/fuzz-corpus/weights
tar -xJf "$BUNDLE_DIR/bundle.tar.xz" -C /tmp || exit 1
source /tmp/devbundle/env.sh
mkdir -p /tmp/fuzz-models/tiny-code-llama
cp "$BUNDLE_DIR"/tokenizer.json "$BUNDLE_DIR"/tokenizer_config.json /tmp/fuzz-models/tiny-code-llama/
export DUET_MODELS_DIR=/tmp/fuzz-models
echo "cores: $(nproc)"
run() {  # name, corpus seed dir, jobs
  "fuzz_$1_libfuzzer" "/tmp/fuzz-corpus/$1" "$2" -fork="$3" -max_total_time="${SECONDS_EACH:-420}" \
    -max_len="${MAX_LEN:-4096}" -artifact_prefix="$OUT/artifacts/$1-" -print_final_stats=1 > "$OUT/$1.log" 2>&1
  echo "$1 exit $?"
}
targets=()
for t in frontend:corpus:${FRONTEND_JOBS:-13} weights:corpus_w:${WEIGHTS_JOBS:-3}; do  # jobs 0: not run
  IFS=: read -r name seeds jobs <<< "$t"
  (( jobs > 0 )) || continue
  targets+=("$name")
  run "$name" "$BUNDLE_DIR/$seeds" "$jobs" &
done
wait
for t in "${targets[@]}"; do
  echo "== $t: last status line (#executions, coverage, corpus, exec/s, oom/timeout/crash)"
  grep -E '^#[0-9]+: cov' "$OUT/$t.log" | tail -1
  grep -E 'ERROR: libFuzzer|SUMMARY|deadly signal' "$OUT/$t.log" | head -5
done
ls "$OUT/artifacts"

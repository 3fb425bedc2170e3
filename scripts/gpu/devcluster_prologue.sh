# Sourced by the GPU scripts that run the cluster bundle of scripts/gpu/make_cluster_bundle.sh
# (carried as .devcluster/bundle.tar.xz): $OUT (the caller's default unless the device tool set
# it), the bundle's programs and libraries on the path, $MODEL, the GPU's name in $OUT/gpu.txt, and
# llama8b_checkpoint: the random-weight Llama-3-8B-shaped checkpoint in $MODEL (kept from an earlier
# run on the machine) with the bundle's Llama-3 tokenizer; the clock sampler of clocks.sh;
# remake_tiny_model; run_bundled_tests, and finish_out, which the scripts call last.
mkdir -p "$OUT"
tar -xJf .devcluster/bundle.tar.xz -C /tmp || exit 1
source /tmp/devbundle/env.sh
MODEL=/tmp/llama8b
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
source scripts/gpu/clocks.sh
llama8b_checkpoint() {  # [LAYERS (32)] [LONG_CONTEXT (False): Llama-3.1's RoPE scaling, 131,072 positions]
  [[ -f $MODEL/config.json ]] || python3 -c "
import sys; sys.path.insert(0, 'scripts/gpu')
from hf_reference import make_checkpoint
make_checkpoint('$MODEL', ${1:-32}, long_context=${2:-False})" 2>&1 | grep -v Warning | tail -2
  cp /tmp/devbundle/tokenizer.json /tmp/devbundle/tokenizer_config.json "$MODEL/"
}
# Where the tiny model's weights did not travel (the carry limit), remade at random from its config;
# returns 0 if it remade them (the tests against the stored Hugging Face reference then do not apply).
remake_tiny_model() {
  ls models/tiny-code-llama/*.safetensors > /dev/null 2>&1 && return 1
  echo "== tiny model: random weights from its config"
  python3 scripts/gpu/random_tiny_model.py models/tiny-code-llama/config.json models/tiny-code-llama 2>&1 |
    grep -v Warning | tail -2
}
# The router's gRPC port once `duet serve` (pid PID, stdout in SERVE_OUT) is ready; nothing if it
# exited or took more than SECONDS (default 240).
serve_port() {  # SERVE_OUT PID [SECONDS]
  local port=""
  for _ in $(seq 1 "${3:-240}"); do
    port=$(sed -n 's/^DUET_READY grpc_port=//p' "$1")
    [[ -n $port ]] && break
    kill -0 "$2" 2>/dev/null || break
    sleep 1
  done
  echo "$port"
}
# The bundled test programs named in $TESTS, twice each (gtest filter $TEST_FILTER, default: all
# but the tests that need several GPUs or the draft model; PROGRAM=FILTER gives one program its
# own, e.g. "llama_cuda_tests kernels_tests=WideGemm*:FillRandom*"), with the checkpoint made on the CPUs
# meanwhile. Where the tiny model's weights did not travel (the carry limit), they are remade at
# random from its config and the tests against the stored Hugging Face reference are left out.
# MAKE_CHECKPOINT=0: the caller needs no Llama-3-8B checkpoint.
run_bundled_tests() {
  local checkpoint_pid=0 exclude='*DraftModel*:*EveryGpu*:*OverNccl*' filter run t program
  if [[ ${MAKE_CHECKPOINT:-1} != 0 ]]; then
    llama8b_checkpoint > "$OUT/checkpoint.log" 2>&1 &
    checkpoint_pid=$!
  fi
  export DUET_MODELS_DIR=$PWD/models NCCL_NVLS_ENABLE=0
  remake_tiny_model && exclude="*HuggingFace*:$exclude"
  filter=${TEST_FILTER:--$exclude}
  for run in 1 2; do
    for t in $TESTS; do
      program=${t%%=*}
      timeout 300 "$program" --gtest_filter="$([[ $t == *=* ]] && echo "${t#*=}" || echo "$filter")" \
        > "$OUT/${program}_$run.log" 2>&1
      bundled_test_results+=("$t run $run: exit $?, $(grep -c '^\[       OK' "$OUT/${program}_$run.log") passed")
      echo "${bundled_test_results[-1]}"
      grep -hE "^\[  FAILED|Failure$" "$OUT/${program}_$run.log" | head -5
    done
  done
  (( checkpoint_pid == 0 )) || wait "$checkpoint_pid"
}

# A cuda_llama_bench log's decode step at batch B (ms) and its first mixed step (ms): "DECODE MIXED".
bench_step_ms() {  # LOG B
  local decode mixed
  decode=$(awk -v b="$2" '$1 == b && NF == 8 {print $2; exit}' "$1")
  mixed=$(awk '/^mixed steps/ {m = 1; next} m && $1 ~ /^[0-9]+$/ {print $3; exit}' "$1")
  echo "${decode:-?} ${mixed:-?}"
}

# The table of the cuda_llama_bench logs $OUT/step_<variant>_<round>.log: each round's and variant's
# decode and mixed step (ms), the variants' column named NAME.
step_table() {  # ROUNDS BATCH NAME VARIANT...
  local rounds=$1 batch=$2 name=$3 round variant decode mixed_ms
  shift 3
  printf '%-6s %-6s %10s %10s\n' round "$name" decode mixed
  for round in $(seq 1 "$rounds"); do
    for variant in "$@"; do
      read -r decode mixed_ms <<< "$(bench_step_ms "$OUT/step_${variant}_$round.log" "$batch")"
      printf '%-6s %-6s %10s %10s\n' "$round" "$variant" "$decode" "$mixed_ms"
    done
  done
}

# The bundled tests' results again (the last lines a caller reads), and $OUT packed into one
# archive where it holds more files than the device tool brings back (8).
bundled_test_results=()
finish_out() {
  (( ${#bundled_test_results[@]} == 0 )) || printf '%s\n' "== bundled tests" "${bundled_test_results[@]}"
  local files
  files=$(find "$OUT" -type f | wc -l)
  if (( files > 8 )); then
    # tar's 1: a file (the clock sampler's) changed while read, still packed.
    tar -C "$OUT" -cJf /tmp/duet-out.tar.xz --warning=no-file-changed .
    (( $? <= 1 )) && find "$OUT" -mindepth 1 -delete && mv /tmp/duet-out.tar.xz "$OUT/out.tar.xz" &&
      echo "== $files files of \$OUT packed into out.tar.xz"
  fi
}

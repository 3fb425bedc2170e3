#!/usr/bin/env bash
# Two builds of cuda_llama_bench on one card, alternately (A, B, A, B, ...), so a difference
# between two commits is not a difference between cards or moments. Each bundle is a
# devbundle tarball holding cuda_llama_bench (../shared/device/bundle.sh; see make_bundle.sh).
#
#   device run: bash scripts/gpu/h200_ab.sh A.tar.xz B.tar.xz [ROUNDS=3] [cuda_llama_bench flags]
#
# Logs under $OUT (ab_<label>_<round>.log); the table last: each build's ms/step per batch and
# ms per prefill length, median (min-max) over the rounds.
set -uo pipefail
OUT=${OUT:-/tmp/duet-gpu-out}
mkdir -p "$OUT"
a=$1 b=$2; shift 2
rounds=${ROUNDS:-3}
for side in a b; do
  mkdir -p "/tmp/ab_$side" && tar -xJf "${!side}" -C "/tmp/ab_$side" || exit 1
done
PYTHONUNBUFFERED=1 python3 scripts/gpu/hf_reference.py --out /tmp/llama8b 2>&1 | grep -v Warning > "$OUT/hf.log"
[[ -d /tmp/llama8b ]] || { echo "no checkpoint: see $OUT/hf.log"; exit 1; }
for round in $(seq 1 "$rounds"); do
  for side in a b; do
    (source "/tmp/ab_$side/devbundle/env.sh" && cuda_llama_bench --model /tmp/llama8b "$@") \
      > "$OUT/ab_${side}_$round.log" 2>&1
    echo "round $round build $side: exit $?"
  done
done
python3 - "$OUT" "$rounds" <<'PY'
import re, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
rows = {}  # (kind, size) -> {side: [ms]}
for side in "ab":
    for r in range(1, rounds + 1):
        section = None
        for line in open(f"{out}/ab_{side}_{r}.log"):
            if line.startswith("prefill"): section = "prefill"
            elif line.startswith("batch"): section = "decode"
            m = re.match(r"^(\d+)\s+([\d.]+)\s", line)
            if section and m:
                rows.setdefault((section, int(m.group(1))), {}).setdefault(side, []).append(float(m.group(2)))
fmt = lambda v: f"{statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})" if v else "-"
print(f"{'':8} {'size':>6}  {'A ms':>26}  {'B ms':>26}  B/A")
for (kind, size), sides in sorted(rows.items()):
    a, b = sides.get("a", []), sides.get("b", [])
    ratio = statistics.median(b) / statistics.median(a) if a and b else float("nan")
    print(f"{kind:8} {size:>6}  {fmt(a):>26}  {fmt(b):>26}  {ratio:.3f}")
PY

#!/usr/bin/env bash
# What a device call would carry: the working tree's tracked files that are present, plus the
# given carried folders, against the device tool's 64 MiB; says which model folders to move out
# when it does not fit (tracked files absent from the tree do not travel).
#
#   scripts/gpu/carry_size.sh .devbundle [.devcluster ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
limit=$((64 << 20))
tree=$( (git ls-files -z | xargs -0 stat -c %s 2>/dev/null || true) | awk '{s += $1} END {print s + 0}')
carried=0
for dir in "$@"; do carried=$((carried + $(du -sb "$dir" | cut -f1))); done
total=$((tree + carried))
awk -v t="$tree" -v c="$carried" -v names="$*" \
  'BEGIN { printf "carry: tree %.1f MiB + %s %.1f MiB = %.1f MiB of 64\n", t / 1048576, names, c / 1048576, (t + c) / 1048576 }'
if ((total > limit)); then
  echo "too large: move model folders out of the tree for the call, e.g."
  for m in models/*/; do [[ -d $m ]] && printf '  mv %s /tmp/  (%s)\n' "${m%/}" "$(du -sh "$m" | cut -f1)"; done
  exit 1
fi

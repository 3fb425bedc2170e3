#!/usr/bin/env bash
# Prints the Debian packages (name:arch) that own the shared libraries a binary loads, one a
# line: what its runtime image must install. Fails when a library belongs to no package (it
# would be missing at run time).
#   deploy/docker/runtime-packages.sh build/bin/duet
set -euo pipefail
binary=${1:?usage: runtime-packages.sh BINARY}
owners=()
missing=0
while read -r lib; do
  # dpkg knows a library by the path its package ships (/lib/... on merged-/usr systems too).
  owner=$(dpkg -S "$lib" 2>/dev/null || dpkg -S "$(readlink -f "$lib")" 2>/dev/null || true)
  if [ -z "$owner" ]; then
    echo "runtime-packages: no package owns $lib" >&2
    missing=1
  else
    owners+=("${owner%%: *}")
  fi
done < <(ldd "$binary" | awk '$3 ~ /^\// {print $3}')
[ "$missing" -eq 0 ] || exit 1
printf '%s\n' "${owners[@]}" | sort -u

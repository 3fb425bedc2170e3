#!/usr/bin/env bash
# Prints the Debian packages (name:arch) that own the shared libraries a binary loads, one a
# line: what its runtime image must install. Fails when a library belongs to no package (it
# would be missing at run time), except Duet's own (in the binary's build tree: the image copies
# them) and a CUDA toolkit's under /usr/local/cuda* that no package owns (a runfile install, as on
# the CI machine; in the image NVIDIA's packages own them and are listed).
#   deploy/docker/runtime-packages.sh build/bin/duet
set -euo pipefail
binary=${1:?usage: runtime-packages.sh BINARY}
build_tree=$(cd "$(dirname "$binary")/.." && pwd)
mapfile -t libs < <(ldd "$binary" | awk -v own="$build_tree/" '$3 ~ /^\// && index($3, own) != 1 {print $3}')
[ "${#libs[@]}" -gt 0 ] || { echo "runtime-packages: ldd found no libraries in $binary" >&2; exit 1; }
# dpkg knows a library by the path its package ships (/lib/... on merged-/usr systems too), so
# ask for the path ldd printed, then for the real file behind the ones dpkg did not find.
owners=$(dpkg -S "${libs[@]}" 2>/dev/null || true)
missing=()
owned() { awk -v path="$1" '$NF == path {found = 1} END {exit !found}' <<<"$2"; }
for lib in "${libs[@]}"; do
  owned "$lib" "$owners" || missing+=("$(readlink -f "$lib")")
done
if [ "${#missing[@]}" -gt 0 ]; then
  more=$(dpkg -S "${missing[@]}" 2>/dev/null || true)
  for lib in "${missing[@]}"; do
    owned "$lib" "$more" && continue
    case "$lib" in
      /usr/local/cuda*) echo "runtime-packages: $lib (CUDA toolkit) belongs to no package here" >&2 ;;
      *) echo "runtime-packages: no package owns $lib" >&2; exit 1 ;;
    esac
  done
  owners+=$'\n'"$more"
fi
sed -n 's/^\([^ ]*\): .*/\1/p' <<<"$owners" | tr ',' '\n' | sed 's/^ *//' | sort -u

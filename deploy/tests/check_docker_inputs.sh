#!/usr/bin/env bash
# What deploy/docker/Dockerfile relies on, checked without docker: every path it COPYs from the
# build context exists, its dockerignore keeps build outputs out, and runtime-packages.sh finds a
# Debian package for every library the built `duet` loads (the runtime stage installs those).
#   deploy/tests/check_docker_inputs.sh build/bin/duet      (from the repository root)
set -euo pipefail
duet=${1:?usage: check_docker_inputs.sh DUET_BINARY}
dockerfile=deploy/docker/Dockerfile
fail() { echo "check_docker_inputs: $*" >&2; exit 1; }

# COPY lines without --from read the build context (the repository root).
while read -r src; do
  [ "$src" = "." ] || [ -e "$src" ] || fail "$dockerfile copies $src, which does not exist"
done < <(awk '/^COPY / && !/--from=/ {print $2}' "$dockerfile")
# The stages copy the bundled model and the entrypoint from the build stage.
grep -q '^COPY --from=build-cpu /src/models/tiny-code-llama ' "$dockerfile" || fail "the cpu image lacks the tiny model"
[ -f models/tiny-code-llama/config.json ] || fail "models/tiny-code-llama/config.json is missing"
for pattern in build '**/node_modules' .git; do
  grep -qx "$pattern" deploy/docker/Dockerfile.dockerignore || fail "Dockerfile.dockerignore does not ignore $pattern"
done

packages=$(deploy/docker/runtime-packages.sh "$duet") || fail "runtime-packages.sh failed"
for needed in 'libgrpc++' libprotobuf libabsl libucx; do
  grep -q "^$needed" <<<"$packages" || fail "no $needed* package among the runtime packages: $packages"
done
echo "runtime packages of $duet:"
echo "$packages"

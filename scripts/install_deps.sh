#!/usr/bin/env bash
# Installs every Debian package Duet needs to build, test and run. Idempotent:
# packages already present are skipped, and `apt-get update` runs at most once.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libabsl-dev libprotobuf-dev protobuf-compiler libgrpc++-dev protobuf-compiler-grpc
  libucx-dev ucx-utils
  libopenblas-dev libpcre2-dev nlohmann-json3-dev libcli11-dev libxxhash-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libboost1.81-dev libssl-dev  # Beast/Asio; OpenSSL for TLS (HTTP and gRPC listeners, test certificates)
  prometheus curl iproute2
  # deploy/tests: Helm's template engine (Go text/template + sprig) and values schema check
  golang-go golang-github-masterminds-sprig-dev golang-k8s-sigs-yaml-dev golang-github-xeipuuv-gojsonschema-dev
  clang libclang-rt-14-dev  # libFuzzer builds of tests/fuzz (a CMake build with CXX=clang++)
)

missing=()
for pkg in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
# Node.js (for the real-client tests) may come from Debian or from NodeSource; either will do.
command -v node >/dev/null 2>&1 || missing+=(nodejs)
command -v npm >/dev/null 2>&1 || missing+=(npm)

if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "install_deps: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

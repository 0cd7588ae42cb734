#!/usr/bin/env bash
# Installs every Debian package the project needs to build, test, run the demo and
# check its deployment files. The single list of dependencies: README and .ci/run use it.
# Skips apt entirely when everything is already installed (fast re-runs, offline re-runs).
set -euo pipefail

PACKAGES=(
  # build
  build-essential cmake ninja-build pkg-config git
  # service stack
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  prometheus-cpp-dev libcivetweb-dev nlohmann-json3-dev zlib1g-dev libssl-dev libc-ares-dev libre2-dev
  # tests (qemu-user: the binaries on emulated CPUs without AVX-512 / AVX, tests/isa)
  libgtest-dev libgmock-dev qemu-user
  # certificates for the TLS tests and deployments (scripts/make-certs.sh)
  openssl
  # CPU math (GEMM roofline reference)
  libdnnl-dev
  # independent reference, python client, plots
  python3 python3-torch python3-numpy python3-grpcio python3-protobuf python3-matplotlib gnuplot-nox
  # venvs: the Python package installed offline; tritonclient from PyPI (perf_analyzer needs libb64)
  python3-venv python3-setuptools python3-wheel libb64-0d
  # observability and deployment checks
  prometheus yamllint docker-compose python3-yaml
  # tooling; clang and its sanitizer/libFuzzer runtimes for the coverage-guided fuzzing stage
  clang-format curl procps clang libclang-rt-14-dev
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${#missing[@]} packages: ${missing[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"

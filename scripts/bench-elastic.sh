#!/usr/bin/env bash
# Elastic expert parallelism under load (issue "Elastic expert parallelism"): 16 callers for
# 20 s against a k3-mini gateway + 4 ranks on loopback, through a SIGKILLed and a SIGSTOPped
# rank and their return, then a live re-placement to the EPLB advice. Every call must succeed
# with a bit-identical result (the run fails otherwise). Prints the figures and keeps them in
# docs/bench/elastic-cpu.txt with the host they were measured on.
#
#   scripts/bench-elastic.sh [BUILD_DIR] [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
seconds=${2:-20}
bench="$build/bin/server_elastic_bench"
if [[ ! -x "$bench" ]]; then
  echo "bench-elastic: $bench is missing: build first (cmake --build $build)" >&2
  exit 2
fi
out=docs/bench/elastic-cpu.txt
mkdir -p "$(dirname "$out")"
{
  echo "# scripts/bench-elastic.sh, $(date -u +%Y-%m-%d), ${seconds} s per run"
  echo "# host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) CPUs;" \
       "ISA: $(grep -o 'avx512[a-z0-9_]*\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  echo "# commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  MOE_ELASTIC_BENCH_S="$seconds" "$bench" 2>/dev/null | grep -v '^\[\|^Running main\|^$'
} | tee "$out.tmp"
mv "$out.tmp" "$out"

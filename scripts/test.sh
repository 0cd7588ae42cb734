#!/usr/bin/env bash
# The test command of the README: installs what is missing, builds, runs the whole suite.
#
#   scripts/test.sh            release build + every test except the `slow` label, then the
#                              sanitizer builds (ASan/UBSan on the unit tests, TSan on the
#                              concurrent parts)
#   MOE_TEST_SLOW=1 scripts/test.sh   also the `slow` label (full-size, long multi-process runs)
#   MOE_TEST_SANITIZERS=0 ...          skip the sanitizer builds
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
jobs=$(nproc)

echo "== release build"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$jobs"

labels_exclude="slow"
[ "${MOE_TEST_SLOW:-0}" = "1" ] && labels_exclude="^$"
echo "== tests (excluding label: $labels_exclude)"
ctest --test-dir build -LE "$labels_exclude" --output-on-failure -j"$jobs" --timeout 1500

if [ "${MOE_TEST_SANITIZERS:-1}" = "1" ]; then
  echo "== ASan + UBSan build (unit tests, and the trust-boundary tests' gateway and ranks)"
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOE_SANITIZE=ON >/dev/null
  cmake --build build-asan -j"$jobs" --target moe-tests-unit moe-tests-asan-e2e
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-asan -L "unit|asan-e2e" --output-on-failure -j"$jobs"

  echo "== TSan build (concurrent parts)"
  cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOE_TSAN=ON >/dev/null
  cmake --build build-tsan -j"$jobs" --target moe-tests-concurrency
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
    ctest --test-dir build-tsan -L "concurrency" --output-on-failure -j"$jobs"
fi
echo "== all tests passed"

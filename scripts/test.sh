#!/usr/bin/env bash
# The test command of the README: installs what is missing, builds, runs the whole suite.
#
#   scripts/test.sh            release build + every test except the `slow` label, then the
#                              sanitizer builds (ASan/UBSan on the unit tests, TSan on the
#                              concurrent parts)
#   MOE_TEST_SLOW=1 scripts/test.sh   also the `slow` label (full-size, long multi-process runs)
#   MOE_TEST_SANITIZERS=0 ...          skip the sanitizer builds (and the fuzzing stage)
#   MOE_TEST_FUZZ_SECONDS=N ...        libFuzzer time per target (default 10; 0 skips the stage)
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
jobs=$(nproc)
started=$SECONDS
# A stage's heading, with the minutes spent so far (CI time is a budget).
stage() { echo "== $* (at $(((SECONDS - started) / 60)) min)"; }

stage "release build"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$jobs"

labels_exclude="slow"
[ "${MOE_TEST_SLOW:-0}" = "1" ] && labels_exclude="^$"
stage "tests (excluding label: $labels_exclude)"
ctest --test-dir build -LE "$labels_exclude" --output-on-failure -j"$jobs" --timeout 1500

# The instrumented trees: -O1 -g1 (line tables, enough for every sanitizer report's stack) compile
# about 2.5x faster than RelWithDebInfo's -O2 -g (measured on service_test.cc under ASan: 42 s
# against 105 s), for tests that run a little slower.
instrumented=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG"
              "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG")
if [ "${MOE_TEST_SANITIZERS:-1}" = "1" ]; then
  stage "ASan + UBSan build (unit tests, and the trust-boundary tests' gateway and ranks)"
  cmake -S . -B build-asan -G Ninja "${instrumented[@]}" -DMOE_SANITIZE=ON >/dev/null
  cmake --build build-asan -j"$jobs" --target moe-tests-unit moe-tests-asan-e2e
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-asan -L "unit|asan-e2e" --output-on-failure -j"$jobs"

  stage "TSan build (concurrent parts)"
  cmake -S . -B build-tsan -G Ninja "${instrumented[@]}" -DMOE_TSAN=ON >/dev/null
  cmake --build build-tsan -j"$jobs" --target moe-tests-concurrency
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
    ctest --test-dir build-tsan -L "concurrency" --output-on-failure -j"$jobs"
fi
fuzz_seconds="${MOE_TEST_FUZZ_SECONDS:-10}"
if [ "${MOE_TEST_SANITIZERS:-1}" = "1" ] && [ "$fuzz_seconds" != "0" ]; then
  # Coverage-guided fuzzing of the parsers of untrusted bytes (docs/FUZZING.md) for a bounded
  # time per target, two at a time: clang + libFuzzer + ASan/UBSan, only the fuzz targets built.
  # New inputs go to a scratch corpus; a crash fails the stage and leaves its input in build-fuzz/.
  stage "libFuzzer (clang, ASan + UBSan): $fuzz_seconds s per target"
  targets=(npy safetensors index config request kserve rest step control)
  cmake -S . -B build-fuzz -G Ninja "${instrumented[@]}" -DMOE_ENABLE_CUDA=OFF \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DMOE_FUZZ=ON >/dev/null
  cmake --build build-fuzz -j"$jobs" --target "${targets[@]/#/fuzz_}"
  printf '%s\n' "${targets[@]}" | xargs -P "$jobs" -I{} bash -c '
    mkdir -p build-fuzz/found/{}
    if build-fuzz/bin/fuzz_{} build-fuzz/found/{} tests/fuzz/corpus/{} -max_total_time='"$fuzz_seconds"' \
         -rss_limit_mb=2048 -artifact_prefix=build-fuzz/crash-{}- >build-fuzz/fuzz_{}.log 2>&1; then
      echo "fuzz_{}: $(grep -o "Done [0-9]* runs in [0-9]* second(s)" build-fuzz/fuzz_{}.log), nothing found"
    else
      tail -40 build-fuzz/fuzz_{}.log; echo "fuzz_{}: FAILED (input: build-fuzz/crash-{}-*)"; exit 255
    fi'
fi
stage "all tests passed"

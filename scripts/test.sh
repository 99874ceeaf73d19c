#!/usr/bin/env bash
# The test command: installs what is missing, builds, runs every doctest suite and the
# interop test with ctest, then builds the torch-free suites with AddressSanitizer +
# UndefinedBehaviorSanitizer and runs them too (skip that part with KILN_SKIP_SANITIZE=1).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="$("$ROOT/scripts/build.sh" | tail -n1)"
echo "== tests ($BUILD)"
# ctest runs two test processes at once: give each its share of the cores. With more OpenMP
# threads than that, torch's workers wait for cores the other process holds (the RL tests ran
# 6x to 40x slower so on this 2-core machine).
NPROC="$(nproc)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( NPROC / 2 > 0 ? NPROC / 2 : 1 ))}"
ctest --test-dir "$BUILD" --output-on-failure -j2
if [ "${KILN_SKIP_SANITIZE:-0}" != "1" ]; then
  echo "== tests under ASan + UBSan (torch-free suites)"
  # -O1 -g1 (line tables, enough for the sanitizers' stack traces): with -O2 -g this build took
  # 27 of a fresh 67-minute run on 2 cores (2026-12-03), the tests under it 11 s.
  SAN="$(KILN_BUILD_DIR="$ROOT/build-asan" KILN_BUILD_TYPE=RelWithDebInfo "$ROOT/scripts/build.sh" \
         -DKILN_WITH_TORCH=OFF -DKILN_SANITIZE=ON -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
         -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" | tail -n1)"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
  LSAN_OPTIONS=suppressions="$ROOT/tests/sanitizers/lsan.supp" \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:suppressions="$ROOT/tests/sanitizers/ubsan.supp" \
    ctest --test-dir "$SAN" --output-on-failure -j2
fi

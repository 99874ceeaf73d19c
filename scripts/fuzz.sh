#!/usr/bin/env bash
# Fuzz benchmark: builds the libFuzzer harnesses of tests/fuzz with clang
# (-fsanitize=fuzzer,address,undefined; torch-free, KILN_FUZZ=ON) into ${KILN_FUZZ_BUILD_DIR:-build-fuzz}
# and runs each for ${KILN_FUZZ_RUNS:-1000000} inputs, one harness at a time, starting from
# its checked-in corpus (tests/fuzz/corpus/<harness>, never written: new inputs go to a
# scratch directory). Prints one line per harness: inputs run, exec/s, and "no crash" or the
# crash file libFuzzer wrote (under ${KILN_FUZZ_OUT:-build-fuzz/findings}/<harness>/).
# Usage: scripts/fuzz.sh [HARNESS...]   (default: all; extra libFuzzer flags in KILN_FUZZ_FLAGS)
# Needs the Debian packages of scripts/setup.sh plus clang and libFuzzer:
#   apt-get install -y --no-install-recommends clang-14 libclang-rt-14-dev
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${KILN_FUZZ_BUILD_DIR:-$ROOT/build-fuzz}"
RUNS="${KILN_FUZZ_RUNS:-1000000}"
OUT="${KILN_FUZZ_OUT:-$BUILD/findings}"
ALL=(envelope safetensors checkpoint_index hf_config experiment_toml tokenizer)
HARNESSES=("$@")
((${#HARNESSES[@]})) || HARNESSES=("${ALL[@]}")
CXX="${KILN_FUZZ_CXX:-$(command -v clang++-14 || command -v clang++ || true)}"
CC="${KILN_FUZZ_CC:-$(command -v clang-14 || command -v clang || true)}"
[ -n "$CXX" ] || { echo "fuzz.sh: clang++ not found (apt-get install -y --no-install-recommends clang-14 libclang-rt-14-dev)" >&2; exit 1; }

export CCACHE_DIR="${CCACHE_DIR:-${KILN_CACHE:-$HOME/.cache/kiln}/ccache}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$ROOT}" CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="$CXX" \
  -DCMAKE_C_COMPILER="$CC" -DKILN_WITH_TORCH=OFF -DKILN_FUZZ=ON >&2
cmake --build "$BUILD" -j"$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)" --target "${HARNESSES[@]/#/kiln_fuzz_}" >&2

printf '%-18s %10s %10s  %s\n' harness inputs exec/s result
# The harnesses write each input to a scratch file (the readers take paths): tmpfs, not disk.
if [ -z "${TMPDIR:-}" ] && [ -d /dev/shm ] && [ -w /dev/shm ]; then export TMPDIR=/dev/shm; fi
status=0
for h in "${HARNESSES[@]}"; do
  work="$(mktemp -d -t kiln-fuzz-corpus-XXXXXX)"
  mkdir -p "$OUT/$h"
  log="$OUT/$h/fuzz.log"
  set +e
  UBSAN_OPTIONS="print_stacktrace=1:${UBSAN_OPTIONS:-}" nice -n "${KILN_FUZZ_NICE:-10}" \
    "$BUILD/tests/fuzz/kiln_fuzz_$h" -runs="$RUNS" -artifact_prefix="$OUT/$h/" -print_final_stats=1 \
    ${KILN_FUZZ_FLAGS:-} "$work" "$ROOT/tests/fuzz/corpus/$h" >"$log" 2>&1
  rc=$?
  set -e
  rm -rf "$work"
  runs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n1)"
  rate="$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n1)"
  if [ "$rc" -eq 0 ]; then
    result="no crash"
  else
    found="$(ls -t "$OUT/$h"/crash-* "$OUT/$h"/leak-* "$OUT/$h"/timeout-* "$OUT/$h"/oom-* 2>/dev/null | head -n1 || true)"
    result="CRASH (exit $rc): ${found:-no artifact}, log $log"
    status=1
  fi
  printf '%-18s %10s %10s  %s\n' "$h" "${runs:-?}" "${rate:-?}" "$result"
done
exit "$status"

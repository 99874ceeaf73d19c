#!/usr/bin/env bash
# Configures and builds kiln into ${KILN_BUILD_DIR:-build} (Release), after scripts/setup.sh.
# Extra arguments go to cmake's configure step (e.g. -DKILN_SANITIZE=ON). KILN_TARGETS (e.g.
# "kiln") builds only those targets. The configure step runs when the build directory is new or
# arguments are given (ninja re-runs it by itself when a CMakeLists.txt changes).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${KILN_BUILD_DIR:-$ROOT/build}"
TORCH_PREFIX="$("$ROOT/scripts/setup.sh" | tail -n1)"
export CCACHE_DIR="${CCACHE_DIR:-${KILN_CACHE:-$HOME/.cache/kiln}/ccache}"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
# Relative paths in the cache key, so that every clone (CI clones elsewhere) hits the same cache.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$ROOT}"
export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
# Precompiled headers and ccache: hash the PCH contents, not its timestamp.
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"
if [ ! -f "$BUILD/build.ninja" ] || [ $# -gt 0 ]; then
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE="${KILN_BUILD_TYPE:-Release}" \
    -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" \
    -DKILN_PYTHON="${KILN_CACHE:-$HOME/.cache/kiln}/venv/bin/python" "$@" >&2
fi
targets=()
for t in ${KILN_TARGETS:-}; do targets+=(--target "$t"); done
# nproc without OMP_NUM_THREADS / OMP_THREAD_LIMIT, which it honours: scripts/test.sh sets them
# for the tests, and the sanitizer build after them ran one job at a time (11 min instead of ~6).
cmake --build "$BUILD" -j"$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)" "${targets[@]}" >&2
echo "$BUILD"

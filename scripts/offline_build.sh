#!/usr/bin/env bash
# Builds kiln on a machine without package access, from a bundle made by scripts/bundle_deps.sh:
#   scripts/offline_build.sh BUNDLE.tar [PREFIX] [-- extra cmake args]
# 1. unpacks every .deb of the bundle into PREFIX (default ~/.cache/kiln/deps; dpkg -x, no root,
#    nothing written outside PREFIX) and writes PREFIX/env.sh (LD_LIBRARY_PATH for the bundled
#    shared libraries: source it before running kiln);
# 2. configures and builds kiln into ${KILN_BUILD_DIR:-build} with the node's own compiler,
#    CUDA toolkit and LibTorch (the torch of ${KILN_PYTHON:-python3}), Ninja when present;
#    KILN_BUILD_TARGETS="kiln kiln_tests_kernels" builds only those targets.
# Prints the build directory on the last line. Fails naming the step that failed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage() { echo "usage: $0 BUNDLE.tar [PREFIX] [-- cmake args]   (bundle from scripts/bundle_deps.sh; docs/gpu.md)" >&2; }
[ $# -ge 1 ] || { usage; exit 2; }
case "$1" in -h|--help) usage; exit 0 ;; esac
[ -f "$1" ] || { echo "[offline] bundle not found: $1" >&2; exit 1; }
BUNDLE="$(realpath "$1")"; shift
PREFIX="${KILN_DEPS_PREFIX:-$HOME/.cache/kiln/deps}"
if [ $# -ge 1 ] && [ "$1" != "--" ]; then PREFIX="$1"; shift; fi
[ $# -ge 1 ] && [ "$1" = "--" ] && shift
PREFIX="$(realpath -m "$PREFIX")"
BUILD="${KILN_BUILD_DIR:-$ROOT/build}"
PY="${KILN_PYTHON:-python3}"

stamp="$PREFIX/.bundle-$(sha256sum "$BUNDLE" | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "[offline] unpacking $BUNDLE into $PREFIX" >&2
  tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
  tar -C "$tmp" -xf "$BUNDLE" || { echo "[offline] $BUNDLE is not a readable tar archive" >&2; exit 1; }
  [ -f "$tmp/MANIFEST" ] || { echo "[offline] $BUNDLE has no MANIFEST: not made by bundle_deps.sh" >&2; exit 1; }
  compgen -G "$tmp/*.deb" >/dev/null || { echo "[offline] $BUNDLE holds no .deb packages" >&2; exit 1; }
  mkdir -p "$PREFIX"
  n=0
  for deb in "$tmp"/*.deb; do
    dpkg-deb -x "$deb" "$PREFIX" || { echo "[offline] cannot unpack $(basename "$deb")" >&2; exit 1; }
    n=$((n + 1))
  done
  # CUTLASS's headers (kernels/CMakeLists.txt) from the nvidia-cutlass wheel, when bundled:
  # unpacked beside PREFIX/cutlass, checked, then moved into place (never a partial tree).
  rm -rf "$PREFIX/cutlass" "$PREFIX/cutlass.partial"
  whls=("$tmp"/nvidia_cutlass-*.whl)
  if [ -f "${whls[0]}" ]; then
    whl="${whls[0]}"
    python3 -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [z.extract(n, sys.argv[2]) for n in z.namelist() if n.startswith('cutlass_library/source/include/')]" \
      "$whl" "$PREFIX/cutlass.partial" || { rm -rf "$PREFIX/cutlass.partial"; echo "[offline] cannot unpack $(basename "$whl")" >&2; exit 1; }
    [ -f "$PREFIX/cutlass.partial/cutlass_library/source/include/cutlass/cutlass.h" ] ||
      { rm -rf "$PREFIX/cutlass.partial"; echo "[offline] $(basename "$whl") holds no CUTLASS headers (cutlass_library/source/include/cutlass/cutlass.h)" >&2; exit 1; }
    mv "$PREFIX/cutlass.partial" "$PREFIX/cutlass"
    echo "[offline] unpacked CUTLASS's headers from $(basename "$whl")" >&2
  else
    echo "[offline] the bundle has no nvidia-cutlass wheel: kiln builds without its grouped GEMM (the experts run at::_grouped_mm)" >&2
  fi
  touch "$stamp"
  echo "[offline] unpacked $n packages" >&2
fi
LIBDIR="$PREFIX/usr/lib/$(gcc -dumpmachine 2>/dev/null || echo x86_64-linux-gnu)"
cat >"$PREFIX/env.sh" <<ENV
# Source before running kiln built by scripts/offline_build.sh: the bundled shared libraries.
export LD_LIBRARY_PATH="$LIBDIR\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
ENV

TORCH_PREFIX="$("$PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')" ||
  { echo "[offline] $PY cannot import torch: set KILN_PYTHON to the python that has LibTorch" >&2; exit 1; }
GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
CUTLASS_ARGS=(); [ -f "$PREFIX/cutlass/cutlass_library/source/include/cutlass/cutlass.h" ] &&
  CUTLASS_ARGS=(-DKILN_CUTLASS_DIR="$PREFIX/cutlass/cutlass_library/source/include")
echo "[offline] configuring $BUILD (torch: $TORCH_PREFIX)" >&2
# CMAKE_FIND_ROOT_PATH is left alone: the prefix is searched like /usr through CMAKE_PREFIX_PATH.
cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE="${KILN_BUILD_TYPE:-Release}" \
  -DCMAKE_PREFIX_PATH="$PREFIX/usr;$TORCH_PREFIX" -DCMAKE_INCLUDE_PATH="$PREFIX/usr/include" \
  -DCMAKE_LIBRARY_PATH="$LIBDIR" -DKILN_PYTHON="$PY" "${CUTLASS_ARGS[@]}" "$@" >&2
# KILN_BUILD_TARGETS="a b": build only these targets (default: everything).
targets=(); for t in ${KILN_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
# The build runs test executables too (doctest's test discovery): they need the same libraries.
# shellcheck source=/dev/null
source "$PREFIX/env.sh"
cmake --build "$BUILD" -j"$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)" "${targets[@]}" >&2
echo "$BUILD"

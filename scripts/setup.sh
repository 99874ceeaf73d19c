#!/usr/bin/env bash
# Installs what kiln needs on a Debian 12 machine when it is missing, and prints nothing
# else on success but the LibTorch CMake prefix path (last line of stdout).
#  - Debian packages (apt-get, needs root or sudo)
#  - a Python virtual environment with torch==2.11.0 (+ pyzmq, msgpack, numpy for the
#    interop tests, tensorboard to read the runs' event files in a test, openai to talk to
#    kiln serve's OpenAI-compatible endpoints in a test, transformers to load kiln's HF exports
#    and make checkpoints in tests, on the CPU) in
#    ${KILN_CACHE:-~/.cache/kiln}/venv, outside the checkout, so that every clone on this
#    machine reuses it.
set -euo pipefail

KILN_CACHE="${KILN_CACHE:-$HOME/.cache/kiln}"
VENV="$KILN_CACHE/venv"
TORCH_VERSION="2.11.0"
TRANSFORMERS_VERSION="5.17.0"  # the GPU machine's, which made the fixtures
CUTLASS_VERSION="4.2.0.0"  # nvidia-cutlass: CUTLASS 4.2 C++ headers
DEB_PACKAGES=(build-essential cmake ninja-build ccache pkg-config git python3 python3-venv
  libcaf-dev libzmq3-dev cppzmq-dev libmsgpack-cxx-dev libspdlog-dev doctest-dev
  libtomlplusplus-dev libcli11-dev nlohmann-json3-dev zlib1g-dev gnuplot-nox libgloo-dev libpcre2-dev libcpp-httplib-dev)

log() { echo "[setup] $*" >&2; }

missing=()
for p in "${DEB_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq >&2
  # Only what is missing, without recommended extras; nothing already installed is upgraded.
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends --no-upgrade "${missing[@]}" >&2
fi

# python3 -m venv needs ensurepip; pyenv's python has it, Debian's needs python3-venv.
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  mkdir -p "$KILN_CACHE"
  python3 -m venv "$VENV" >&2
fi
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
  log "installing torch==$TORCH_VERSION into $VENV (a few GiB, once per machine)"
  "$VENV/bin/pip" install -q "torch==$TORCH_VERSION" >&2
fi
"$VENV/bin/python" -c "import zmq, msgpack, numpy" 2>/dev/null || \
  "$VENV/bin/pip" install -q pyzmq msgpack numpy >&2
"$VENV/bin/python" -c "import tensorboard" 2>/dev/null || "$VENV/bin/pip" install -q tensorboard >&2
"$VENV/bin/python" -c "import openai" 2>/dev/null || "$VENV/bin/pip" install -q openai >&2
"$VENV/bin/python" -c "import sys, transformers; sys.exit(transformers.__version__ != '$TRANSFORMERS_VERSION')" 2>/dev/null ||
  "$VENV/bin/pip" install -q "transformers==$TRANSFORMERS_VERSION" >&2
# CUTLASS's C++ headers (the wheel carries them) for kiln's grouped GEMM (kernels/CMakeLists.txt).
"$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('cutlass_library') else 1)" 2>/dev/null || \
  "$VENV/bin/pip" install -q --no-deps "nvidia-cutlass==$CUTLASS_VERSION" >&2  # the headers only

"$VENV/bin/python" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"

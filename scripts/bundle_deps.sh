#!/usr/bin/env bash
# Bundles the Debian packages kiln builds against into one archive, for a GPU node that
# cannot reach a package registry (air-gapped clusters, the H200 lease machine).
#   scripts/bundle_deps.sh [OUT.tar]        default: kiln-deps-<arch>.tar in the current dir
# Run it on a Debian 12 machine with apt access (no root needed: apt-get download). The
# archive holds the .deb files of the packages below and their dependency closure, minus the
# C/C++ runtime and toolchain the node brings itself (libc, libstdc++, gcc), plus a MANIFEST.
# scripts/offline_build.sh unpacks it into a prefix and builds kiln. docs/gpu.md says more.
set -euo pipefail
OUT="$(realpath -m "${1:-kiln-deps-$(dpkg --print-architecture).tar}")"
# What kiln links or includes (scripts/setup.sh's list without the toolchain and python).
PACKAGES=(libcaf-dev libzmq3-dev cppzmq-dev libmsgpack-cxx-dev libspdlog-dev doctest-dev
  libtomlplusplus-dev libcli11-dev nlohmann-json3-dev zlib1g-dev libgloo-dev libpcre2-dev libcpp-httplib-dev)
# The node's own C/C++ runtime and compiler are used; never ship Debian's copies of them.
SKIP='^(libc6|libc6-dev|libc-dev-bin|linux-libc-dev|libcrypt1|libcrypt-dev|gcc-[0-9]+-base|libgcc-s1|libgcc-[0-9]+-dev|libstdc\+\+6|libstdc\+\+-[0-9]+-dev|libasan[0-9]+|libtsan[0-9]+|liblsan[0-9]+|libubsan[0-9]+|libatomic1|libgomp1|libitm1|libquadmath0|rpcsvc-proto)$'
# Headers and archives for linking the libraries above statically: kiln links them shared.
# (Boost's headers stay: Debian's msgpack CMake config asks for Boost even with MSGPACK_NO_BOOST.)
SKIP_STATIC='^(catch2|icu-devtools|libicu-dev|libxml2-dev|krb5-multidev|libkrb5-dev|comerr-dev|libnsl-dev|libtirpc-dev|libbsd-dev|libmd-dev|libpgm-dev|libnorm-dev|libsodium-dev)$'

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mapfile -t closure < <(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts \
  --no-breaks --no-replaces --no-enhances "${PACKAGES[@]}" | grep -E '^[a-z0-9]' | sort -u | grep -Ev "$SKIP" | grep -Ev "$SKIP_STATIC")
echo "[bundle] ${#closure[@]} packages: ${closure[*]}" >&2
(cd "$work" && apt-get download -q "${closure[@]}" >&2)
# CUTLASS's C++ headers for kiln's grouped GEMM: the nvidia-cutlass wheel (a zip; offline_build.sh
# unpacks its include directory). Skipped, with a note, where PyPI cannot be reached.
CUTLASS_WHEEL="nvidia-cutlass==$(sed -n 's/^CUTLASS_VERSION="\([^"]*\)".*/\1/p' "$(dirname "${BASH_SOURCE[0]}")/setup.sh")"
(cd "$work" && python3 -m pip download -q --no-deps --only-binary=:all: "$CUTLASS_WHEEL" >&2) ||
  echo "[bundle] could not download $CUTLASS_WHEEL: the bundle builds kiln without its grouped GEMM" >&2
{
  echo "kiln dependency bundle, made $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME") ($(dpkg --print-architecture))"
  echo "requested: ${PACKAGES[*]}"
  (cd "$work" && ls -1 ./*.deb ./*.whl 2>/dev/null | sed 's|^\./||')
} >"$work/MANIFEST"
tar -C "$work" -cf "$OUT" MANIFEST $(cd "$work" && ls ./*.deb ./*.whl 2>/dev/null)
echo "[bundle] wrote $OUT ($(du -h "$OUT" | cut -f1))" >&2
echo "$OUT"

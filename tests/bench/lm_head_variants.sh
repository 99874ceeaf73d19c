#!/usr/bin/env bash
# The fused log-prob head's GEMM in variants beside cuBLAS (tests/bench/lm_head_variants.cu says
# which and what each prints).
#   tests/bench/lm_head_variants.sh build DIR [CUTLASS_INCLUDE]   compile every variant into DIR
#                                      (sm_90a; nvcc, CUTLASS's headers: the nvidia-cutlass wheel's
#                                      cutlass_library/source/include; any machine with nvcc)
#   (VARIANTS="a b ..." in the environment: build or run only those)
#   tests/bench/lm_head_variants.sh run DIR [T ...]   on a Hopper GPU: each variant twice, in turn
#                                      (default T: 1024 8192), then ncu's sections of the GEMM of
#                                      `two`, `stats` and `plain` at T 1024 (where ncu reads counters)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
mode=${1:?build or run}
dir=${2:?output directory}
gemms=(stats stats_pong stats_c21 plain one two two_nooob two_epi64 two_c21 two_c11 plain_c21 plain_pong plain_pong64 stats_pong64 stats_256)
case "$mode" in
build)
  inc=${3:-$("${KILN_PYTHON:-$HOME/.cache/kiln/venv/bin/python}" -c "import importlib.util as u, os; s = u.find_spec('cutlass_library'); print(os.path.join(list(s.submodule_search_locations)[0], 'source', 'include'))")}
  mkdir -p "$dir"
  jobs=${JOBS:-$(nproc)}
  {
    for v in "${gemms[@]}"; do echo "$v -DKILN_VARIANT_GEMM"; done
    echo "cublas16"; echo "cublas32"; echo "kiln -DKILN_VARIANT_KILN kernels/lm_head_sm90.cu kernels/lm_head_sm90_pingpong.cu"
  } | { if [ -n "${VARIANTS:-}" ]; then grep -E "^($(tr ' ' '|' <<< "$VARIANTS"))( |$)"; else cat; fi; } | KILN_DIR="$dir" KILN_INC="$inc" xargs -P "$jobs" -L 1 bash -c 'v=$0; nvcc -std=c++17 -O3 \
        -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -DNDEBUG -Xcudafe=--diag_suppress=177 \
        -I. -isystem "$KILN_INC" -DKILN_VARIANT="$v" "$@" tests/bench/lm_head_variants.cu -lcublas \
        -o "$KILN_DIR/$v" && echo "built $v"'
  ;;
run)
  shift 2
  Ts=("$@")
  [ ${#Ts[@]} -gt 0 ] || Ts=(1024 8192)
  # VARIANTS="a b ...": only these (default: all)
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader || true
  all=(cublas16 cublas32 kiln "${gemms[@]}")
  [ -z "${VARIANTS:-}" ] || read -r -a all <<< "$VARIANTS"
  for pass in 1 2; do
    echo "# pass $pass"
    for v in "${all[@]}"; do "$dir/$v" "${Ts[@]}" || echo "$v failed: $?"; done
  done
  if command -v ncu >/dev/null; then
    for v in two stats plain; do
      echo "# ncu: $v, T 1024"
      ncu --clock-control none -k regex:device_kernel -c 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section WarpStateStats --section InstructionStats --section LaunchStats --section Occupancy \
        "$dir/$v" 1024 2>&1 | grep -v '^==PROF==' || echo "ncu of $v failed"
    done
  fi
  ;;
*) echo "mode: build or run" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# GLM-4.7-Flash, the full RL step on one node (issue 17): one command.
#
#   experiments/run_node.sh GPUS LAYERS [separate|colocated] [--set key=value ...]
#     GPUS       trainer ranks, one per GPU: 2, 4 or 8 (the 64 routed experts split over them)
#     LAYERS     decoder layers of GLM-4.7-Flash kept (1..47; 47 = the whole model), or "debug":
#                the tiny debug size on the CPU (Gloo instead of NCCL; what the ctest runs)
#     separate   (default) the engine in its own process on GPU 1 fed by the collective weight
#                sync; the reference in rank 0's process (2 GPUs) or its own on GPU 2
#     colocated  an engine and a frozen reference in every trainer rank, over the rank's own
#                weights and experts (placement.mode / placement.reference = "colocated",
#                docs/parallel.md): what fits the whole model on 8 GPUs
#
# 1. Makes the checkpoint when it is missing: tests/fixtures/make_glm47_flash_checkpoint.py
#    (transformers, random weights, save_pretrained) into $KILN_NODE_CHECKPOINTS/glm47_flash_<LAYERS>l
#    (default checkpoints/ in the repository).
# 2. Runs experiments/glm47_flash_node.toml with kiln run (which starts the GPUS trainer ranks,
#    the engine and, with more than 2 GPUs, the reference node itself) into
#    $KILN_NODE_RUNS/glm47_flash_node_<GPUS>gpu_<LAYERS>l[_colocated] (default runs/), replacing
#    an earlier run there; on a GPU machine, nvidia-smi samples every GPU's used memory meanwhile.
# 3. Prints the summary (experiments/summarize_node_run.py): train tokens/s, the step's time split,
#    update_weights_time, the train/rollout log-prob difference, peak memory per rank and per GPU.
#
# Environment: KILN_BIN (default build/experiments/kiln, or $KILN_BUILD_DIR/experiments/kiln),
# KILN_PYTHON (python with transformers for step 1; default python3), KILN_NODE_CHECKPOINTS,
# KILN_NODE_RUNS. Extra arguments go to kiln run (e.g. --set run.steps=8).
# Exit status: kiln run's (2: bad arguments), or the checkpoint maker's when it fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage() { echo "usage: experiments/run_node.sh GPUS(2|4|8) LAYERS(1..47|debug) [separate|colocated] [--set key=value ...]" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
GPUS="$1" LAYERS="$2"
shift 2
PLACEMENT=separate
if [[ $# -ge 1 && "$1" != --* ]]; then
  PLACEMENT="$1"
  shift
fi
[[ "$PLACEMENT" =~ ^(separate|colocated)$ ]] || { echo "run_node.sh: the placement must be separate or colocated, got '$PLACEMENT'" >&2; usage; }
[[ $# -eq 0 || "$1" == --* ]] || { echo "run_node.sh: unexpected argument '$1' (after GPUS LAYERS [PLACEMENT] only --set key=value)" >&2; usage; }
[[ "$GPUS" =~ ^(2|4|8)$ ]] || { echo "run_node.sh: GPUS must be 2, 4 or 8 (64 experts split evenly), got '$GPUS'" >&2; usage; }
if [[ "$LAYERS" != debug ]] && ! { [[ "$LAYERS" =~ ^[1-9][0-9]?$ ]] && ((LAYERS <= 47)); }; then
  echo "run_node.sh: LAYERS must be 1..47 or debug, got '$LAYERS'" >&2
  usage
fi
KILN="${KILN_BIN:-$ROOT/${KILN_BUILD_DIR:-build}/experiments/kiln}"
[[ "$KILN" = /* ]] || KILN="$ROOT/$KILN"
[[ -x "$KILN" ]] || { echo "run_node.sh: no kiln executable at $KILN (build it: scripts/build.sh, or set KILN_BIN)" >&2; exit 2; }
PY="${KILN_PYTHON:-python3}"
CKPT="${KILN_NODE_CHECKPOINTS:-$ROOT/checkpoints}/glm47_flash_${LAYERS}l"
SUFFIX=""
if [[ "$PLACEMENT" == colocated ]]; then SUFFIX=_colocated; fi
OUT="${KILN_NODE_RUNS:-$ROOT/runs}/glm47_flash_node_${GPUS}gpu_${LAYERS}l${SUFFIX}"

size=()
if [[ "$LAYERS" == debug ]]; then
  make_args=(--debug)
  # The same program at the debug size on CPU ranks (Gloo), small enough for CI.
  size=(--set model.device=cpu --set model.dtype=fp32
        --set algorithm.prompts_per_step=4 --set algorithm.samples_per_prompt=4 --set algorithm.max_new_tokens=8
        --set algorithm.max_tokens_per_microbatch=64 --set rollout.cache_blocks=256 --set run.steps=3)
else
  make_args=(--layers "$LAYERS")
fi
if [[ ! -f "$CKPT/config.json" ]]; then
  echo "run_node.sh: making the checkpoint $CKPT" >&2
  mkdir -p "$(dirname "$CKPT")"
  rm -rf "$CKPT.partial"
  "$PY" "$ROOT/tests/fixtures/make_glm47_flash_checkpoint.py" "$CKPT.partial" "${make_args[@]}"
  mv "$CKPT.partial" "$CKPT"
fi

# Where the engine and the reference go. separate: the engine in a process of its own on GPU 1
# (the CPU for debug), fed by NCCL broadcast from rank 0; the reference with 2 GPUs in rank 0's
# process (GPU 0), with more in a process of its own on GPU 2, so that no GPU holds two whole
# models besides a trainer rank. colocated: both in every trainer rank, over its own weights.
if [[ "$PLACEMENT" == colocated ]]; then
  place=(--set placement.mode=colocated --set placement.reference=colocated)
else
  place=(--set placement.mode=multi_process --set weight_sync.transport=collective
         --set placement.rollout_device="$([[ $LAYERS == debug ]] && echo cpu || echo cuda:1)")
  if [[ "$LAYERS" != debug && "$GPUS" -gt 2 ]]; then
    place+=(--set placement.reference=process --set placement.reference_device=cuda:2)
  fi
fi

mkdir -p "$OUT"
sampler=""
if [[ "$LAYERS" != debug ]] && command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/gpu_memory.csv" &
  sampler=$!
fi
rc=0
"$KILN" run "$ROOT/experiments/glm47_flash_node.toml" \
  --set model.checkpoint="$CKPT" --set parallel.ep="$GPUS" --set run.output_dir="$OUT" --set run.overwrite=true \
  "${size[@]}" "${place[@]}" "$@" || rc=$?
[[ -n "$sampler" ]] && kill "$sampler" 2> /dev/null && wait "$sampler" 2> /dev/null || true
if [[ $rc -ne 0 ]]; then
  echo "run_node.sh: kiln run exited $rc (run directory $OUT)" >&2
  exit $rc
fi
python3 "$ROOT/experiments/summarize_node_run.py" "$OUT"

#pragma once
// `kiln bench parallel`: the data-parallel trainer on CUDA GPUs (NCCL) against one GPU, in one
// run, on GLM-4.7-Flash dimensions with `layers` decoder layers (the first dense), bf16 policy,
// fp32 master weights + AdamW. Launched with one process per GPU (torchrun / srun; e.g.
// `torchrun --nproc-per-node 2 --no-python kiln bench parallel`). Every rank measures, on its
// own GPU at the same time:
//  - one GPU: a full trainer step (trainer::Trainer, no group) on `tokens` tokens of packed
//    samples: tokens/s and peak allocated memory;
//  - data parallel over all ranks: a full trainer step (Trainer over the world group: gradients
//    reduce-scattered and AdamW state sharded over the ranks, parameters all-gathered) on
//    world x `tokens` tokens, so each GPU trains `tokens`: tokens/s per GPU, its ratio to the
//    one-GPU figure, peak allocated memory.
//  - expert parallel over `ep` ranks (0: all of them; a mesh dp x ep with dp = world / ep, the
//    dense weights data-parallel over every rank, as `kiln run --set parallel.ep=...` trains):
//    the same step, samples and figures as data parallel;
//  - collective weight sync (weight_sync/collective.hpp): rank 0's policy broadcast over NCCL to
//    ranks 1.. (each holding an engine's copy of the model on its GPU, receiving through
//    CollectiveReceiver as a rollout node does), checksums on: GB/s against a plain copy of the
//    same bytes from GPU 0 to GPU 1 in the same run.
// Rank 0 prints a table (each rank's figures) and with json_path writes them as JSON.
#include <cstdint>
#include <string>

namespace kiln::experiments {

struct ParallelBenchOptions {
  int64_t layers = 4;
  int64_t tokens = 8192;  ///< trained per GPU per step
  int64_t docs = 8;       ///< samples per GPU per step (prompt: half of each, completion: the rest)
  int steps = 5, warmup = 2;
  int64_t ep = 0;          ///< expert-parallel ranks (0: the world size; 1: no EP measurement)
  /// The data- and expert-parallel trainers with their decoder layers fully sharded
  /// (parallel.fsdp: trainer::FullyShardedLayers); the one-GPU trainer as it is.
  bool fsdp = false;
  bool reshard_after_forward = true;  ///< with fsdp (FullyShardedLayers)
  std::string reduce_dtype = "fp32";  ///< the dp and ep trainers' gradient reduction (parallel.reduce_dtype)
  double bucket_mib = 512;  ///< collective weight sync bucket size
  std::string json_path;
};

int run_parallel_bench(const ParallelBenchOptions& options);

}  // namespace kiln::experiments

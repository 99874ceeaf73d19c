#pragma once
// `kiln bench rollout`: decode tokens/s and time-to-first-token of the in-process engine
// (paged latent cache, continuous batching) for several batch sizes on a glm4_moe_lite
// flavor, beside a no-cache baseline (every step re-runs the packed forward over all live
// sequences) measured in the same run on the same requests.
//
// `--device cuda`: GLM-4.7-Flash dimensions with `--layers` decoder layers, bf16, random
// weights; for each context (prompt length) and batch size, the engine's decode step time
// (median over steps in which every sequence decodes one token) with the cache expanded
// through kv_b (the training kernels), with absorbed (latent-space) decode and with absorbed
// decode replayed as CUDA graphs (rollout.cuda_graphs), each with or without the paged-cache
// attention kernel (rollout.mla_decode_kernel; `--modes` picks the columns), against the
// roofline of the same step: bytes of weights read (lm_head, attention, dense MLP, shared
// experts, and the routed experts a batch of that size touches: E * (1 - (1 - K/E)^B) of E,
// uniform routing) plus the latent cache read, over the device-to-device copy rate measured in
// the same run.
//
// Both devices then time a GRPO group (8 samples of one 2048-token prompt) with
// rollout.share_prompts off and on: prompt tokens prefilled, time to first token, the group's
// wall time, and whether the samples are the same tokens.
#include <cstdint>
#include <string>
#include <vector>

namespace kiln::experiments {

struct RolloutBenchOptions {
  std::vector<int64_t> batch_sizes = {1, 8, 32, 64};
  int64_t prompt_tokens = 16;
  int64_t new_tokens = 32;
  std::string flavor = "debug";
  std::string device = "cpu";                    ///< "cpu" or "cuda"
  int64_t layers = 4;                            ///< cuda: decoder layers at GLM-4.7-Flash dims
  std::vector<int64_t> contexts = {1024, 8192};  ///< cuda: prompt lengths
  /// cuda: the engine's decode modes, columns in this order: "expanded" (the default engine),
  /// "absorbed" (rollout.absorbed_decode), "graphs" (absorbed with rollout.cuda_graphs),
  /// "kernel" and "graphs-kernel" (absorbed, eager or graphed, with rollout.mla_decode_kernel:
  /// the paged-cache attention kernel); these five with rollout.sampling_kernel and
  /// rollout.moe_decode_kernel off (as they were measured before those existed); then
  /// "graphs-sampling", "graphs-experts" and "graphs-all": graphs-kernel with the sampling kernel
  /// (in the graph), the decode experts kernels, or both; these three with
  /// rollout.overlap_schedule off; "graphs-overlap": graphs-sampling with it on (the engine's
  /// default: step n + 1 queued before step n's tokens are read), "graphs-overlap-all":
  /// graphs-all with it on. The speedup column is the first mode's step time over the last's.
  std::vector<std::string> modes = {"expanded", "absorbed", "graphs"};
  /// cuda: instead of the table, where a graphed decode step's time goes, per (context, batch):
  /// the engine's step (graphs-kernel, and graphs-all) against the parts it is made of, each
  /// timed alone on the same shapes (host clock around a synchronised call): the graph's run
  /// (input copy and replay), the reference sampling of its [B, V] logits, the routed experts'
  /// copy to the host, the rest (the engine's host work); then the run of a graph that samples
  /// too, and of one with the decode experts kernels as well, each with its [B, 3] read.
  bool split = false;
  /// With split: per shape one replay of the graph before the kernels, then one of the graph with
  /// both, between cudaProfilerStart and cudaProfilerStop, and no other timing (for
  /// `ncu --profile-from-start off`: the graphs' kernels one by one).
  bool split_profile = false;
};

int run_rollout_bench(const RolloutBenchOptions& options);

}  // namespace kiln::experiments

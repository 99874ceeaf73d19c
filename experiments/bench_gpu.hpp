#pragma once
// `kiln bench gpu`: kiln's training path on one CUDA GPU, on GLM-4.7-Flash dimensions with
// `layers` decoder layers (the first dense), in bf16, in one run:
//  - the machine's limits, measured: bf16 GEMM TFLOP/s (8192^3) and device-to-device copy GB/s;
//  - with balance_routing: the routers' biases first balanced on the pack, as training balances
//    them (the experts' grouped GEMMs run faster on even counts; the peer is balanced alike);
//  - forward+backward over one packed micro-batch (`docs` documents, `tokens` in all): train
//    tokens/s, MFU against the measured GEMM rate, peak allocated memory;
//  - with activation_checkpointing: the same forward+backward with checkpointing per layer
//    (tokens/s, MFU on the model's FLOPs, peak memory: the speed/memory trade);
//  - a full trainer step (bf16 policy, fp32 master weights + AdamW) on the same tokens;
//  - log_probs_time: the no-grad forward + per-token log-probs of the same micro-batch;
//  - update_weights_time: device-to-device weight sync into a rollout engine's model, with and
//    without the post-copy check, and a plain copy of the same bytes;
//  - train/rollout log-prob abs diff: completions sampled by the CUDA rollout engine, their
//    behaviour log-probs against the trainer's packed forward (routing replay on);
//  - with true_on_policy: the forward+backward (train tokens/s) and the rollout (generated
//    tokens/s) again with the batch-invariant kernels on both sides (algorithm.true_on_policy),
//    and that mode's train/rollout log-prob abs diff (0 expected), beside the default's.
// With profile: only the forward+backward, then one more between cudaProfilerStart and
// cudaProfilerStop (for `ncu --profile-from-start off`), and nothing else. With trace_path: only
// the forward+backward, then trace_steps more under LibTorch's Kineto profiler (CPU ops and CUDA
// kernels), written there as a Chrome trace (tests/bench/trace_gaps.py reads where the GPU
// waits for the host), and nothing else.
// Prints a table, and with json_path writes every number as JSON (used by
// experiments/bench_gpu_vs_transformers.py, which runs transformers on the same shapes).
// Also writes the model's HF config.json to config_dir when set.
#include <cstdint>
#include <string>

namespace kiln::experiments {

struct GpuBenchOptions {
  int64_t layers = 4;
  int64_t tokens = 8192, docs = 8;
  int steps = 5, warmup = 2;
  double bucket_mib = 512;
  int64_t rollout_prompts = 32, rollout_prompt_tokens = 256, rollout_new_tokens = 32;
  bool absorbed_decode = false;  ///< the engine's rollout.absorbed_decode
  bool activation_checkpointing = false;  ///< also forward+backward with checkpointing per layer
  int64_t checkpoint_layers = 0;  ///< with activation_checkpointing: the first N layers only (0: all)
  double keep_logits_gib = 4.0;  ///< the trainer's algorithm.keep_logits_gib, in every forward+backward timed
  /// The trainer step's algorithm.max_tokens_per_microbatch (0: tokens, one micro-batch): with
  /// less, the step runs several micro-batches, as an RL step does
  int64_t trainer_microbatch_tokens = 0;
  bool true_on_policy = false;  ///< also train and rollout in the true on-policy mode (docs/gpu.md)
  bool profile = false;  ///< after timing forward+backward, run one more inside cudaProfilerStart/Stop and stop there
  /// Stop after timing forward+backward: print and write (json_path) the limits, that and the
  /// expert loads only (tests/bench/bench_vs_torchtitan.py: the peer's benchmark times no more)
  bool forward_backward_only = false;
  /// Rounds of the auxiliary-loss-free balancing update on the pack before anything is timed (0:
  /// the random model's own routing). Each round: a no-grad forward, then every MoE router's
  /// e_score_correction_bias [E] fp32 += 1e-3 * sign(mean load - load), centred (DeepSeek-V3,
  /// arXiv:2412.19437 section 2.1.2, at its rate; torchtitan's _update_expert_bias, which
  /// tests/bench/bench_torchtitan_ac.py --balance-routing applies to the peer the same way)
  int balance_routing = 0;
  /// The pack's token ids and positions put on the GPU once, before anything is timed, as the
  /// peer's benchmark holds its tokens (tests/bench/bench_torchtitan_ac.py); else each timed
  /// forward uploads them from the host, as the trainer's steps do (cu_seqlens stays on the host
  /// either way: PackedBatch's contract)
  bool batch_on_device = false;
  std::string json_path, config_dir;
  std::string trace_path;  ///< after timing forward+backward, write trace_steps more's Kineto trace here and stop
  /// Forward+backwards in the trace (trace_path), each as the timing runs it (the step, then a
  /// device synchronize) inside a host op "kiln bench gpu: step I" (I from 1): the first carries
  /// the profiler's start-up, the later ones are the timed loop's steady state.
  int trace_steps = 1;
};

int run_gpu_bench(const GpuBenchOptions& options);

}  // namespace kiln::experiments

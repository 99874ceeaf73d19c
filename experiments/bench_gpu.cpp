#include "experiments/bench_gpu.hpp"
#include "messaging/stopwatch.hpp"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#ifdef KILN_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_profiler_api.h>
#endif

#include "actors/rollout/engine.hpp"
#include "actors/trainer/fused_adamw.hpp"
#include "actors/trainer/trainer.hpp"
#include "actors/weight_sync/device_sync.hpp"
#include "kernels/adamw.hpp"
#include "experiments/bench_cuda.hpp"
#include "experiments/bench_model.hpp"
#include "experiments/bench_routing.hpp"
#include "model/blocks/logprobs.hpp"
#include "model/glm4_moe_lite/model.hpp"
#include "model/registry.hpp"

namespace kiln::experiments {

namespace {
// |a - b| over per-sample log-prob lists of the same lengths: sum, max, count, and the sum over
// each sample's first token (sampled from the prefill step, large GEMMs like training's).
struct Gap {
  double sum = 0, max = 0, first_sum = 0;
  int64_t n = 0;
};

Gap logprob_gap(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  Gap g;
  for (std::size_t i = 0; i < a.size(); ++i)
    for (std::size_t j = 0; j < a[i].size(); ++j) {
      const double d = std::abs(double(a[i][j]) - double(b[i][j]));
      g.sum += d;
      g.max = std::max(g.max, d);
      ++g.n;
      if (j == 0) g.first_sum += d;
    }
  return g;
}
}  // namespace

namespace {
using Model = model::glm4_moe_lite::Glm4MoeLiteModel;

// One run of the benchmark: its phases in the order run_gpu_bench calls them, each writing its
// numbers into J (the JSON and the printed table read them from there).
class GpuBench {
 public:
  explicit GpuBench(const GpuBenchOptions& o)
      : o_(o),
        dev_(torch::kCUDA, 0),
        bf16_(torch::TensorOptions().device(dev_).dtype(torch::kBFloat16)),
        cfg_(model::glm4_moe_lite::flavors::glm47_flash_layers(o.layers)) {
    trainer::TrainerConfig budget;  // the kept-logits budget in bytes, as the trainer sets it
    budget.keep_logits_gib = o.keep_logits_gib;
    kept_logits_bytes_ = budget.keep_logits_bytes();
  }

  // 1. The machine's limits: a large bf16 GEMM's rate and a 2 GiB device copy's.
  void measure_limits() {
    auto a = torch::randn({8192, 8192}, bf16_), b = torch::randn({8192, 8192}, bf16_);
    double s = median_seconds(3, 10, [&] { (void)torch::mm(a, b); });
    J["gemm_bf16_tflops"] = 2.0 * 8192.0 * 8192.0 * 8192.0 / s / 1e12;
    auto src = torch::randn({int64_t(1) << 30}, bf16_), dst = torch::empty_like(src);  // 2 GiB
    s = median_seconds(3, 10, [&] { dst.copy_(src); });
    J["copy_read_write_gbs"] = 2.0 * double(src.numel()) * 2 / s / 1e9;  // read + write
  }

  // 2. The policy on the GPU in bf16 and its micro-batch (the model's HF config.json written to
  // config_dir when set).
  void build_policy() {
    if (!o_.config_dir.empty()) {
      std::filesystem::create_directories(o_.config_dir);
      std::ofstream(std::filesystem::path(o_.config_dir) / "config.json") << cfg_.to_hf_json().dump(2) << "\n";
    }
    policy_ = build_model();
    policy_->set_kept_logits_bytes(kept_logits_bytes_);
    J["keep_logits_gib"] = o_.keep_logits_gib;
    batch_ = random_packed_documents(o_.tokens, o_.docs, cfg_.vocab_size);
    targets_ = model::next_token_targets(batch_.input_ids, batch_.cu_seqlens).to(dev_);
    flops_ = 3.0 * glm4_forward_flops(cfg_, o_.docs, o_.tokens / o_.docs);
    J["batch_on_device"] = o_.batch_on_device;
    if (o_.batch_on_device) {  // GpuBenchOptions::batch_on_device: what forward_backward() reads
      device_batch_ = batch_;
      device_batch_.input_ids = batch_.input_ids.to(dev_);
      device_batch_.position_ids = batch_.position_ids.to(dev_);
    }
  }

  // Forward + backward of the micro-batch (the comparison with transformers: same tokens, same
  // loss): tokens/s, MFU against the measured GEMM rate, peak memory.
  void time_training() {
    reset_peak();
    fb_ = median_seconds(o_.warmup, o_.steps, [&] { forward_backward(); });
    J["train_tokens_per_s"] = double(o_.tokens) / fb_;
    J["train_step_s"] = fb_;
    J["mfu"] = flops_ / fb_ / (J["gemm_bf16_tflops"].get<double>() * 1e12);
    J["peak_memory_gib"] = peak_gib();
    J["model_tflop_per_step"] = flops_ / 1e12;
    policy_->zero_grad();
    // How evenly the model routes the pack: the routed experts' GEMMs slow down with uneven
    // counts. Summed over the MoE layers (as torchtitan's bench prints it), and per layer.
    const auto loads = expert_loads(*policy_, batch_);  // [L, E]
    const auto summed = loads.sum(0);
    J["expert_load_max_over_mean"] = (summed.max() / summed.mean()).item<double>();
    J["expert_load_max_over_mean_per_layer"] = per_layer_max_over_mean(loads);
  }

  // --balance-routing N: N rounds of the auxiliary-loss-free balancing update on the pack
  // (GpuBenchOptions::balance_routing), before anything is timed.
  void balance_routing() {
    if (o_.balance_routing <= 0) return;
    const auto before = experiments::balance_routing(*policy_, batch_, o_.balance_routing);
    J["balance_routing_rounds"] = o_.balance_routing;
    J["expert_load_max_over_mean_per_layer_before_balancing"] = per_layer_max_over_mean(before);
  }

  // --profile: one more forward+backward inside cudaProfilerStart/Stop (ncu --profile-from-start off).
  void profile_one() {
#ifdef KILN_CUDA
    torch::cuda::synchronize();
    cudaProfilerStart();
    forward_backward();
    torch::cuda::synchronize();
    cudaProfilerStop();
#endif
    std::printf("kiln bench gpu --profile: %lld layers, %lld tokens in %lld documents: forward+backward %.4f s "
                "(median, unprofiled), %.0f tokens/s; profiled one more\n",
                (long long)o_.layers, (long long)o_.tokens, (long long)o_.docs, fb_, double(o_.tokens) / fb_);
  }

  // --trace: --trace-steps more forward+backwards under Kineto, as a Chrome trace (with
  // --activation-checkpointing: the checkpointed step, warmed up once).
  void trace_one() {
    policy_->set_activation_checkpointing(o_.activation_checkpointing, o_.checkpoint_layers);
    if (o_.activation_checkpointing) forward_backward();
    namespace prof = torch::autograd::profiler;
    using torch::profiler::impl::ActivityType;
    const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
    const std::set<ActivityType> activities{ActivityType::CPU, ActivityType::CUDA};
    torch::cuda::synchronize();
    prof::prepareProfiler(config, activities);
    prof::enableProfiler(config, activities);
    for (int i = 1; i <= o_.trace_steps; ++i) {  // as median_seconds times a step: the step, then a synchronize
      RECORD_FUNCTION("kiln bench gpu: step " + std::to_string(i), std::vector<c10::IValue>());
      forward_backward();
      torch::cuda::synchronize();
    }
    prof::disableProfiler()->save(o_.trace_path);
    std::printf("kiln bench gpu --trace: %lld layers, %lld tokens in %lld documents: forward+backward %.4f s "
                "(median, untraced), %.0f tokens/s; %d more%s traced into %s\n",
                (long long)o_.layers, (long long)o_.tokens, (long long)o_.docs, fb_, double(o_.tokens) / fb_,
                o_.trace_steps, o_.activation_checkpointing ? " with activation checkpointing" : "", o_.trace_path.c_str());
  }

  // The same with activation checkpointing per layer (algorithm.activation_checkpointing): the
  // speed/memory trade, MFU still counted on the model's 3x forward FLOPs (not the recompute).
  void time_checkpointed() {
    policy_->set_activation_checkpointing(true, o_.checkpoint_layers);
    reset_peak();
    const double s = median_seconds(o_.warmup, o_.steps, [&] { forward_backward(); });
    policy_->set_activation_checkpointing(false);
    policy_->zero_grad();
    J["checkpointed_train_step_s"] = s;
    J["checkpointed_train_tokens_per_s"] = double(o_.tokens) / s;
    J["checkpointed_layers"] = o_.checkpoint_layers > 0 ? o_.checkpoint_layers : o_.layers;
    J["checkpointed_mfu"] = flops_ / s / (J["gemm_bf16_tflops"].get<double>() * 1e12);
    J["checkpointed_peak_memory_gib"] = peak_gib();
  }

  // log_probs_time (no-grad forward + log-probs of the micro-batch) and where a step's time
  // goes: the log-prob head alone, the decoder's no-grad forward, one MoE layer's two halves.
  void time_breakdown() {
    J["log_probs_time_s"] = median_seconds(o_.warmup, o_.steps, [&] {
      torch::NoGradGuard ng;
      auto out = policy_->forward(batch_);
      (void)policy_->token_logprobs(out, targets_, 4096);
    });
    auto h = (0.5 * torch::randn({o_.tokens, cfg_.hidden_size}, bf16_)).requires_grad_();
    auto w = policy_->lm_head_weight().detach().clone().requires_grad_();
    J["logprob_head_fwd_bwd_s"] = median_seconds(o_.warmup, o_.steps, [&] {
      model::token_logprobs(h, w, targets_, 4096, kept_logits_bytes_).sum().backward();
    });
    J["forward_no_grad_s"] = median_seconds(o_.warmup, o_.steps, [&] {
      torch::NoGradGuard ng;
      (void)policy_->forward(batch_);
    });
    auto& layer = policy_->layers.at(1);
    auto x = (0.5 * torch::randn({o_.tokens, cfg_.hidden_size}, bf16_)).requires_grad_();
    auto pos = batch_.position_ids.to(dev_);
    auto cu = batch_.cu_seqlens.to(dev_, torch::kInt32);
    const int64_t n = o_.tokens / o_.docs;
    J["layer_attention_fwd_bwd_s"] = median_seconds(o_.warmup, o_.steps, [&] {
      layer->attn(layer->attn_norm(x), pos, cu, n).sum().backward();
    });
    J["layer_moe_fwd_bwd_s"] = median_seconds(o_.warmup, o_.steps, [&] {
      layer->moe(layer->mlp_norm(x), std::nullopt, nullptr).sum().backward();
    });
    policy_->zero_grad();
  }

  // 3. Rollout on the GPU (an engine over a copy of the policy), and the train/rollout
  // log-prob gap over its completions with two of its parts.
  void rollout_and_gap() {
    engine_model_ = build_model();
    (void)weight_sync::copy_weights_device(*policy_, *engine_model_, uint64_t(o_.bucket_mib * (1 << 20)), true,
                                           policy_->weight_sync_groups(false));
    eo_.max_batch = o_.rollout_prompts;
    eo_.block_size = 16;
    eo_.cache_blocks = o_.rollout_prompts * ((o_.rollout_prompt_tokens + o_.rollout_new_tokens) / 16 + 2);
    eo_.absorbed_decode = o_.absorbed_decode;
    for (int64_t i = 0; i < o_.rollout_prompts; ++i) {
      rollout::GenerationRequest r;
      r.id = uint64_t(i);
      auto p = torch::randint(0, cfg_.vocab_size, {o_.rollout_prompt_tokens}, torch::kInt64);
      r.prompt.assign(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + p.numel());
      r.sampling.temperature = 1.0;
      r.sampling.max_new_tokens = o_.rollout_new_tokens;
      r.sampling.seed = uint64_t(100 + i);
      reqs_.push_back(std::move(r));
    }
    int64_t tokens = 0;
    samples_ = run_rollout(eo_, rollout_s_, tokens);
    J["rollout_time_s"] = rollout_s_;
    J["rollout_tokens_per_s"] = double(tokens) / rollout_s_;
    const Gap gap = gap_of(samples_);
    J["train_rollout_logprob_abs_diff_first_token_mean"] = gap.first_sum / double(std::max<std::size_t>(1, samples_.size()));
    J["train_rollout_logprob_abs_diff_decode_mean"] =
        (gap.sum - gap.first_sum) / double(std::max<int64_t>(1, gap.n - int64_t(samples_.size())));
    J["train_rollout_logprob_abs_diff_mean"] = gap.sum / double(std::max<int64_t>(1, gap.n));
    J["train_rollout_logprob_abs_diff_max"] = gap.max;
    J["train_rollout_tokens"] = gap.n;
    // Two gaps that the train/rollout one contains: the trainer's log-probs at micro-batches of
    // 1024 tokens against o.tokens' (an op whose bits depend on the rows sharing it), and the
    // engine's copy of the weights through the trainer's own path (a weight-sync difference).
    const auto base = trainer::completion_logprobs(*policy_, samples_, o_.tokens, /*routing_replay=*/true);
    auto gap_to_base = [&](const std::vector<std::vector<float>>& other, const char* key) {
      const Gap g = logprob_gap(base, other);
      J[std::string(key) + "_mean"] = g.sum / double(std::max<int64_t>(1, g.n));
      J[std::string(key) + "_max"] = g.max;
    };
    gap_to_base(trainer::completion_logprobs(*policy_, samples_, 1024, true), "trainer_microbatch_1024_logprob_abs_diff");
    gap_to_base(trainer::completion_logprobs(*engine_model_, samples_, o_.tokens, true),
                "engine_weights_trainer_path_logprob_abs_diff");
  }

  // 3b. The true on-policy mode: the same forward+backward and rollout with the batch-invariant
  // kernels on both sides (policy and engine), and that mode's train/rollout diff.
  void true_on_policy() {
    policy_->set_batch_invariant(true);
    const double fb = median_seconds(o_.warmup, o_.steps, [&] { forward_backward(); });
    policy_->zero_grad();
    auto eo = eo_;
    eo.true_on_policy = true;     // the engine turns engine_model's switch on
    eo.absorbed_decode = false;   // the mode runs the expanded decode (the trainer's formula)
    double rollout_s = 0;
    int64_t tokens = 0;
    auto samples = run_rollout(eo, rollout_s, tokens);
    const Gap gap = gap_of(samples);
    policy_->set_batch_invariant(false);
    engine_model_->set_batch_invariant(false);
    J["true_on_policy_train_tokens_per_s"] = double(o_.tokens) / fb;
    J["true_on_policy_train_step_s"] = fb;
    J["true_on_policy_rollout_time_s"] = rollout_s;
    J["true_on_policy_rollout_tokens_per_s"] = double(tokens) / rollout_s;
    J["true_on_policy_train_rollout_logprob_abs_diff_mean"] = gap.sum / double(std::max<int64_t>(1, gap.n));
    J["true_on_policy_train_rollout_logprob_abs_diff_max"] = gap.max;
    J["true_on_policy_train_rollout_tokens"] = gap.n;
  }

  // A full trainer step: bf16 policy, fp32 masters + AdamW, on the rollout's samples repeated
  // up to the micro-batch's tokens.
  void time_trainer_step() {
    trainer::TrainerConfig tc;
    tc.logprobs.max_tokens_per_microbatch = o_.trainer_microbatch_tokens > 0 ? o_.trainer_microbatch_tokens : o_.tokens;
    tc.lr = 1e-6;
    tc.keep_logits_gib = o_.keep_logits_gib;
    trainer::Trainer tr(policy_, tc);
    std::vector<trainer::Sample> big;
    int64_t tok = 0, completion = 0;
    while (tok + samples_[big.size() % samples_.size()].tokens() <= o_.tokens) {
      big.push_back(samples_[big.size() % samples_.size()]);
      tok += big.back().tokens();
      completion += int64_t(big.back().completion.size());
    }
    reset_peak();
    const double ts = median_seconds(1, std::max(2, o_.steps / 2), [&] { (void)tr.train_step(big); });
    J["trainer_step_s"] = ts;
    J["trainer_step_tokens"] = tok;
    J["trainer_step_completion_tokens"] = completion;  // the output head's rows
    J["trainer_step_tokens_per_s"] = double(tok) / ts;
    J["trainer_step_microbatch_tokens"] = tc.logprobs.max_tokens_per_microbatch;
    J["trainer_step_peak_memory_gib"] = peak_gib();
    // Issue 14's bound: forward+backward (every row through the head) plus the AdamW state read
    // and written once at the copy rate (kernels/adamw.hpp's 28 bytes a parameter).
    int64_t numel = 0;
    for (const auto& p : policy_->parameters()) numel += p.numel();
    const double state_bytes = kernels::kAdamWLowPrecisionBytesPerParameter * double(numel);
    J["trainer_step_parameters"] = numel;
    J["trainer_step_adamw_state_bytes"] = state_bytes;
    J["trainer_step_bound_s"] = fb_ + state_bytes / (J["copy_read_write_gbs"].get<double>() * 1e9);
    // Where one more step's time goes, the device synchronised at each phase's end.
    tr.time_phases(true);
    (void)tr.train_step(big);
    tr.time_phases(false);
    const auto& ph = tr.last_phases();
    J["trainer_step_phases_s"] = {{"forward", ph.forward}, {"backward", ph.backward}, {"reduce_and_clip", ph.reduce},
                                  {"optimizer", ph.optimizer}};
    time_optimizer(tr);
  }

  // The optimizer's part of the step alone, on the trainer's masters and moments and the policy's
  // bf16 gradients of its last step: the trainer's path (the clip's norm over the bf16 gradients,
  // AdamW from them into the masters and the bf16 parameters in one kernel) against the one it
  // replaced (gradients widened into fp32 copies, clipped, LibTorch's fused AdamW, masters copied out).
  void time_optimizer(trainer::Trainer& tr) {
    auto& adamw = tr.optimizer();
    const auto masters = tr.master_parameters();
    const auto params = policy_->parameters();
    std::vector<torch::Tensor> grads;
    for (const auto& p : params) grads.push_back(p.grad());
    const double kiln_s = median_seconds(1, 5, [&] {
      const trainer::LowPrecisionGradients low{masters, grads, params, trainer::clip_gradients(grads, 1.0, {}).second};
      trainer::fused_adamw_step(adamw, &low);
    });
    const double composite_s = median_seconds(1, 5, [&] {
      std::vector<torch::Tensor> wide;
      for (std::size_t i = 0; i < masters.size(); ++i) wide.push_back(masters[i].mutable_grad() = torch::empty_like(masters[i]));
      trainer::copy_tensors(wide, grads);
      (void)trainer::clip_grad_norm(masters, 1.0);
      trainer::fused_adamw_step(adamw);
      trainer::copy_tensors(params, masters);
      for (auto m : masters) m.mutable_grad() = torch::Tensor();
    });
    J["optimizer_step_s"] = kiln_s;
    J["optimizer_step_composite_s"] = composite_s;
    J["optimizer_step_gbs"] = J["trainer_step_adamw_state_bytes"].get<double>() / kiln_s / 1e9;
  }

  // 4. update_weights: device-to-device into the engine's storage vs a plain copy.
  void time_weight_sync() {
    const uint64_t bucket = uint64_t(o_.bucket_mib * (1 << 20));
    const auto groups = policy_->weight_sync_groups(/*hf_names=*/false);
    weight_sync::DeviceSyncStats st;
    const double with_check =
        median_seconds(1, 3, [&] { st = weight_sync::copy_weights_device(*policy_, *engine_model_, bucket, true, groups); });
    const double no_check =
        median_seconds(1, 3, [&] { st = weight_sync::copy_weights_device(*policy_, *engine_model_, bucket, false, groups); });
    auto src = torch::empty({int64_t(st.bytes / 2)}, bf16_).normal_(), dst = torch::empty_like(src);
    const double plain = median_seconds(2, 5, [&] { dst.copy_(src); });
    J["update_weights_bytes"] = st.bytes;
    J["update_weights_tensors"] = st.tensors;
    J["update_weights_buckets"] = st.buckets;
    J["update_weights_time_s"] = with_check;
    J["update_weights_nocheck_time_s"] = no_check;
    J["plain_copy_time_s"] = plain;
    J["update_weights_gbs"] = double(st.bytes) / with_check / 1e9;
    J["update_weights_nocheck_gbs"] = double(st.bytes) / no_check / 1e9;
    J["plain_copy_gbs"] = double(st.bytes) / plain / 1e9;
  }

  // The machine's limits and the forward+backward (all that --forward-backward-only measures).
  void print_training() const {
    auto d = [&](const char* key) { return J.at(key).get<double>(); };
    std::printf("kiln bench gpu: %s, GLM-4.7-Flash dims, %lld layers, bf16, %lld tokens in %lld documents, logits "
                "kept up to %g GiB\n",
                torch::cuda::device_count() ? "CUDA" : "-", (long long)o_.layers, (long long)o_.tokens,
                (long long)o_.docs, o_.keep_logits_gib);
    std::printf("  measured limits: bf16 GEMM %.0f TFLOP/s, D2D copy %.0f GB/s (read+write)\n", d("gemm_bf16_tflops"),
                d("copy_read_write_gbs"));
    if (o_.batch_on_device) std::printf("  token ids and positions on the GPU before timing (--batch-on-device)\n");
    if (J.contains("balance_routing_rounds"))
      std::printf("  routing balanced by %d rounds of the router-bias update: expert load max/mean per layer %.2f -> "
                  "%.2f\n",
                  J.at("balance_routing_rounds").get<int>(), d("expert_load_max_over_mean_per_layer_before_balancing"),
                  d("expert_load_max_over_mean_per_layer"));
    std::printf("  forward+backward     %8.3f s  %9.0f tokens/s  MFU %.1f%%  peak %.1f GiB  (expert load max/mean %.2f "
                "summed over the MoE layers, %.2f per layer)\n",
                fb_, double(o_.tokens) / fb_, 100.0 * d("mfu"), d("peak_memory_gib"), d("expert_load_max_over_mean"),
                d("expert_load_max_over_mean_per_layer"));
    if (J.contains("checkpointed_train_step_s"))
      std::printf("  forward+backward, activation checkpointing (%s) %8.3f s  %9.0f tokens/s  MFU %.1f%%  peak %.1f GiB\n",
                  o_.checkpoint_layers > 0 ? ("first " + std::to_string(o_.checkpoint_layers) + " layers").c_str()
                                           : "every layer",
                  d("checkpointed_train_step_s"), d("checkpointed_train_tokens_per_s"), 100.0 * d("checkpointed_mfu"),
                  d("checkpointed_peak_memory_gib"));
  }

  void print() const {
    auto d = [&](const char* key) { return J.at(key).get<double>(); };
    print_training();
    std::printf("  trainer step (AdamW) %8.3f s  %9.0f tokens/s  peak %.1f GiB  (micro-batches of up to %lld tokens; "
                "%lld of %lld tokens completions, the head's rows)\n",
                d("trainer_step_s"), d("trainer_step_tokens_per_s"), d("trainer_step_peak_memory_gib"),
                (long long)J.at("trainer_step_microbatch_tokens").get<int64_t>(),
                (long long)J.at("trainer_step_completion_tokens").get<int64_t>(),
                (long long)J.at("trainer_step_tokens").get<int64_t>());
    const auto& ph = J.at("trainer_step_phases_s");
    std::printf("    bound: forward+backward + AdamW state (%.2f GB) at the copy rate = %.3f s; the step is %.2fx of it\n",
                d("trainer_step_adamw_state_bytes") / 1e9,
                d("trainer_step_bound_s"),
                d("trainer_step_s") / d("trainer_step_bound_s"));
    std::printf("    phases (device synchronised at each end): forward %.3f s, backward %.3f s, clip %.3f s, optimizer "
                "%.3f s\n",
                ph.at("forward").get<double>(), ph.at("backward").get<double>(), ph.at("reduce_and_clip").get<double>(),
                ph.at("optimizer").get<double>());
    std::printf("  optimizer (clip + AdamW) %.4f s  %5.0f GB/s of state; before (fp32 gradient copies, LibTorch's fused "
                "AdamW, copy-out) %.4f s\n",
                d("optimizer_step_s"), d("optimizer_step_gbs"), d("optimizer_step_composite_s"));
    std::printf("  log_probs_time       %8.3f s  (decoder forward %.3f s; log-prob head fwd+bwd %.3f s)\n",
                d("log_probs_time_s"), d("forward_no_grad_s"), d("logprob_head_fwd_bwd_s"));
    std::printf("  one MoE layer fwd+bwd: attention half %.4f s, MoE half %.4f s\n", d("layer_attention_fwd_bwd_s"),
                d("layer_moe_fwd_bwd_s"));
    std::printf("  rollout (engine)     %8.3f s  %9.0f generated tokens/s\n", rollout_s_, d("rollout_tokens_per_s"));
    std::printf("  update_weights_time  %8.3f s  %6.0f GB/s (%.0f GB/s unchecked) vs plain copy %.0f GB/s of %.2f GB\n",
                d("update_weights_time_s"), d("update_weights_gbs"), d("update_weights_nocheck_gbs"),
                d("plain_copy_gbs"), d("update_weights_bytes") / 1e9);
    std::printf("  train/rollout |logprob diff| mean %.2e max %.2e over %lld tokens (first token %.2e, decoded %.2e)\n",
                d("train_rollout_logprob_abs_diff_mean"), d("train_rollout_logprob_abs_diff_max"),
                (long long)J.at("train_rollout_tokens").get<int64_t>(),
                d("train_rollout_logprob_abs_diff_first_token_mean"), d("train_rollout_logprob_abs_diff_decode_mean"));
    std::printf("    of which: trainer at micro-batches of 1024 vs %lld tokens: mean %.2e max %.2e; the engine's "
                "weights through the trainer's path: mean %.2e max %.2e\n",
                (long long)o_.tokens, d("trainer_microbatch_1024_logprob_abs_diff_mean"),
                d("trainer_microbatch_1024_logprob_abs_diff_max"), d("engine_weights_trainer_path_logprob_abs_diff_mean"),
                d("engine_weights_trainer_path_logprob_abs_diff_max"));
    if (o_.true_on_policy) {
      std::printf("  true on-policy mode (batch-invariant kernels, algorithm.true_on_policy):\n");
      std::printf("    forward+backward   %8.3f s  %9.0f tokens/s  (%.2fx the default's time)\n",
                  d("true_on_policy_train_step_s"), d("true_on_policy_train_tokens_per_s"),
                  d("true_on_policy_train_step_s") / fb_);
      std::printf("    rollout (engine)   %8.3f s  %9.0f generated tokens/s  (%.2fx the default's time)\n",
                  d("true_on_policy_rollout_time_s"), d("true_on_policy_rollout_tokens_per_s"),
                  d("true_on_policy_rollout_time_s") / rollout_s_);
      std::printf("    train/rollout |logprob diff| mean %.2e max %.2e over %lld tokens\n",
                  d("true_on_policy_train_rollout_logprob_abs_diff_mean"),
                  d("true_on_policy_train_rollout_logprob_abs_diff_max"),
                  (long long)J.at("true_on_policy_train_rollout_tokens").get<int64_t>());
    }
  }

  nlohmann::json J;

 private:
  std::shared_ptr<Model> build_model() const {
    model::check_fits_host_memory(model::glm4_moe_lite::parameter_count(cfg_), 4, model::host_memory_available_bytes(),
                                  "glm4_moe_lite with " + std::to_string(o_.layers) + " layers",
                                  "in fp32 (built on the host, then cast and moved)");
    auto m = std::make_shared<Model>(cfg_);
    m->to(dev_);
    m->to_dtype(torch::kBFloat16);
    return m;
  }

  void forward_backward() {
    policy_->zero_grad();
    auto out = policy_->forward(o_.batch_on_device ? device_batch_ : batch_);
    auto lp = policy_->token_logprobs(out, targets_, 4096);
    (-lp.sum() / double(o_.tokens - o_.docs)).backward();
  }

  // The engine's completions as samples, with the time of the generation and the tokens made,
  // after an untimed short generation on the same engine (first-call costs out of the timing).
  std::vector<trainer::Sample> run_rollout(const rollout::EngineOptions& options, double& seconds, int64_t& tokens) {
    rollout::Engine engine(engine_model_, options);
    std::vector<rollout::GenerationRequest> warm(reqs_.begin(), reqs_.begin() + std::min<std::size_t>(reqs_.size(), 4));
    for (auto& r : warm) r.sampling.max_new_tokens = std::min<int64_t>(r.sampling.max_new_tokens, 4);
    (void)engine.generate(warm);
    torch::cuda::synchronize();
    const messaging::Stopwatch tr0;
    auto completions = engine.generate(reqs_);
    torch::cuda::synchronize();
    seconds = tr0.seconds();
    std::vector<trainer::Sample> out;
    tokens = 0;
    for (auto& c : completions) {
      trainer::Sample s;
      s.prompt = c.prompt;
      s.completion = c.tokens;
      s.behavior_logprobs = c.logprobs;
      s.routed_experts = c.routed_experts;
      s.advantage = float(out.size() % 2 ? 1 : -1);
      tokens += int64_t(c.tokens.size());
      out.push_back(std::move(s));
    }
    return out;
  }

  // |trainer - rollout| log-prob over the samples' tokens (the trainer with routing replay).
  Gap gap_of(const std::vector<trainer::Sample>& ss) const {
    std::vector<std::vector<float>> behavior;
    for (const auto& s : ss) behavior.push_back(s.behavior_logprobs);
    return logprob_gap(trainer::completion_logprobs(*policy_, ss, o_.tokens, /*routing_replay=*/true), behavior);
  }

  const GpuBenchOptions& o_;
  const torch::Device dev_;
  const torch::TensorOptions bf16_;
  const model::glm4_moe_lite::Glm4MoeLiteConfig cfg_;
  int64_t kept_logits_bytes_ = 0;
  std::shared_ptr<Model> policy_, engine_model_;
  model::PackedBatch batch_;
  model::PackedBatch device_batch_;  // batch_ with ids and positions on the GPU (--batch-on-device), made with it
  torch::Tensor targets_;
  double flops_ = 0, fb_ = 0, rollout_s_ = 0;
  rollout::EngineOptions eo_;
  std::vector<rollout::GenerationRequest> reqs_;
  std::vector<trainer::Sample> samples_;
};
}  // namespace

int run_gpu_bench(const GpuBenchOptions& o) {
  // What the option parser cannot check (its range lets NaN through; --layers is another option).
  auto refuse = [](const std::string& why) {
    std::fprintf(stderr, "kiln bench gpu: %s\n", why.c_str());
    return 2;
  };
  if (!(o.keep_logits_gib >= 0 && o.keep_logits_gib <= 1048576))
    return refuse("--keep-logits-gib must be a number in [0, 1048576], got " + std::to_string(o.keep_logits_gib));
  if (o.checkpoint_layers > 0 && !o.activation_checkpointing)
    return refuse("--activation-checkpointing-layers is read with --activation-checkpointing only");
  if (o.checkpoint_layers > o.layers)
    return refuse("--activation-checkpointing-layers " + std::to_string(o.checkpoint_layers) + " exceeds --layers " +
                  std::to_string(o.layers));
  if (int bad = check_cuda_and_packing("gpu", o.tokens, o.docs, 2)) return bad;
  torch::manual_seed(0);
  GpuBench b(o);
  b.measure_limits();
  b.build_policy();
  b.balance_routing();
  b.time_training();
  if (o.profile) {  // ncu --profile-from-start off: one forward+backward, then stop
    b.profile_one();
    return 0;
  }
  if (!o.trace_path.empty()) {
    b.trace_one();
    return 0;
  }
  if (o.activation_checkpointing) b.time_checkpointed();
  if (o.forward_backward_only) {
    b.print_training();
    if (!o.json_path.empty()) std::ofstream(o.json_path) << b.J.dump(2) << "\n";
    return 0;
  }
  b.time_breakdown();
  b.rollout_and_gap();
  if (o.true_on_policy) b.true_on_policy();
  b.time_trainer_step();
  b.time_weight_sync();
  b.print();
  if (!o.json_path.empty()) std::ofstream(o.json_path) << b.J.dump(2) << "\n";
  return 0;
}

}  // namespace kiln::experiments

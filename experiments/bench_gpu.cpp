#include "experiments/bench_gpu.hpp"
#include "messaging/stopwatch.hpp"

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
#include "actors/trainer/trainer.hpp"
#include "actors/weight_sync/device_sync.hpp"
#include "experiments/bench_cuda.hpp"
#include "experiments/bench_model.hpp"
#include "model/blocks/logprobs.hpp"
#include "model/glm4_moe_lite/model.hpp"

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
  const torch::Device dev(torch::kCUDA, 0);
  const auto bf16 = torch::TensorOptions().device(dev).dtype(torch::kBFloat16);
  nlohmann::json J;
  torch::manual_seed(0);

  // 1. The machine's limits.
  double gemm_tflops, copy_gbs;
  {
    auto a = torch::randn({8192, 8192}, bf16), b = torch::randn({8192, 8192}, bf16);
    double s = median_seconds(3, 10, [&] { (void)torch::mm(a, b); });
    gemm_tflops = 2.0 * 8192.0 * 8192.0 * 8192.0 / s / 1e12;
    auto src = torch::randn({int64_t(1) << 30}, bf16), dst = torch::empty_like(src);  // 2 GiB
    s = median_seconds(3, 10, [&] { dst.copy_(src); });
    copy_gbs = 2.0 * double(src.numel()) * 2 / s / 1e9;  // read + write
  }
  J["gemm_bf16_tflops"] = gemm_tflops;
  J["copy_read_write_gbs"] = copy_gbs;

  // 2. The model, on the GPU in bf16.
  auto cfg = model::glm4_moe_lite::flavors::glm47_flash_layers(o.layers);
  if (!o.config_dir.empty()) {
    std::filesystem::create_directories(o.config_dir);
    std::ofstream(std::filesystem::path(o.config_dir) / "config.json") << cfg.to_hf_json().dump(2) << "\n";
  }
  auto build = [&] {
    auto m = std::make_shared<model::glm4_moe_lite::Glm4MoeLiteModel>(cfg);
    m->to(dev);
    m->to_dtype(torch::kBFloat16);
    return m;
  };
  auto policy = build();
  trainer::TrainerConfig budget;  // the kept-logits budget in bytes, as the trainer sets it
  budget.keep_logits_gib = o.keep_logits_gib;
  const int64_t kept_logits_bytes = budget.keep_logits_bytes();
  policy->set_kept_logits_bytes(kept_logits_bytes);
  J["keep_logits_gib"] = o.keep_logits_gib;
  const int64_t n = o.tokens / o.docs;
  auto batch = random_packed_documents(o.tokens, o.docs, cfg.vocab_size);
  auto targets = model::next_token_targets(batch.input_ids, batch.cu_seqlens).to(dev);
  const double flops = 3.0 * glm4_forward_flops(cfg, o.docs, n);

  // forward + backward (the comparison with transformers: same tokens, same loss)
  auto forward_backward = [&] {
    policy->zero_grad();
    auto out = policy->forward(batch);
    auto lp = policy->token_logprobs(out, targets, 4096);
    (-lp.sum() / double(o.tokens - o.docs)).backward();
  };
  reset_peak();
  double fb = median_seconds(o.warmup, o.steps, forward_backward);
  const double fb_peak = peak_gib();
  J["train_tokens_per_s"] = double(o.tokens) / fb;
  J["train_step_s"] = fb;
  J["mfu"] = flops / fb / (gemm_tflops * 1e12);
  J["peak_memory_gib"] = fb_peak;
  J["model_tflop_per_step"] = flops / 1e12;
  policy->zero_grad();
  if (o.profile) {  // ncu --profile-from-start off: one forward+backward, then stop
#ifdef KILN_CUDA
    torch::cuda::synchronize();
    cudaProfilerStart();
    forward_backward();
    torch::cuda::synchronize();
    cudaProfilerStop();
#endif
    std::printf("kiln bench gpu --profile: %lld layers, %lld tokens in %lld documents: forward+backward %.4f s "
                "(median, unprofiled), %.0f tokens/s; profiled one more\n",
                (long long)o.layers, (long long)o.tokens, (long long)o.docs, fb, double(o.tokens) / fb);
    return 0;
  }
  if (!o.trace_path.empty()) {  // one forward+backward under Kineto, as a Chrome trace
    // (with --activation-checkpointing: the checkpointed step, warmed up once)
    policy->set_activation_checkpointing(o.activation_checkpointing, o.checkpoint_layers);
    if (o.activation_checkpointing) forward_backward();
    namespace prof = torch::autograd::profiler;
    using torch::profiler::impl::ActivityType;
    const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
    const std::set<ActivityType> activities{ActivityType::CPU, ActivityType::CUDA};
    torch::cuda::synchronize();
    prof::prepareProfiler(config, activities);
    prof::enableProfiler(config, activities);
    forward_backward();
    torch::cuda::synchronize();
    prof::disableProfiler()->save(o.trace_path);
    std::printf("kiln bench gpu --trace: %lld layers, %lld tokens in %lld documents: forward+backward %.4f s "
                "(median, untraced), %.0f tokens/s; one more%s traced into %s\n",
                (long long)o.layers, (long long)o.tokens, (long long)o.docs, fb, double(o.tokens) / fb,
                o.activation_checkpointing ? " with activation checkpointing" : "", o.trace_path.c_str());
    return 0;
  }
  // The same with activation checkpointing per layer (algorithm.activation_checkpointing): the
  // speed/memory trade, MFU still counted on the model's 3x forward FLOPs (not the recompute).
  double fb_ckpt = 0, fb_ckpt_peak = 0;
  if (o.activation_checkpointing) {
    policy->set_activation_checkpointing(true, o.checkpoint_layers);
    reset_peak();
    fb_ckpt = median_seconds(o.warmup, o.steps, [&] {
      policy->zero_grad();
      auto out = policy->forward(batch);
      auto lp = policy->token_logprobs(out, targets, 4096);
      (-lp.sum() / double(o.tokens - o.docs)).backward();
    });
    fb_ckpt_peak = peak_gib();
    policy->set_activation_checkpointing(false);
    policy->zero_grad();
    J["checkpointed_train_tokens_per_s"] = double(o.tokens) / fb_ckpt;
    J["checkpointed_layers"] = o.checkpoint_layers > 0 ? o.checkpoint_layers : o.layers;
    J["checkpointed_mfu"] = flops / fb_ckpt / (gemm_tflops * 1e12);
    J["checkpointed_peak_memory_gib"] = fb_ckpt_peak;
  }

  // log_probs_time: no-grad forward + log-probs of the same micro-batch
  double lpt = median_seconds(o.warmup, o.steps, [&] {
    torch::NoGradGuard ng;
    auto out = policy->forward(batch);
    (void)policy->token_logprobs(out, targets, 4096);
  });
  J["log_probs_time_s"] = lpt;
  // Breakdown: the log-prob head alone (lm_head GEMMs + softmax over V), forward+backward.
  {
    auto h = (0.5 * torch::randn({o.tokens, cfg.hidden_size}, bf16)).requires_grad_();
    auto w = policy->lm_head_weight().detach().clone().requires_grad_();
    J["logprob_head_fwd_bwd_s"] = median_seconds(o.warmup, o.steps, [&] {
      model::token_logprobs(h, w, targets, 4096, kept_logits_bytes).sum().backward();
    });
    J["forward_no_grad_s"] = median_seconds(o.warmup, o.steps, [&] {
      torch::NoGradGuard ng;
      (void)policy->forward(batch);
    });
    // One MoE layer's two halves, forward+backward, on the micro-batch's shape.
    auto& layer = policy->layers.at(1);
    auto x = (0.5 * torch::randn({o.tokens, cfg.hidden_size}, bf16)).requires_grad_();
    auto pos = batch.position_ids.to(dev);
    auto cu = batch.cu_seqlens.to(dev, torch::kInt32);
    J["layer_attention_fwd_bwd_s"] = median_seconds(o.warmup, o.steps, [&] {
      layer->attn(layer->attn_norm(x), pos, cu, n).sum().backward();
    });
    J["layer_moe_fwd_bwd_s"] = median_seconds(o.warmup, o.steps, [&] {
      layer->moe(layer->mlp_norm(x), std::nullopt, nullptr).sum().backward();
    });
    policy->zero_grad();
  }

  // 3. Rollout on the GPU, then a full trainer step on its completions' shape.
  auto engine_model = build();
  {
    auto st = weight_sync::copy_weights_device(*policy, *engine_model, uint64_t(o.bucket_mib * (1 << 20)), true, policy->weight_sync_groups(false));
    (void)st;
  }
  rollout::EngineOptions eo;
  eo.max_batch = o.rollout_prompts;
  eo.block_size = 16;
  eo.cache_blocks = o.rollout_prompts * ((o.rollout_prompt_tokens + o.rollout_new_tokens) / 16 + 2);
  eo.absorbed_decode = o.absorbed_decode;
  std::vector<rollout::GenerationRequest> reqs;
  for (int64_t i = 0; i < o.rollout_prompts; ++i) {
    rollout::GenerationRequest r;
    r.id = uint64_t(i);
    auto p = torch::randint(0, cfg.vocab_size, {o.rollout_prompt_tokens}, torch::kInt64);
    r.prompt.assign(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + p.numel());
    r.sampling.temperature = 1.0;
    r.sampling.max_new_tokens = o.rollout_new_tokens;
    r.sampling.seed = uint64_t(100 + i);
    reqs.push_back(std::move(r));
  }
  // The engine's completions as samples, with the time of the generation and the tokens made,
  // after an untimed short generation on the same engine (first-call costs out of the timing).
  auto run_rollout = [&](const rollout::EngineOptions& options, double& seconds, int64_t& tokens) {
    rollout::Engine engine(engine_model, options);
    std::vector<rollout::GenerationRequest> warm(reqs.begin(), reqs.begin() + std::min<std::size_t>(reqs.size(), 4));
    for (auto& r : warm) r.sampling.max_new_tokens = std::min<int64_t>(r.sampling.max_new_tokens, 4);
    (void)engine.generate(warm);
    torch::cuda::synchronize();
    const messaging::Stopwatch tr0;
    auto completions = engine.generate(reqs);
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
  };
  // |trainer - rollout| log-prob over the samples' tokens (sampled_gap).
  auto gap_of = [&](const std::vector<trainer::Sample>& ss) {
    std::vector<std::vector<float>> behavior;
    for (const auto& s : ss) behavior.push_back(s.behavior_logprobs);
    return logprob_gap(trainer::completion_logprobs(*policy, ss, o.tokens, /*routing_replay=*/true), behavior);
  };
  double rollout_s = 0;
  int64_t gen_tokens = 0;
  auto samples = run_rollout(eo, rollout_s, gen_tokens);
  J["rollout_time_s"] = rollout_s;
  J["rollout_tokens_per_s"] = double(gen_tokens) / rollout_s;
  const Gap gap = gap_of(samples);
  const double diff_sum = gap.sum, diff_max = gap.max, first_sum = gap.first_sum;
  const int64_t diff_n = gap.n;
  J["train_rollout_logprob_abs_diff_first_token_mean"] = first_sum / double(std::max<std::size_t>(1, samples.size()));
  J["train_rollout_logprob_abs_diff_decode_mean"] =
      (diff_sum - first_sum) / double(std::max<int64_t>(1, diff_n - int64_t(samples.size())));
  J["train_rollout_logprob_abs_diff_mean"] = diff_sum / double(std::max<int64_t>(1, diff_n));
  J["train_rollout_logprob_abs_diff_max"] = diff_max;
  J["train_rollout_tokens"] = diff_n;
  // Two gaps that the train/rollout one contains: the trainer's log-probs at micro-batches of
  // 1024 tokens against o.tokens' (an op whose bits depend on the rows sharing it), and the
  // engine's copy of the weights through the trainer's own path (a weight-sync difference).
  {
    const auto base = trainer::completion_logprobs(*policy, samples, o.tokens, /*routing_replay=*/true);
    auto gap_to_base = [&](const std::vector<std::vector<float>>& other, const char* key) {
      const Gap g = logprob_gap(base, other);
      J[std::string(key) + "_mean"] = g.sum / double(std::max<int64_t>(1, g.n));
      J[std::string(key) + "_max"] = g.max;
    };
    gap_to_base(trainer::completion_logprobs(*policy, samples, 1024, true), "trainer_microbatch_1024_logprob_abs_diff");
    gap_to_base(trainer::completion_logprobs(*engine_model, samples, o.tokens, true), "engine_weights_trainer_path_logprob_abs_diff");
  }

  // 3b. The true on-policy mode: the same forward+backward and rollout with the batch-invariant
  // kernels on both sides (policy and engine), and that mode's train/rollout diff.
  double fb_bi = 0, rollout_bi_s = 0;
  Gap gap_bi;
  if (o.true_on_policy) {
    policy->set_batch_invariant(true);
    fb_bi = median_seconds(o.warmup, o.steps, forward_backward);
    policy->zero_grad();
    auto eo_bi = eo;
    eo_bi.true_on_policy = true;  // the engine turns engine_model's switch on
    eo_bi.absorbed_decode = false;  // the mode runs the expanded decode (the trainer's formula)
    int64_t tokens_bi = 0;
    auto samples_bi = run_rollout(eo_bi, rollout_bi_s, tokens_bi);
    gap_bi = gap_of(samples_bi);
    policy->set_batch_invariant(false);
    engine_model->set_batch_invariant(false);
    J["true_on_policy_train_tokens_per_s"] = double(o.tokens) / fb_bi;
    J["true_on_policy_train_step_s"] = fb_bi;
    J["true_on_policy_rollout_time_s"] = rollout_bi_s;
    J["true_on_policy_rollout_tokens_per_s"] = double(tokens_bi) / rollout_bi_s;
    J["true_on_policy_train_rollout_logprob_abs_diff_mean"] = gap_bi.sum / double(std::max<int64_t>(1, gap_bi.n));
    J["true_on_policy_train_rollout_logprob_abs_diff_max"] = gap_bi.max;
    J["true_on_policy_train_rollout_tokens"] = gap_bi.n;
  }

  // full trainer step: bf16 policy, fp32 masters + AdamW, on the rollout's samples
  {
    trainer::TrainerConfig tc;
    tc.logprobs.max_tokens_per_microbatch = o.tokens;
    tc.lr = 1e-6;
    tc.keep_logits_gib = o.keep_logits_gib;
    trainer::Trainer tr(policy, tc);
    std::vector<trainer::Sample> big;  // repeat the samples up to ~tokens
    int64_t tok = 0;
    while (tok + samples[big.size() % samples.size()].tokens() <= o.tokens) {
      big.push_back(samples[big.size() % samples.size()]);
      tok += big.back().tokens();
    }
    reset_peak();
    double ts = median_seconds(1, std::max(2, o.steps / 2), [&] { (void)tr.train_step(big); });
    J["trainer_step_s"] = ts;
    J["trainer_step_tokens"] = tok;
    J["trainer_step_tokens_per_s"] = double(tok) / ts;
    J["trainer_step_peak_memory_gib"] = peak_gib();
  }

  // 4. update_weights: device-to-device into the engine's storage vs a plain copy
  {
    const uint64_t bucket = uint64_t(o.bucket_mib * (1 << 20));
    const auto groups = policy->weight_sync_groups(/*hf_names=*/false);
    weight_sync::DeviceSyncStats st;
    double with_check = median_seconds(1, 3, [&] { st = weight_sync::copy_weights_device(*policy, *engine_model, bucket, true, groups); });
    double no_check = median_seconds(1, 3, [&] { st = weight_sync::copy_weights_device(*policy, *engine_model, bucket, false, groups); });
    auto src = torch::empty({int64_t(st.bytes / 2)}, bf16).normal_(), dst = torch::empty_like(src);
    double plain = median_seconds(2, 5, [&] { dst.copy_(src); });
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

  std::printf("kiln bench gpu: %s, GLM-4.7-Flash dims, %lld layers, bf16, %lld tokens in %lld documents, logits kept "
              "up to %g GiB\n",
              torch::cuda::device_count() ? "CUDA" : "-", (long long)o.layers, (long long)o.tokens, (long long)o.docs,
              o.keep_logits_gib);
  std::printf("  measured limits: bf16 GEMM %.0f TFLOP/s, D2D copy %.0f GB/s (read+write)\n", gemm_tflops, copy_gbs);
  std::printf("  forward+backward     %8.3f s  %9.0f tokens/s  MFU %.1f%%  peak %.1f GiB\n", fb, double(o.tokens) / fb,
              100.0 * J["mfu"].get<double>(), fb_peak);
  if (o.activation_checkpointing)
    std::printf("  forward+backward, activation checkpointing (%s) %8.3f s  %9.0f tokens/s  MFU %.1f%%  peak %.1f GiB\n",
                o.checkpoint_layers > 0 ? ("first " + std::to_string(o.checkpoint_layers) + " layers").c_str()
                                        : "every layer",
                fb_ckpt, double(o.tokens) / fb_ckpt, 100.0 * J["checkpointed_mfu"].get<double>(), fb_ckpt_peak);
  std::printf("  trainer step (AdamW) %8.3f s  %9.0f tokens/s  peak %.1f GiB\n", J["trainer_step_s"].get<double>(),
              J["trainer_step_tokens_per_s"].get<double>(), J["trainer_step_peak_memory_gib"].get<double>());
  std::printf("  log_probs_time       %8.3f s  (decoder forward %.3f s; log-prob head fwd+bwd %.3f s)\n", lpt,
              J["forward_no_grad_s"].get<double>(), J["logprob_head_fwd_bwd_s"].get<double>());
  std::printf("  one MoE layer fwd+bwd: attention half %.4f s, MoE half %.4f s\n",
              J["layer_attention_fwd_bwd_s"].get<double>(), J["layer_moe_fwd_bwd_s"].get<double>());
  std::printf("  rollout (engine)     %8.3f s  %9.0f generated tokens/s\n", rollout_s, J["rollout_tokens_per_s"].get<double>());
  std::printf("  update_weights_time  %8.3f s  %6.0f GB/s (%.0f GB/s unchecked) vs plain copy %.0f GB/s of %.2f GB\n",
              J["update_weights_time_s"].get<double>(), J["update_weights_gbs"].get<double>(),
              J["update_weights_nocheck_gbs"].get<double>(), J["plain_copy_gbs"].get<double>(),
              J["update_weights_bytes"].get<double>() / 1e9);
  std::printf("  train/rollout |logprob diff| mean %.2e max %.2e over %lld tokens (first token %.2e, decoded %.2e)\n",
              J["train_rollout_logprob_abs_diff_mean"].get<double>(), diff_max, (long long)diff_n,
              J["train_rollout_logprob_abs_diff_first_token_mean"].get<double>(),
              J["train_rollout_logprob_abs_diff_decode_mean"].get<double>());
  std::printf("    of which: trainer at micro-batches of 1024 vs %lld tokens: mean %.2e max %.2e; the engine's weights "
              "through the trainer's path: mean %.2e max %.2e\n",
              (long long)o.tokens, J["trainer_microbatch_1024_logprob_abs_diff_mean"].get<double>(),
              J["trainer_microbatch_1024_logprob_abs_diff_max"].get<double>(),
              J["engine_weights_trainer_path_logprob_abs_diff_mean"].get<double>(),
              J["engine_weights_trainer_path_logprob_abs_diff_max"].get<double>());
  if (o.true_on_policy) {
    std::printf("  true on-policy mode (batch-invariant kernels, algorithm.true_on_policy):\n");
    std::printf("    forward+backward   %8.3f s  %9.0f tokens/s  (%.2fx the default's time)\n", fb_bi,
                double(o.tokens) / fb_bi, fb_bi / fb);
    std::printf("    rollout (engine)   %8.3f s  %9.0f generated tokens/s  (%.2fx the default's time)\n", rollout_bi_s,
                J["true_on_policy_rollout_tokens_per_s"].get<double>(), rollout_bi_s / rollout_s);
    std::printf("    train/rollout |logprob diff| mean %.2e max %.2e over %lld tokens\n",
                J["true_on_policy_train_rollout_logprob_abs_diff_mean"].get<double>(), gap_bi.max,
                (long long)gap_bi.n);
  }
  if (!o.json_path.empty()) std::ofstream(o.json_path) << J.dump(2) << "\n";
  return 0;
}

}  // namespace kiln::experiments

#include "experiments/bench_parallel.hpp"

#include <torch/torch.h>
#ifdef KILN_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "actors/trainer/trainer.hpp"
#include "experiments/bench_model.hpp"
#include "messaging/stopwatch.hpp"
#include "model/glm4_moe_lite/model.hpp"
#include "parallel/process_group.hpp"

namespace kiln::experiments {

namespace {

#ifdef KILN_CUDA
void reset_peak(int device) { c10::cuda::CUDACachingAllocator::resetPeakStats(c10::DeviceIndex(device)); }
double peak_gib(int device) {
  auto s = c10::cuda::CUDACachingAllocator::getDeviceStats(c10::DeviceIndex(device));
  return double(s.allocated_bytes[0].peak) / double(1ull << 30);
}
#else
void reset_peak(int) {}
double peak_gib(int) { return 0; }
#endif

// Median seconds of `steps` calls after `warmup`, the device synchronised around each.
template <class F>
double median_seconds(int warmup, int steps, F fn) {
  for (int i = 0; i < warmup; ++i) fn();
  torch::cuda::synchronize();
  std::vector<double> t;
  for (int i = 0; i < steps; ++i) {
    const messaging::Stopwatch t0;
    fn();
    torch::cuda::synchronize();
    t.push_back(t0.seconds());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// `docs` samples of tokens/docs tokens each (first half prompt), random ids, seeded by `seed`.
std::vector<trainer::Sample> make_samples(int64_t docs, int64_t tokens, int64_t vocab, uint64_t seed) {
  torch::manual_seed(seed);
  const int64_t n = tokens / docs, prompt = n / 2;
  auto ids = torch::randint(0, vocab, {docs * n}, torch::kInt64);
  auto adv = torch::randn({docs});
  std::vector<trainer::Sample> out(static_cast<std::size_t>(docs));
  for (int64_t d = 0; d < docs; ++d) {
    const int64_t* p = ids.data_ptr<int64_t>() + d * n;
    auto& s = out[std::size_t(d)];
    s.prompt.assign(p, p + prompt);
    s.completion.assign(p + prompt, p + n);
    s.behavior_logprobs.assign(std::size_t(n - prompt), -12.0f);  // ~ln(1/V): a random policy's
    s.advantage = adv[d].item<float>();
  }
  return out;
}

}  // namespace

int run_parallel_bench(const ParallelBenchOptions& o) {
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "kiln bench parallel: no CUDA device visible\n");
    return 2;
  }
  if (o.docs < 1 || o.tokens % o.docs != 0 || o.tokens / o.docs < 4) {
    std::fprintf(stderr, "kiln bench parallel: --tokens must be a multiple of --docs with >= 4 tokens per sample\n");
    return 2;
  }
  parallel::LaunchInfo info;
  std::unique_ptr<parallel::ProcessGroups> groups;
  try {
    info = parallel::read_launch_from_environment();
    groups = std::make_unique<parallel::ProcessGroups>(info, torch::Device(torch::kCUDA, int8_t(info.local_rank)),
                                                       std::vector<parallel::MeshDim>{{"dp", info.world_size}});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln bench parallel: %s\n", e.what());
    return 2;
  }
  const int rank = info.rank, world = info.world_size, gpu = info.local_rank;
  const torch::Device dev(torch::kCUDA, int8_t(gpu));
  auto cfg = model::glm4_moe_lite::flavors::glm47_flash_layers(o.layers);
  auto build = [&] {
    torch::manual_seed(0);
    auto m = std::make_shared<model::glm4_moe_lite::Glm4MoeLiteModel>(cfg);
    m->to(dev);
    m->to_dtype(torch::kBFloat16);
    return m;
  };
  trainer::TrainerConfig tc;
  tc.logprobs.max_tokens_per_microbatch = o.tokens;
  tc.lr = 1e-6;
  // The whole step's samples (world x docs), the same on every rank; rank r's own share of
  // them is what it trains alone in the one-GPU measurement.
  auto all = make_samples(o.docs * world, o.tokens * world, cfg.vocab_size, 1234);
  const auto share_idx = trainer::split_samples(all, world)[std::size_t(rank)];
  std::vector<trainer::Sample> share;
  for (auto i : share_idx) share.push_back(all[i]);
  int64_t share_tokens = 0;
  for (const auto& s : share) share_tokens += s.tokens();

  double one_s = 0, one_peak = 0, dp_s = 0, dp_peak = 0;
  {
    auto policy = build();
    trainer::Trainer tr(policy, tc);
    reset_peak(gpu);
    one_s = median_seconds(o.warmup, o.steps, [&] { (void)tr.train_step(share); });
    one_peak = peak_gib(gpu);
  }
#ifdef KILN_CUDA
  c10::cuda::CUDACachingAllocator::emptyCache();
#endif
  {
    auto policy = build();
    trainer::Trainer tr(policy, tc, &groups->along("dp"));
    reset_peak(gpu);
    dp_s = median_seconds(o.warmup, o.steps, [&] { (void)tr.train_step(all); });
    dp_peak = peak_gib(gpu);
  }
  // Every rank's figures to rank 0.
  auto mine = torch::tensor({double(share_tokens) / one_s, one_peak, double(share_tokens) / dp_s, dp_peak, one_s, dp_s},
                            torch::TensorOptions().dtype(torch::kFloat64))
                  .to(dev);
  auto every = torch::empty({world * 6}, mine.options());
  groups->world().all_gather_into_tensor(every, mine);
  every = every.cpu().view({world, 6});
  if (rank != 0) return 0;
  const double flops_per_token = 3.0 * glm4_forward_flops(cfg, o.docs, o.tokens / o.docs) / double(o.tokens);
  nlohmann::json J;
  J["layers"] = o.layers;
  J["world"] = world;
  J["tokens_per_gpu"] = o.tokens;
  J["model_tflop_per_token"] = flops_per_token / 1e12;
  std::printf("kiln bench parallel: GLM-4.7-Flash dims, %lld layers, bf16 + fp32 masters + AdamW, %d GPUs (NCCL), "
              "%lld tokens per GPU per step, median of %d steps\n",
              (long long)o.layers, world, (long long)o.tokens, o.steps);
  std::printf("%-5s | %-22s %-10s | %-22s %-10s | %s\n", "rank", "one GPU tokens/s", "peak GiB", "dp tokens/s per GPU",
              "peak GiB", "dp / one GPU");
  double sum_one = 0, sum_dp = 0;
  for (int r = 0; r < world; ++r) {
    auto v = every[r];
    const double one = v[0].item<double>(), dp = v[2].item<double>();
    sum_one += one;
    sum_dp += dp;
    std::printf("%-5d | %-22.0f %-10.1f | %-22.0f %-10.1f | %.3f\n", r, one, v[1].item<double>(), dp,
                v[3].item<double>(), dp / one);
    J["ranks"].push_back({{"one_gpu_tokens_per_s", one}, {"one_gpu_peak_gib", v[1].item<double>()},
                          {"dp_tokens_per_s_per_gpu", dp}, {"dp_peak_gib", v[3].item<double>()},
                          {"one_gpu_step_s", v[4].item<double>()}, {"dp_step_s", v[5].item<double>()}});
  }
  J["dp_over_one_gpu"] = sum_dp / sum_one;
  std::printf("mean: dp %.0f tokens/s per GPU = %.3f x one GPU (%.0f); whole node %.0f tokens/s\n", sum_dp / world,
              sum_dp / sum_one, sum_one / world, sum_dp);
  if (!o.json_path.empty()) std::ofstream(o.json_path) << J.dump(2) << "\n";
  return 0;
}

}  // namespace kiln::experiments

#include "experiments/bench_parallel.hpp"

#include <torch/torch.h>
#ifdef KILN_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <nlohmann/json.hpp>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <fstream>
#include <mutex>
#include <tuple>

#include "actors/trainer/trainer.hpp"
#include "actors/weight_sync/collective.hpp"
#include "actors/weight_sync/messages.hpp"
#include "messaging/gateway.hpp"
#include "experiments/bench_cuda.hpp"
#include "experiments/bench_model.hpp"
#include "model/glm4_moe_lite/model.hpp"
#include "model/registry.hpp"
#include "parallel/process_group.hpp"

namespace kiln::experiments {

namespace {

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

struct WeightSyncTimes {
  double sync_s = 0, copy_s = 0;  ///< rank 0's: the collective sync, a plain GPU-to-GPU copy
  uint64_t bytes = 0;
};

// Rank 0 broadcasts `model` through a CollectiveSender to ranks 1.., each receiving into its own
// copy through a CollectiveReceiver as a rollout node does; then rank 0 copies the same bytes
// from its GPU to the next one. Collective over `groups`; the times are rank 0's.
WeightSyncTimes time_weight_sync(parallel::ProcessGroups& groups, std::shared_ptr<model::CausalLM> model,
                                 const ParallelBenchOptions& o, torch::Device dev) {
  const int rank = groups.launch().rank, world = groups.launch().world_size, gpu = groups.launch().local_rank;
  auto& store = groups.store();
  WeightSyncTimes t;
  messaging::Gateway gw({"bench-rank-" + std::to_string(rank), "tcp://127.0.0.1:0"});
  const int versions = o.warmup + o.steps;
  if (rank != 0) {
    weight_sync::CollectiveReceiver rx;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<messaging::Envelope> q;
    gw.serve("engine/" + std::to_string(rank), [&](messaging::Envelope e) {
      std::lock_guard<std::mutex> l(mu);
      q.push_back(std::move(e));
      cv.notify_one();
    });
    store.set("bench_engine/" + std::to_string(rank), gw.endpoint());
    for (int handled = 0; handled < versions + 1; ++handled) {  // join, then every version
      std::unique_lock<std::mutex> l(mu);
      cv.wait(l, [&] { return !q.empty(); });
      auto e = std::move(q.front());
      q.pop_front();
      l.unlock();
      auto r = e.type == messaging::WeightSyncJoinGroup::kType ? rx.join(e, dev) : rx.receive(e, *model);
      if (r) gw.reply(e, std::move(*r));
      else gw.reply_error(e, r.error());
    }
  } else {
    std::vector<std::string> engines;
    for (int r = 1; r < world; ++r) {
      const std::string key = "bench_engine/" + std::to_string(r);
      store.wait({key});
      engines.push_back("engine/" + std::to_string(r));
      gw.add_route(engines.back(), store.get_to_str(key));
    }
    weight_sync::CollectiveSender tx(gw, dev, std::chrono::seconds(300), std::chrono::seconds(300));
    tx.connect(engines);
    int64_t version = 0;
    const auto bucket = uint64_t(o.bucket_mib * (1 << 20));
    const auto travel = model->weight_sync_groups(/*hf_names=*/false);
    t.sync_s = median_seconds(o.warmup, o.steps, [&] { t.bytes = tx.send(*model, ++version, bucket, travel).bytes; });
    auto src = torch::empty({int64_t(t.bytes)}, torch::TensorOptions().dtype(torch::kUInt8).device(dev));
    const torch::Device next(torch::kCUDA, int8_t((gpu + 1) % int(torch::cuda::device_count())));
    auto dst = torch::empty_like(src, torch::TensorOptions().device(next));
    t.copy_s = median_seconds(o.warmup, o.steps, [&] {
      dst.copy_(src);
      torch::cuda::synchronize(dst.device().index());
    });
  }
  store.set("bench_sync_done/" + std::to_string(rank), "1");
  for (int r = 0; r < world; ++r) store.wait({"bench_sync_done/" + std::to_string(r)});
  return t;
}

// Rank 0: every rank's figures (`every` [world, kFigures]: one-GPU tokens/s and peak, dp
// tokens/s and peak, one-GPU and dp step seconds, ep tokens/s, peak and step seconds), rank 0's
// step split of each trainer measured, and the collective weight sync, as a table and as JSON.
// `gpu`: rank 0's device index.
void report(const ParallelBenchOptions& o, const model::glm4_moe_lite::Glm4MoeLiteConfig& cfg, int ep, int gpu,
            const torch::Tensor& every, const std::vector<trainer::Trainer::StepPhases>& phases,
            const WeightSyncTimes& sync) {
  const int world = int(every.size(0));
  const double flops_per_token = 3.0 * glm4_forward_flops(cfg, o.docs, o.tokens / o.docs) / double(o.tokens);
  nlohmann::json J;
  J["layers"] = o.layers;
  J["world"] = world;
  J["tokens_per_gpu"] = o.tokens;
  J["model_tflop_per_token"] = flops_per_token / 1e12;
  J["fsdp"] = o.fsdp;
  J["reshard_after_forward"] = o.reshard_after_forward;
  J["reduce_dtype"] = o.reduce_dtype;
  std::printf("kiln bench parallel: GLM-4.7-Flash dims, %lld layers, bf16 + fp32 masters + AdamW, %d GPUs (NCCL), "
              "%lld tokens per GPU per step, median of %d steps, gradients reduced in %s%s\n",
              (long long)o.layers, world, (long long)o.tokens, o.steps, o.reduce_dtype.c_str(),
              !o.fsdp                   ? ""
              : o.reshard_after_forward ? "; dp and ep trainers with the decoder layers fully sharded (parallel.fsdp)"
                                        : "; dp and ep trainers reducing each layer's gradients in the backward "
                                          "(parallel.fsdp, reshard_after_forward false)");
  std::printf("%-5s | %-17s %-8s | %-20s %-8s %-7s | %-20s %-8s %s\n", "rank", "one GPU tokens/s", "peak GiB",
              "dp tokens/s per GPU", "peak GiB", "/ one", ep > 1 ? "ep tokens/s per GPU" : "", ep > 1 ? "peak GiB" : "",
              ep > 1 ? "/ one" : "");
  double sum_one = 0, sum_dp = 0, sum_ep = 0;
  for (int r = 0; r < world; ++r) {
    auto v = every[r];
    const double one = v[0].item<double>(), dp = v[2].item<double>(), epv = v[6].item<double>();
    sum_one += one;
    sum_dp += dp;
    sum_ep += epv;
    std::printf("%-5d | %-17.0f %-8.1f | %-20.0f %-8.1f %-7.3f", r, one, v[1].item<double>(), dp, v[3].item<double>(),
                dp / one);
    if (ep > 1) std::printf(" | %-20.0f %-8.1f %.3f", epv, v[7].item<double>(), epv / one);
    std::printf("\n");
    J["ranks"].push_back({{"one_gpu_tokens_per_s", one}, {"one_gpu_peak_gib", v[1].item<double>()},
                          {"dp_tokens_per_s_per_gpu", dp}, {"dp_peak_gib", v[3].item<double>()},
                          {"one_gpu_step_s", v[4].item<double>()}, {"dp_step_s", v[5].item<double>()},
                          {"ep_tokens_per_s_per_gpu", epv}, {"ep_peak_gib", v[7].item<double>()},
                          {"ep_step_s", v[8].item<double>()}});
  }
  // Rank 0's own split of a step (phase ends synchronised: a little slower than the medians).
  const char* names[] = {"one GPU", "dp", "ep"};
  for (std::size_t k = 0; k < phases.size(); ++k) {
    const auto& f = phases[k];
    std::printf("rank 0 step split, %-7s: forward %.1f ms, backward %.1f ms, gradient reduction + clip %.1f ms, "
                "optimizer + gathers %.1f ms\n",
                names[k], f.forward * 1e3, f.backward * 1e3, f.reduce * 1e3, f.optimizer * 1e3);
    J["rank0_step_split"][names[k]] = {{"forward_s", f.forward}, {"backward_s", f.backward}, {"reduce_s", f.reduce},
                                       {"optimizer_s", f.optimizer}};
  }
  J["ep"] = ep;
  if (ep > 1) J["ep_over_one_gpu"] = sum_ep / sum_one;
  J["dp_over_one_gpu"] = sum_dp / sum_one;
  if (world > 1) {
    const double sync_gbs = double(sync.bytes) / sync.sync_s / 1e9, copy_gbs = double(sync.bytes) / sync.copy_s / 1e9;
    J["weight_sync_bytes"] = sync.bytes;
    J["weight_sync_s"] = sync.sync_s;
    J["weight_sync_gbs"] = sync_gbs;
    J["plain_copy_gpu0_to_gpu1_gbs"] = copy_gbs;
    std::printf("collective weight sync (NCCL broadcast to %d rank(s), %.0f MiB buckets, checksums on): %.2f GB in "
                "%.1f ms = %.0f GB/s; plain copy GPU %d -> GPU %d of the same bytes: %.0f GB/s; sync / copy = %.2f\n",
                world - 1, o.bucket_mib, double(sync.bytes) / 1e9, sync.sync_s * 1e3, sync_gbs, gpu,
                (gpu + 1) % int(torch::cuda::device_count()), copy_gbs, sync_gbs / copy_gbs);
  }
  std::printf("mean: dp %.0f tokens/s per GPU = %.3f x one GPU (%.0f); whole node %.0f tokens/s\n", sum_dp / world,
              sum_dp / sum_one, sum_one / world, sum_dp);
  if (ep > 1)
    std::printf("mean: ep %d (dense weights data-parallel over %d ranks) %.0f tokens/s per GPU = %.3f x one GPU; whole "
                "node %.0f tokens/s\n",
                ep, world, sum_ep / world, sum_ep / sum_one, sum_ep);
  if (!o.json_path.empty()) std::ofstream(o.json_path) << J.dump(2) << "\n";
}

}  // namespace

int run_parallel_bench(const ParallelBenchOptions& o) {
  if (int bad = check_cuda_and_packing("parallel", o.tokens, o.docs, 4)) return bad;
  parallel::LaunchInfo info;
  std::unique_ptr<parallel::ProcessGroups> groups;
  int ep = 1;
  try {
    info = parallel::read_launch_from_environment();
    ep = o.ep == 0 ? info.world_size : int(o.ep);
    if (info.world_size % ep != 0)
      throw std::invalid_argument("--ep " + std::to_string(ep) + " does not divide the world size " +
                                  std::to_string(info.world_size));
    groups = std::make_unique<parallel::ProcessGroups>(
        info, torch::Device(torch::kCUDA, int8_t(info.local_rank)),
        std::vector<parallel::MeshDim>{{"dp", info.world_size / ep}, {"ep", ep}});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln bench parallel: %s\n", e.what());
    return 2;
  }
  const int rank = info.rank, world = info.world_size, gpu = info.local_rank;
  const torch::Device dev(torch::kCUDA, int8_t(gpu));
  auto cfg = model::glm4_moe_lite::flavors::glm47_flash_layers(o.layers);
  // Every rank of this host builds its model in fp32 on the host at the same time.
  model::check_fits_host_memory(model::glm4_moe_lite::parameter_count(cfg), 4.0 * info.local_world_size,
                                model::host_memory_available_bytes(),
                                "glm4_moe_lite with " + std::to_string(o.layers) + " layers",
                                "in fp32 for the " + std::to_string(info.local_world_size) +
                                    " ranks that build it on this host at once, one copy each");
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

  // Median step time and peak memory of a trainer `make()` builds over a fresh policy, on
  // `samples`; the GPU's cache emptied afterwards so that each measurement starts alike.
  // Then two more steps with the trainer's phase timing on (each phase's end synchronised):
  // the second one's split goes to `phases` (of the measured trainers, in order).
  std::vector<trainer::Trainer::StepPhases> phases;
  auto measure = [&](auto make, const std::vector<trainer::Sample>& samples) {
    std::pair<double, double> r;
    {
      auto tr = make(build());
      reset_peak(gpu);
      r.first = median_seconds(o.warmup, o.steps, [&] { (void)tr->train_step(samples); });
      r.second = peak_gib(gpu);
      tr->time_phases(true);
      for (int k = 0; k < 2; ++k) (void)tr->train_step(samples);
      phases.push_back(tr->last_phases());
    }
#ifdef KILN_CUDA
    c10::cuda::CUDACachingAllocator::emptyCache();
#endif
    return r;
  };
  const auto [one_s, one_peak] =
      measure([&](auto p) { return std::make_unique<trainer::Trainer>(std::move(p), tc); }, share);
  tc.fsdp = o.fsdp;  // the group trainers only
  tc.reshard_after_forward = o.reshard_after_forward;
  tc.reduce_dtype = o.reduce_dtype;
  const auto [dp_s, dp_peak] =
      measure([&](auto p) { return std::make_unique<trainer::Trainer>(std::move(p), tc, &groups->world()); }, all);
  // Expert parallel over ep ranks (the dense weights data-parallel over all of them).
  double ep_s = 0, ep_peak = 0;
  if (ep > 1)
    std::tie(ep_s, ep_peak) = measure(
        [&](auto p) {
          return std::make_unique<trainer::Trainer>(std::move(p), tc, groups->world(),
                                                    trainer::ExpertParallel{&groups->along("ep"), &groups->along("dp")});
        },
        all);
  // Collective weight sync: rank 0 sends, every other rank receives as an engine would.
  WeightSyncTimes sync;
  if (world > 1) sync = time_weight_sync(*groups, build(), o, dev);
  // Every rank's figures to rank 0.
  constexpr int kFigures = 9;
  auto mine = torch::tensor({double(share_tokens) / one_s, one_peak, double(share_tokens) / dp_s, dp_peak, one_s, dp_s,
                             ep > 1 ? double(share_tokens) / ep_s : 0.0, ep_peak, ep_s},
                            torch::TensorOptions().dtype(torch::kFloat64))
                  .to(dev);
  auto every = torch::empty({world * kFigures}, mine.options());
  groups->world().all_gather_into_tensor(every, mine);
  every = every.cpu().view({world, kFigures});
  if (rank == 0) report(o, cfg, ep, gpu, every, phases, sync);
  return 0;
}

}  // namespace kiln::experiments

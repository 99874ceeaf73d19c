#include "experiments/bench_rollout.hpp"
#include "messaging/stopwatch.hpp"

#include <torch/torch.h>
#ifdef KILN_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_profiler_api.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "actors/rollout/decode_graphs.hpp"
#include "actors/rollout/engine.hpp"
#include "kernels/moe_decode.hpp"
#include "model/glm4_moe_lite/model.hpp"
#include "model/registry.hpp"

namespace kiln::experiments {

namespace {

// One (context, batch) point: the engine's median pure-decode step, in seconds, or -1 when the
// device ran out of memory.
// The engine's decode modes the table compares.
// The first five as they were measured before the sampling and experts kernels (both off);
// graphs_sampling, graphs_experts and graphs_all: graphs_kernel with rollout.sampling_kernel,
// rollout.moe_decode_kernel, or both.
// graphs_overlap: graphs_sampling with rollout.overlap_schedule (off in all the others);
// graphs_overlap_all: graphs_all with it.
enum class Mode {
  expanded, absorbed, graphs, kernel, graphs_kernel, graphs_sampling, graphs_experts, graphs_all, graphs_overlap,
  graphs_overlap_all
};

double decode_step_seconds(const std::shared_ptr<model::CausalLM>& model, int64_t vocab, int64_t context, int64_t batch,
                           int64_t new_tokens, Mode mode) {
  std::vector<rollout::GenerationRequest> reqs;
  auto ids = torch::randint(3, vocab, {batch, context}, torch::kInt64);
  for (int64_t i = 0; i < batch; ++i) {
    rollout::GenerationRequest r;
    r.id = uint64_t(i);
    r.prompt.assign(ids[i].data_ptr<int64_t>(), ids[i].data_ptr<int64_t>() + context);
    r.sampling.max_new_tokens = new_tokens;
    r.sampling.seed = uint64_t(i);
    reqs.push_back(std::move(r));
  }
  rollout::EngineOptions eo;
  eo.block_size = 16;
  eo.max_batch = batch;
  eo.max_prefill_tokens = std::max<int64_t>(context, 65536);
  eo.cache_blocks = batch * ((context + new_tokens + 15) / 16);
  eo.absorbed_decode = mode != Mode::expanded;
  const bool later = mode == Mode::graphs_sampling || mode == Mode::graphs_experts || mode == Mode::graphs_all ||
                     mode == Mode::graphs_overlap || mode == Mode::graphs_overlap_all;
  eo.cuda_graphs = mode == Mode::graphs || mode == Mode::graphs_kernel || later;
  eo.mla_decode_kernel = mode == Mode::kernel || mode == Mode::graphs_kernel || later;
  const bool overlap = mode == Mode::graphs_overlap || mode == Mode::graphs_overlap_all;
  eo.sampling_kernel = mode == Mode::graphs_sampling || mode == Mode::graphs_all || overlap;
  eo.overlap_schedule = overlap;
  eo.moe_decode_kernel = mode == Mode::graphs_experts || mode == Mode::graphs_all || mode == Mode::graphs_overlap_all;
  try {
    const messaging::Stopwatch setup;
    rollout::Engine engine(model, eo);
    for (auto& r : reqs) engine.submit(std::move(r));
    const double setup_s = setup.seconds();
    std::vector<double> decode;
    double prefill_s = 0;
    int64_t prefill_steps = 0;
    while (engine.has_work()) {
      const bool pure = engine.waiting() == 0;  // every running sequence has its prompt cached
      const messaging::Stopwatch t;
      engine.step();  // ends with the host read of a step's sampled tokens (with overlap_schedule the next one runs)
      if (pure) {
        decode.push_back(t.seconds());
      } else {
        prefill_s += t.seconds();
        ++prefill_steps;
      }
    }
    double decode_s = 0;
    for (double d : decode) decode_s += d;
    // Where a cell's wall time goes (stderr; the table is stdout): the first graphed step
    // includes its graphs' capture.
    std::fprintf(stderr, "  [context %lld, batch %lld: engine set-up %.2f s, %lld prefill steps %.2f s, %zu decode "
                 "steps %.2f s (the first %.2f s; %lld graphs captured)]\n", (long long)context, (long long)batch,
                 setup_s, (long long)prefill_steps, prefill_s, decode.size(), decode_s, decode.empty() ? 0.0 : decode[0],
                 (long long)engine.graphs_captured());
    if (decode.size() < 3) return 0;
    std::sort(decode.begin(), decode.end());
    return decode[decode.size() / 2];
  } catch (const c10::Error& e) {
    if (std::string(e.what()).find("out of memory") != std::string::npos) return -1;
    if (!eo.cuda_graphs) throw;
    // A capture that failed: the table goes on without this cell (printed as FAILED).
    std::fprintf(stderr, "kiln bench rollout: graphs at context %lld, batch %lld: %s\n", (long long)context,
                 (long long)batch, e.what_without_backtrace());
    return -2;
  }
}

// A GRPO group: `n` samples (own seeds) of one `prompt`-token prompt, `new_tokens` each, with
// rollout.share_prompts off and on, on the same model: prompt tokens prefilled, mean time to
// first token and the wall time of the whole group, printed as a table.
void group_sharing(const std::shared_ptr<model::CausalLM>& model, int64_t prompt, int64_t n, int64_t new_tokens) {
  std::vector<rollout::GenerationRequest> group;
  auto ids = torch::randint(3, model->vocab_size(), {prompt}, torch::kInt64);
  for (int64_t i = 0; i < n; ++i) {
    rollout::GenerationRequest r;
    r.id = uint64_t(i);
    r.prompt.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + prompt);
    r.sampling.max_new_tokens = new_tokens;
    r.sampling.seed = uint64_t(1000 + i);
    group.push_back(std::move(r));
  }
  std::printf("GRPO group: %lld samples of one %lld-token prompt, %lld new tokens each\n", (long long)n,
              (long long)prompt, (long long)new_tokens);
  std::printf("(same_tokens: the shared run's tokens against the unshared run's of the same mode; \"invariant\": the true "
              "on-policy mode's batch-invariant kernels)\n");
  std::printf("%14s %16s %12s %10s %14s\n", "share_prompts", "prefilled_tok", "mean_ttft", "group_s", "same_tokens");
  // Default kernels, then the true on-policy mode (batch-invariant kernels: a shared prompt's
  // rows are computed as the unshared ones', so the tokens are equal in bf16 too).
  const bool invariant_too = model->supports_batch_invariant();
  for (bool invariant : {false, true}) {
    if (invariant && !invariant_too) break;
    std::vector<std::vector<int64_t>> first;
    for (bool share : {false, true}) {
      rollout::EngineOptions eo;
      eo.block_size = 16;
      eo.max_batch = n;
      eo.max_prefill_tokens = n * prompt;
      eo.cache_blocks = n * ((prompt + new_tokens + 15) / 16);
      eo.share_prompts = share;
      eo.true_on_policy = invariant;
      rollout::Engine engine(model, eo);
      const messaging::Stopwatch t;
      auto done = engine.generate(group);
      const double s = t.seconds();
      double ttft = 0;
      std::sort(done.begin(), done.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
      std::vector<std::vector<int64_t>> tokens;
      for (const auto& c : done) {
        ttft += c.time_to_first_token_s / double(done.size());
        tokens.push_back(c.tokens);
      }
      if (!share) first = tokens;
      const char* row = share ? (invariant ? "on, invariant" : "on") : (invariant ? "off, invariant" : "off");
      std::printf("%14s %16lld %11.4fs %9.3fs %14s\n", row, (long long)engine.prefilled_tokens(), ttft, s,
                  share ? (tokens == first ? "yes" : "NO") : "-");
      std::fflush(stdout);
    }
  }
  model->set_batch_invariant(false);
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// --split: where a graphed decode step's time goes (RolloutBenchOptions::split).
void decode_split(const std::shared_ptr<model::CausalLM>& lm, int64_t vocab, const RolloutBenchOptions& o) {
#ifdef KILN_CUDA
  if (!o.split_profile)
    std::printf("%8s %6s %12s %12s %10s %10s %11s %10s %13s %13s\n", "context", "batch", "step_before", "step_after",
                "replay", "sample_ref", "experts_d2h", "rest", "replay+sample", "+experts");
  for (auto P : o.contexts)
    for (auto B : o.batch_sizes) {
      const double step = o.split_profile ? 0 : decode_step_seconds(lm, vocab, P, B, o.new_tokens, Mode::graphs_kernel);
      const double step_all = o.split_profile ? 0 : decode_step_seconds(lm, vocab, P, B, o.new_tokens, Mode::graphs_all);
      const int64_t per_seq = (P + o.new_tokens + 15) / 16, pages = B * per_seq;
      lm->set_absorbed_decode(true);
      lm->set_decode_kernel(true);
      auto cache = lm->make_decode_cache({pages + 1, 16, B}, lm->lm_head_weight().options());
      {
        torch::NoGradGuard ng;
        for (auto& t : dynamic_cast<model::PagedCache&>(*cache).layers) t.normal_(0, 1);  // not zeros
      }
      // Three graphs of the same step: as before the sampling and experts kernels, with the
      // sampling in the graph, and with the decode experts too (captured inside the guard).
      rollout::DecodeGraphs plain(*lm, *cache, 16, /*scratch_page=*/pages, /*max_pages=*/pages);
      rollout::DecodeGraphs sampling(*lm, *cache, 16, pages, pages, /*sample=*/true);
      rollout::DecodeGraphs all(*lm, *cache, 16, pages, pages, /*sample=*/true);
      std::vector<std::vector<int64_t>> tables(static_cast<std::size_t>(B));
      std::vector<const std::vector<int64_t>*> table_ptrs;
      std::vector<int64_t> ids, pos, steps;
      std::vector<rollout::SamplingParams> params(static_cast<std::size_t>(B));
      std::vector<const rollout::SamplingParams*> pp;
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t i = 0; i < per_seq; ++i) tables[std::size_t(b)].push_back(b * per_seq + i);
        table_ptrs.push_back(&tables[std::size_t(b)]);
        ids.push_back(3 + (b * 7919) % (vocab - 3));
        pos.push_back(P);
        params[std::size_t(b)].seed = uint64_t(b);
        pp.push_back(&params[std::size_t(b)]);
        steps.push_back(0);
      }
      auto run_all = [&] {
        const kernels::DecodeExpertsGuard experts(true);
        return all.run(ids, pos, table_ptrs, pp, steps);
      };
      for (int i = 0; i < 3; ++i) {  // capture, warm
        plain.run(ids, pos, table_ptrs);
        sampling.run(ids, pos, table_ptrs, pp, steps);
        run_all();
      }
      torch::cuda::synchronize();
      if (o.split_profile) {  // ncu: one replay of the engine's default graph (sampling in it)
        cudaProfilerStart();
        sampling.run(ids, pos, table_ptrs, pp, steps);
        torch::cuda::synchronize();
        cudaProfilerStop();
        std::printf("profiled one replay: context %lld, batch %lld\n", (long long)P, (long long)B);
        std::fflush(stdout);
        continue;
      }
      std::vector<double> replay_s, sample_s, d2h_s, sampling_s, all_s;
      for (int i = 0; i < 20; ++i) {
        torch::cuda::synchronize();
        messaging::Stopwatch t;
        auto s = plain.run(ids, pos, table_ptrs);
        torch::cuda::synchronize();
        replay_s.push_back(t.seconds());
        t.restart();
        (void)rollout::sample_tokens(s.logits, pp, steps, /*kernel=*/false);  // the reference, after the graph
        sample_s.push_back(t.seconds());
        t.restart();
        auto e = s.routed_experts.to(torch::kCPU);
        d2h_s.push_back(t.seconds());
        t.restart();
        (void)rollout::sampled_tokens(sampling.run(ids, pos, table_ptrs, pp, steps).sampled);
        sampling_s.push_back(t.seconds());
        t.restart();
        (void)rollout::sampled_tokens(run_all().sampled);
        all_s.push_back(t.seconds());
      }
      const double r = median_of(replay_s), sm = median_of(sample_s), d = median_of(d2h_s);
      std::printf("%8lld %6lld %10.3fms %10.3fms %8.3fms %8.3fms %9.3fms %8.3fms %11.3fms %11.3fms\n", (long long)P,
                  (long long)B, step * 1e3, step_all * 1e3, r * 1e3, sm * 1e3, d * 1e3, (step - r - sm - d) * 1e3,
                  median_of(sampling_s) * 1e3, median_of(all_s) * 1e3);
      std::fflush(stdout);
      c10::cuda::CUDACachingAllocator::emptyCache();
    }
#else
  (void)lm;
  (void)vocab;
  (void)o;
  throw std::invalid_argument("--split needs a CUDA build");
#endif
}

int run_rollout_bench_cuda(const RolloutBenchOptions& o) {
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "kiln bench rollout: --device cuda: no CUDA device visible\n");
    return 2;
  }
  const torch::Device dev(torch::kCUDA, 0);
  torch::manual_seed(0);
  double copy_gbs = 0;
  {
    auto src = torch::randn({int64_t(1) << 30}, torch::TensorOptions().device(dev).dtype(torch::kBFloat16));
    auto dst = torch::empty_like(src);
    std::vector<double> t;
    for (int i = 0; i < 8; ++i) {
      torch::cuda::synchronize();
      const messaging::Stopwatch s;
      dst.copy_(src);
      torch::cuda::synchronize();
      if (i >= 2) t.push_back(s.seconds());
    }
    std::sort(t.begin(), t.end());
    copy_gbs = 2.0 * double(src.numel()) * 2 / t[t.size() / 2] / 1e9;  // read + write
  }
  const auto cfg = model::glm4_moe_lite::flavors::glm47_flash_layers(o.layers);
  model::check_fits_host_memory(model::glm4_moe_lite::parameter_count(cfg), 4, model::host_memory_available_bytes(),
                                "glm4_moe_lite with " + std::to_string(o.layers) + " layers",
                                "in fp32 (built on the host, then cast and moved)");
  auto model = std::make_shared<model::glm4_moe_lite::Glm4MoeLiteModel>(cfg);
  model->to(dev);
  model->to_dtype(torch::kBFloat16);
  // Bytes a decode step reads: every weight but the embedding table (B rows of it) and the
  // routed experts (the share a batch touches), in bf16.
  double dense_bytes = 0, expert_bytes = 0;
  for (const auto& p : model->named_parameters()) {
    const double b = double(p.value().numel()) * double(p.value().element_size());
    if (p.key().rfind("embed", 0) == 0) continue;
    if (p.key().find(".moe.experts.") != std::string::npos) expert_bytes += b;
    else dense_bytes += b;
  }
  const double E = double(cfg.moe.num_experts), K = double(cfg.moe.top_k);
  const double cache_entry = double(model->cache_width()) * 2.0 * double(cfg.num_hidden_layers);  // bytes per token
  std::printf("kiln bench rollout: %s, GLM-4.7-Flash dims, %lld layers, bf16, %lld new tokens per request; copy rate "
              "%.0f GB/s (read+write), weights %.2f GB (routed experts %.2f GB)\n",
              torch::cuda::device_count() > 0 ? "CUDA" : "", (long long)o.layers, (long long)o.new_tokens, copy_gbs,
              (dense_bytes + expert_bytes) / 1e9, expert_bytes / 1e9);
  if (o.split) {
    (void)decode_step_seconds(model, cfg.vocab_size, 64, 2, 4, Mode::graphs_kernel);  // warm-up
    decode_split(model, cfg.vocab_size, o);
    return 0;
  }
  std::vector<std::pair<Mode, const char*>> modes;
  for (const auto& m : o.modes) {
    if (m == "expanded") modes.emplace_back(Mode::expanded, "expanded");
    else if (m == "absorbed") modes.emplace_back(Mode::absorbed, "absorbed");
    else if (m == "graphs") modes.emplace_back(Mode::graphs, "graphs");
    else if (m == "kernel") modes.emplace_back(Mode::kernel, "kernel");
    else if (m == "graphs-kernel") modes.emplace_back(Mode::graphs_kernel, "graphs-kernel");
    else if (m == "graphs-sampling") modes.emplace_back(Mode::graphs_sampling, "graphs-sampling");
    else if (m == "graphs-experts") modes.emplace_back(Mode::graphs_experts, "graphs-experts");
    else if (m == "graphs-all") modes.emplace_back(Mode::graphs_all, "graphs-all");
    else if (m == "graphs-overlap") modes.emplace_back(Mode::graphs_overlap, "graphs-overlap");
    else if (m == "graphs-overlap-all") modes.emplace_back(Mode::graphs_overlap_all, "graphs-overlap-all");
    else throw std::invalid_argument("--modes: '" + m + "' is not expanded, absorbed, graphs, kernel, graphs-kernel, "
                                     "graphs-sampling, graphs-experts, graphs-all, graphs-overlap or graphs-overlap-all");
  }
  if (modes.empty()) throw std::invalid_argument("--modes: none given");
  std::printf("%8s %6s %10s", "context", "batch", "roofline");
  for (const auto& [m, name] : modes) std::printf(" %13s %12s %11s", name, "tok/s", "of_limit");
  std::printf(" %9s\n", "speedup");  // the last mode against the first
  for (const auto& [m, name] : modes) (void)decode_step_seconds(model, cfg.vocab_size, 64, 2, 4, m);  // warm-up
  for (auto P : o.contexts)
    for (auto B : o.batch_sizes) {
      const double touched = E * (1.0 - std::pow(1.0 - K / E, double(B))) / E;
      const double bytes = dense_bytes + expert_bytes * touched + double(B) * (double(P) + double(o.new_tokens) / 2) * cache_entry;
      const double limit_s = bytes / (copy_gbs * 1e9);
      std::vector<double> t(modes.size());
      for (std::size_t a = 0; a < modes.size(); ++a) {
        t[a] = decode_step_seconds(model, cfg.vocab_size, P, B, o.new_tokens, modes[a].first);
#ifdef KILN_CUDA
        c10::cuda::CUDACachingAllocator::emptyCache();  // the other mode's cache pages and buffers
#endif
      }
      auto cell = [&](double s) {
        char buf[64];
        if (s < 0) std::snprintf(buf, sizeof buf, "%13s %12s %11s", s < -1.5 ? "FAILED" : "OOM", "-", "-");
        else std::snprintf(buf, sizeof buf, "%11.2fms %12.0f %10.1f%%", s * 1e3, double(B) / s, 100.0 * limit_s / s);
        return std::string(buf);
      };
      std::printf("%8lld %6lld %8.2fms", (long long)P, (long long)B, limit_s * 1e3);
      for (double x : t) std::printf(" %s", cell(x).c_str());
      std::printf(" %8.2fx\n", t.front() > 0 && t.back() > 0 ? t.front() / t.back() : 0.0);
      std::fflush(stdout);
    }
  group_sharing(model, 2048, 8, o.new_tokens);
  return 0;
}

int run_rollout_bench_cpu(const RolloutBenchOptions& o);

}  // namespace

int run_rollout_bench(const RolloutBenchOptions& o) {
  try {
    return o.device == "cuda" ? run_rollout_bench_cuda(o) : run_rollout_bench_cpu(o);
  } catch (const c10::Error& e) {  // e.g. a cache that does not fit: without LibTorch's backtrace
    std::fprintf(stderr, "kiln bench rollout: %s\n", e.what_without_backtrace());
    return 2;
  } catch (const std::exception& e) {  // e.g. an unknown flavor
    std::fprintf(stderr, "kiln bench rollout: %s\n", e.what());
    return 2;
  }
}

namespace {

int run_rollout_bench_cpu(const RolloutBenchOptions& o) {
  if (o.device != "cpu") {
    std::fprintf(stderr, "kiln bench rollout: --device must be cpu or cuda, not '%s'\n", o.device.c_str());
    return 2;
  }
  torch::manual_seed(0);
  const auto cfg = model::glm4_moe_lite::flavors::by_name(o.flavor);
  model::check_fits_host_memory(model::glm4_moe_lite::parameter_count(cfg), 4, model::host_memory_available_bytes(),
                                "glm4_moe_lite/" + o.flavor, "in fp32");
  auto model = std::make_shared<model::glm4_moe_lite::Glm4MoeLiteModel>(cfg);
  std::printf("kiln bench rollout: glm4_moe_lite/%s, prompt %lld tokens, %lld new tokens per request (no early stop), "
              "CPU %d threads\n",
              o.flavor.c_str(), (long long)o.prompt_tokens, (long long)o.new_tokens, torch::get_num_threads());
  {  // warm-up: first-call allocations and thread pools, outside any measurement
    rollout::GenerationRequest w;
    w.prompt = {3, 4, 5};
    w.sampling.max_new_tokens = 4;
    rollout::Engine(model, rollout::EngineOptions{}).generate({w});
    rollout::generate_without_cache(*model, {w});
  }
  std::printf("%6s %16s %12s %18s %14s %9s\n", "batch", "engine_tok/s", "engine_ttft", "no_cache_tok/s", "no_cache_ttft",
              "speedup");
  for (auto B : o.batch_sizes) {
    std::vector<rollout::GenerationRequest> reqs;
    for (int64_t i = 0; i < B; ++i) {
      rollout::GenerationRequest r;
      r.id = uint64_t(i);
      for (int64_t t = 0; t < o.prompt_tokens; ++t) r.prompt.push_back(3 + (i * 31 + t * 7) % (model->vocab_size() - 3));
      r.sampling.max_new_tokens = o.new_tokens;
      r.sampling.seed = uint64_t(i);
      reqs.push_back(r);
    }
    rollout::EngineOptions eo;
    eo.block_size = 16;
    eo.max_batch = B;
    eo.cache_blocks = B * ((o.prompt_tokens + o.new_tokens + 15) / 16);
    rollout::Engine engine(model, eo);
    messaging::Stopwatch t0;
    auto done = engine.generate(reqs);
    double engine_s = t0.seconds();
    double ttft = 0;
    for (const auto& c : done) ttft += c.time_to_first_token_s / double(done.size());
    t0.restart();
    auto ref = rollout::generate_without_cache(*model, reqs);
    double ref_s = t0.seconds();
    double ref_ttft = 0;
    for (const auto& c : ref) ref_ttft += c.time_to_first_token_s / double(ref.size());
    const double tokens = double(B * o.new_tokens);
    std::printf("%6lld %16.1f %11.4fs %18.1f %13.4fs %8.2fx\n", (long long)B, tokens / engine_s, ttft, tokens / ref_s,
                ref_ttft, ref_s / engine_s);
    std::fflush(stdout);
  }
  group_sharing(model, 2048, 8, o.new_tokens);
  return 0;
}

}  // namespace

}  // namespace kiln::experiments

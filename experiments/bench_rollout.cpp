#include "experiments/bench_rollout.hpp"
#include "messaging/stopwatch.hpp"

#include <torch/torch.h>

#include <chrono>
#include <cstdio>

#include "actors/rollout/engine.hpp"
#include "model/glm4_moe_lite/model.hpp"

namespace kiln::experiments {

int run_rollout_bench(const RolloutBenchOptions& o) {
  torch::manual_seed(0);
  auto model = std::make_shared<model::glm4_moe_lite::Glm4MoeLiteModel>(model::glm4_moe_lite::flavors::by_name(o.flavor));
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
  return 0;
}

}  // namespace kiln::experiments

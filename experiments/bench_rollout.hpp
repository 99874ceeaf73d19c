#pragma once
// `kiln bench rollout`: decode tokens/s and time-to-first-token of the in-process engine
// (paged latent cache, continuous batching) for several batch sizes on a glm4_moe_lite
// flavor, beside a no-cache baseline (every step re-runs the packed forward over all live
// sequences) measured in the same run on the same requests.
#include <cstdint>
#include <string>
#include <vector>

namespace kiln::experiments {

struct RolloutBenchOptions {
  std::vector<int64_t> batch_sizes = {1, 8, 32, 64};
  int64_t prompt_tokens = 16;
  int64_t new_tokens = 32;
  std::string flavor = "debug";
};

int run_rollout_bench(const RolloutBenchOptions& options);

}  // namespace kiln::experiments

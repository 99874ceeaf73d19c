#pragma once
// `kiln bench glm5`: a GLM-5.3-Flash (glm5_next) training step on one CUDA GPU in bf16, at a
// flavor's dimensions (default glm53_flash_5l: the validation crop, 5 main layers + the MTP
// layer at published widths, ~25B parameters), random weights drawn on the GPU:
//  - forward + backward of one packed micro-batch (`docs` documents, `tokens` in all): the mean
//    next-token cross-entropy, without and with the MTP loss (algorithm.mtp_loss_weight's
//    model::mtp_loss over `mtp_depths` depths): train tokens/s and peak allocated memory;
//  - the same plus a plain SGD update in bf16 (p -= lr * grad, one multi-tensor launch): a
//    "step" that fits one GPU. kiln's trainer step (fp32 masters + AdamW: 12 bytes per
//    parameter more, ~300 GB at 25B) does not fit one H200 and glm5_next has no expert
//    parallel or fully sharded layers yet, so it is not measured here.
// Prints a table; with json_path writes every number as JSON. At 4096 tokens the crop peaks at
// 134.6 GiB on an H200 and needs PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (without it
// the backward ran out of memory on fragmentation: docs/benchmarks.md).
#include <cstdint>
#include <string>

namespace kiln::experiments {

struct Glm5BenchOptions {
  std::string flavor = "glm53_flash_5l";
  int64_t tokens = 4096, docs = 4;
  int steps = 3, warmup = 1;
  int64_t mtp_depths = 1;
  double mtp_loss_weight = 0.3;
  std::string json_path;
};

int run_glm5_bench(const Glm5BenchOptions& options);

}  // namespace kiln::experiments

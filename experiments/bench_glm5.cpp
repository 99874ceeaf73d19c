#include "experiments/bench_glm5.hpp"

#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "experiments/bench_cuda.hpp"
#include "messaging/stopwatch.hpp"
#include "model/blocks/logprobs.hpp"
#include "model/glm5_next/model.hpp"
#include "model/registry.hpp"

namespace kiln::experiments {

int run_glm5_bench(const Glm5BenchOptions& o) {
  if (int bad = check_cuda_and_packing("glm5", o.tokens, o.docs, 2)) return bad;
  const torch::Device dev(torch::kCUDA, 0);
  nlohmann::json J;
  torch::manual_seed(0);
  auto cfg = model::glm5_next::flavors::by_name(o.flavor);
  J["flavor"] = o.flavor;

  // The model: built on the CPU in bf16 (the default dtype while it is made: half the bytes
  // and time of fp32 at 25B parameters) with the modules' own initialisation (routed experts
  // zero), moved, cast as to_dtype keeps it (fp32 where transformers keeps fp32), then every
  // matrix drawn normal(0, 0.02) on the GPU.
  model::check_fits_host_memory(model::glm5_next::parameter_count(cfg), 2, model::host_memory_available_bytes(),
                                "glm5_next/" + o.flavor, "in bf16 (built on the host, then moved)");
  const messaging::Stopwatch build_clock;
  const auto default_dtype = torch::get_default_dtype();
  torch::set_default_dtype(caffe2::TypeMeta::Make<at::BFloat16>());
  std::shared_ptr<model::glm5_next::Glm5NextModelImpl> m;
  try {
    m = std::make_shared<model::glm5_next::Glm5NextModelImpl>(cfg);
  } catch (...) {
    torch::set_default_dtype(default_dtype);
    throw;
  }
  torch::set_default_dtype(default_dtype);
  m->to(dev);
  m->to_dtype(torch::kBFloat16);
  m->init_random_weights();
  torch::cuda::synchronize();
  const double build_s = build_clock.seconds();
  int64_t params = 0, trained = 0, mtp_params = 0;
  for (const auto& p : m->parameters()) {
    params += p.numel();
    if (p.requires_grad()) trained += p.numel();
  }
  for (const auto& p : m->mtp_parameters()) mtp_params += p.numel();
  J["parameters"] = params;
  J["trained_parameters"] = trained;
  J["mtp_parameters"] = mtp_params;
  J["build_seconds"] = build_s;
  const double weights_gib = peak_gib();
  J["weights_gib"] = weights_gib;

  auto batch = random_packed_documents(o.tokens, o.docs, cfg.vocab_size);
  auto targets = model::next_token_targets(batch.input_ids, batch.cu_seqlens).to(dev);
  auto supervised = model::next_token_targets(batch.input_ids, batch.cu_seqlens).ge(0);  // [T] bool
  const double predicted = supervised.sum().item<double>();
  const bool with_mtp = m->mtp_layers() > 0;

  std::vector<torch::Tensor> trained_params;
  for (const auto& p : m->parameters())
    if (p.requires_grad()) trained_params.push_back(p);
  double last_loss = 0, last_mtp = 0;
  auto forward_backward = [&](bool mtp) {
    for (auto& p : trained_params) p.mutable_grad() = torch::Tensor();  // set_to_none
    auto out = m->forward(batch);
    auto loss = -model::token_logprobs(out.hidden, m->lm_head->weight, targets).sum() / predicted;
    if (mtp) {
      auto r = model::mtp_loss(*m, batch, out.hidden, supervised, o.mtp_depths, o.mtp_loss_weight, predicted);
      last_mtp = r.loss.item<double>();
      loss = loss + r.loss;
    }
    loss.backward();
    last_loss = loss.item<double>();
  };
  auto sgd = [&] {
    torch::NoGradGuard ng;
    std::vector<torch::Tensor> p, g;
    for (auto& t : trained_params)
      if (t.grad().defined()) {
        p.push_back(t);
        g.push_back(t.grad());
      }
    torch::_foreach_add_(p, g, -1e-5);
  };
  struct Row {
    const char* what;
    double seconds, peak;
  };
  std::vector<Row> rows;
  auto measure = [&](const char* what, auto fn) {
    reset_peak();
    const double s = median_seconds(o.warmup, o.steps, fn);
    rows.push_back({what, s, peak_gib()});
  };
  measure("forward+backward, next-token loss", [&] { forward_backward(false); });
  J["loss"] = last_loss;
  if (with_mtp) {
    measure("forward+backward, + MTP loss", [&] { forward_backward(true); });
    J["loss_with_mtp"] = last_loss;
    J["mtp_loss_term"] = last_mtp;
  }
  measure(with_mtp ? "forward+backward (+ MTP) + bf16 SGD update" : "forward+backward + bf16 SGD update", [&] {
    forward_backward(with_mtp);
    sgd();
  });

  std::printf("kiln bench glm5: %s on %s, bf16, %lld tokens in %lld documents, %s\n", o.flavor.c_str(),
              torch::cuda::device_count() > 0 ? "CUDA:0" : "?", (long long)o.tokens, (long long)o.docs,
              with_mtp ? ("MTP depths " + std::to_string(o.mtp_depths) + ", weight " + std::to_string(o.mtp_loss_weight)).c_str()
                       : "no MTP layer");
  std::printf("  parameters %.2f B (%.2f B trained, MTP layer %.2f B), weights %.1f GiB, built in %.1f s\n",
              double(params) / 1e9, double(trained) / 1e9, double(mtp_params) / 1e9, weights_gib, build_s);
  std::printf("  %-48s %10s %12s %12s\n", "what", "seconds", "tokens/s", "peak GiB");
  nlohmann::json R = nlohmann::json::array();
  for (const auto& r : rows) {
    std::printf("  %-48s %10.3f %12.0f %12.1f\n", r.what, r.seconds, double(o.tokens) / r.seconds, r.peak);
    R.push_back({{"what", r.what}, {"seconds", r.seconds}, {"tokens_per_s", double(o.tokens) / r.seconds}, {"peak_gib", r.peak}});
  }
  J["rows"] = R;
  J["tokens"] = o.tokens;
  J["docs"] = o.docs;
  if (!o.json_path.empty()) std::ofstream(o.json_path) << J.dump(2) << "\n";
  return 0;
}

}  // namespace kiln::experiments

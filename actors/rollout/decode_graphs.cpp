#include "actors/rollout/decode_graphs.hpp"

#include <stdexcept>

#include "kernels/sampling.hpp"


namespace kiln::rollout {

DecodeGraphs::DecodeGraphs(model::CausalLM& model, model::DecodeCache& cache, int64_t page_size, int64_t scratch_page,
                           int64_t max_pages, bool sample)
    : model_(model),
      cache_(cache),
      page_size_(page_size),
      scratch_page_(scratch_page),
      max_pages_(max_pages),
      sample_(sample),
      device_(model.lm_head_weight().device()) {
  if (!device_.is_cuda())
    throw std::invalid_argument("rollout.cuda_graphs: the model is on " + device_.str() +
                                "; CUDA graphs need a model on a CUDA device");
  if (!kernels::CapturedGraph::available())
    throw std::invalid_argument("rollout.cuda_graphs: this build cannot capture CUDA graphs (no CUDA kernels or no "
                                "CUDA device visible)");
  if (!model.has_device_decode())
    throw std::invalid_argument("rollout.cuda_graphs: this model has no decode step on device tensors "
                                "(CausalLM::forward_decode)");
  if (page_size < 1 || scratch_page < 0 || max_pages < 1)
    throw std::invalid_argument("DecodeGraphs: page_size " + std::to_string(page_size) + ", scratch page " +
                                std::to_string(scratch_page) + ", max_pages " + std::to_string(max_pages) +
                                ": need >= 1, >= 0, >= 1");
  pool_ = kernels::GraphPool::make();
  for (const auto& p : model.named_parameters(/*recurse=*/true)) weights_.push_back({p.key(), p.value(), p.value().data_ptr()});
  for (const auto& b : model.named_buffers(/*recurse=*/true)) weights_.push_back({b.key(), b.value(), b.value().data_ptr()});
}

int64_t DecodeGraphs::batch_bucket(int64_t batch) {
  if (batch < 1) throw std::invalid_argument("DecodeGraphs::batch_bucket: batch " + std::to_string(batch) + " < 1");
  int64_t b = 1;
  while (b < batch) b *= 2;
  return b;
}

int64_t DecodeGraphs::pages_bucket(int64_t pages, int64_t max_pages) {
  if (pages < 1) throw std::invalid_argument("DecodeGraphs::pages_bucket: pages " + std::to_string(pages) + " < 1");
  if (pages <= 8) return pages;
  int64_t octave = 1;  // 2^floor(log2 pages)
  while (octave * 2 <= pages) octave *= 2;
  const int64_t step = octave / 8;
  return std::max(pages, std::min((pages + step - 1) / step * step, max_pages));
}

void DecodeGraphs::check_weights() const {
  for (const auto& w : weights_)
    if (w.tensor.data_ptr() != w.address)
      throw std::logic_error("rollout.cuda_graphs: the model's '" + w.name +
                             "' is no longer where the captured decode graphs read it (it was reallocated, not "
                             "written in place): weight updates must copy into the parameters");
}

DecodeGraphs::Graph& DecodeGraphs::graph_for(int64_t Bb, int64_t Wb) {
  auto& slot = graphs_[{Bb, Wb}];
  if (slot) return *slot;
  auto g = std::make_unique<Graph>();
  const auto i64 = torch::TensorOptions().dtype(torch::kInt64);
  g->staging = torch::empty({Bb * (2 + Wb + 5)}, i64.pinned_memory(true));
  g->inputs = torch::empty({Bb * (2 + Wb + 5)}, i64.device(device_));
  g->ids = g->inputs.narrow(0, 0, Bb);
  g->positions = g->inputs.narrow(0, Bb, Bb);
  g->table = g->inputs.narrow(0, 2 * Bb, Bb * Wb).view({Bb, Wb});
  g->sampling = g->inputs.narrow(0, (2 + Wb) * Bb, 5 * Bb);
  // Inert rows for the warm-up and the capture: token 0 at position 0 on the scratch page,
  // sampled greedily.
  g->ids.zero_();
  g->positions.zero_();
  g->table.fill_(scratch_page_);
  {
    auto five = torch::empty({5 * Bb}, i64);
    write_sampling_rows({}, {}, five.data_ptr<int64_t>(), Bb);
    g->sampling.copy_(five);
  }
  const SamplingRows rows(g->sampling);
  torch::NoGradGuard no_grad;
  auto body = [&] {
    auto out = model_.forward_decode(g->ids, g->positions, g->table, cache_, /*want_routing=*/true);
    g->logits = model_.fp32_logits(out.hidden);                         // [Bb, V] fp32
    g->routed_experts = out.routed_experts;                              // [Bb, L, K]
    if (sample_) {
      // The warm-up runs this eagerly, so a vocabulary past the kernel's is refused before the
      // capture (the reference sampler reads the host, which a graph cannot hold).
      if (!kernels::sample_rows_uses_kernel(g->logits))
        throw std::invalid_argument("rollout.sampling_kernel with rollout.cuda_graphs: the sampling kernel takes fp32 "
                                    "CUDA logits of up to " + std::to_string(kernels::kSampleKernelMaxVocab) + " tokens a row, these are " +
                                    std::to_string(g->logits.size(1)) + " on " + g->logits.device().str() +
                                    ": set rollout.sampling_kernel = false");
      g->sampled = rows.sample(g->logits);  // [Bb, 3] fp64
    }
  };
  g->graph = std::make_unique<kernels::CapturedGraph>(device_, pool_, body);
  slot = std::move(g);
  return *slot;
}

DecodeGraphs::Step DecodeGraphs::run(const std::vector<int64_t>& ids, const std::vector<int64_t>& positions,
                                     const std::vector<const std::vector<int64_t>*>& pages,
                                     const std::vector<const SamplingParams*>& params,
                                     const std::vector<int64_t>& steps) {
  const int64_t B = int64_t(ids.size());
  if (sample_ ? (int64_t(params.size()) != B || int64_t(steps.size()) != B) : (!params.empty() || !steps.empty()))
    throw std::invalid_argument("DecodeGraphs::run: " + std::to_string(params.size()) + " sampling params and " +
                                std::to_string(steps.size()) + " steps for " + std::to_string(B) + " rows (graphs " +
                                (sample_ ? "that sample: need one each" : "that do not sample: need none") + ")");
  if (B < 1 || positions.size() != ids.size() || pages.size() != ids.size())
    throw std::invalid_argument("DecodeGraphs::run: " + std::to_string(ids.size()) + " ids, " +
                                std::to_string(positions.size()) + " positions and " + std::to_string(pages.size()) +
                                " page tables: need the same number >= 1");
  check_weights();
  int64_t W = 1;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t need = positions[std::size_t(b)] / page_size_ + 1;
    if (positions[std::size_t(b)] < 0 || !pages[std::size_t(b)] || int64_t(pages[std::size_t(b)]->size()) < need)
      throw std::invalid_argument("DecodeGraphs::run: sequence " + std::to_string(b) + " at position " +
                                  std::to_string(positions[std::size_t(b)]) + " needs " + std::to_string(need) +
                                  " pages of " + std::to_string(page_size_) + " tokens");
    W = std::max(W, need);
  }
  const int64_t Bb = batch_bucket(B), Wb = pages_bucket(W, max_pages_);
  auto& g = graph_for(Bb, Wb);
  auto* h = g.staging.data_ptr<int64_t>();
  for (int64_t b = 0; b < Bb; ++b) {
    const bool real = b < B;
    h[b] = real ? ids[std::size_t(b)] : 0;
    h[Bb + b] = real ? positions[std::size_t(b)] : 0;
    int64_t* row = h + 2 * Bb + b * Wb;
    int64_t k = 0;
    if (real) {
      const auto& p = *pages[std::size_t(b)];
      const int64_t used = std::min<int64_t>(int64_t(p.size()), Wb);
      for (; k < used; ++k) row[k] = p[std::size_t(k)];
    }
    for (; k < Wb; ++k) row[k] = scratch_page_;
  }
  if (sample_) write_sampling_rows(params, steps, h + (2 + Wb) * Bb, Bb);
  // A blocking copy: the staging buffer may be refilled as soon as this returns.
  g.inputs.copy_(g.staging, /*non_blocking=*/false);
  g.graph->replay();
  ++replays_;
  return Step{g.logits.narrow(0, 0, B), g.routed_experts.narrow(0, 0, B),
              sample_ ? g.sampled.narrow(0, 0, B) : torch::Tensor()};
}

}  // namespace kiln::rollout

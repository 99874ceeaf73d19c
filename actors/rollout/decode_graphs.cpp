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

DecodeGraphs::~DecodeGraphs() {
  try {
    if (last_ready_) last_ready_->synchronize();
  } catch (...) {  // a device error surfaces at the next CUDA call; a destructor must not throw
  }
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
  g->inputs = torch::empty({Bb * (2 + Wb + 5 + 1)}, torch::TensorOptions().dtype(torch::kInt64).device(device_));
  g->ids = g->inputs.narrow(0, 0, Bb);
  g->positions = g->inputs.narrow(0, Bb, Bb);
  g->table = g->inputs.narrow(0, 2 * Bb, Bb * Wb).view({Bb, Wb});
  g->sampling = g->inputs.narrow(0, (2 + Wb) * Bb, 5 * Bb);
  g->id_rows = g->inputs.narrow(0, (7 + Wb) * Bb, Bb);
  // Inert rows for the warm-up and the capture: token 0 at position 0 on the scratch page,
  // sampled greedily.
  g->ids.zero_();
  g->positions.zero_();
  g->table.fill_(scratch_page_);
  {
    auto five = torch::empty({5 * Bb}, torch::kInt64);
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

DecodeGraphs::Graph& DecodeGraphs::stage(const std::vector<int64_t>* host_ids, const SampledIds* from,
                                         const std::vector<int64_t>& positions,
                                         const std::vector<const std::vector<int64_t>*>& pages,
                                         const std::vector<const SamplingParams*>& params,
                                         const std::vector<int64_t>& steps) {
  const int64_t B = int64_t(positions.size());
  const int64_t n_ids = host_ids ? int64_t(host_ids->size()) : int64_t(from->rows.size());
  if (sample_ ? (int64_t(params.size()) != B || int64_t(steps.size()) != B) : (!params.empty() || !steps.empty()))
    throw std::invalid_argument("DecodeGraphs::run: " + std::to_string(params.size()) + " sampling params and " +
                                std::to_string(steps.size()) + " steps for " + std::to_string(B) + " rows (graphs " +
                                (sample_ ? "that sample: need one each" : "that do not sample: need none") + ")");
  if (B < 1 || n_ids != B || int64_t(pages.size()) != B)
    throw std::invalid_argument("DecodeGraphs::run: " + std::to_string(n_ids) + " ids, " + std::to_string(B) +
                                " positions and " + std::to_string(pages.size()) +
                                " page tables: need the same number >= 1");
  if (from) {
    if (!from->from || from->from->serial != launches_ || launches_ == 0)
      throw std::invalid_argument("DecodeGraphs::launch: ids sampled by launch " +
                                  std::to_string(from->from ? from->from->serial : 0) +
                                  ", not by the last one (" + std::to_string(launches_) +
                                  "): its graph's outputs may have been overwritten since");
    for (auto r : from->rows)
      if (r < 0 || r >= from->from->rows)
        throw std::invalid_argument("DecodeGraphs::launch: id row " + std::to_string(r) + " of a launch of " +
                                    std::to_string(from->from->rows) + " rows");
  }
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
  // Fresh pinned memory each step: the copy below is queued, not done, when this returns, and
  // the host allocator keeps the buffer until it has run (its event) even after it is dropped.
  auto staging = torch::empty({g.inputs.numel()}, torch::TensorOptions().dtype(torch::kInt64).pinned_memory(true));
  auto* h = staging.data_ptr<int64_t>();
  for (int64_t b = 0; b < Bb; ++b) {
    const bool real = b < B;
    h[b] = real && host_ids ? (*host_ids)[std::size_t(b)] : 0;
    h[Bb + b] = real ? positions[std::size_t(b)] : 0;
    int64_t* row = h + 2 * Bb + b * Wb;
    int64_t k = 0;
    if (real) {
      const auto& p = *pages[std::size_t(b)];
      const int64_t used = std::min<int64_t>(int64_t(p.size()), Wb);
      for (; k < used; ++k) row[k] = p[std::size_t(k)];
    }
    for (; k < Wb; ++k) row[k] = scratch_page_;
    h[(7 + Wb) * Bb + b] = real && from ? from->rows[std::size_t(b)] : 0;
  }
  if (sample_) write_sampling_rows(params, steps, h + (2 + Wb) * Bb, Bb);
  g.inputs.copy_(staging, /*non_blocking=*/true);
  if (from) {  // the previous step's sampled ids (fp64 [., 3], column 0) into this step's ids
    bool identity = true;
    for (int64_t b = 0; b < B; ++b) identity = identity && from->rows[std::size_t(b)] == b;
    auto sampled = identity ? from->from->sampled_device.narrow(0, 0, B)
                            : from->from->sampled_device.index_select(0, g.id_rows.narrow(0, 0, B));
    g.ids.narrow(0, 0, B).copy_(sampled.select(1, 0));
  }
  return g;
}

DecodeGraphs::Step DecodeGraphs::run(const std::vector<int64_t>& ids, const std::vector<int64_t>& positions,
                                     const std::vector<const std::vector<int64_t>*>& pages,
                                     const std::vector<const SamplingParams*>& params,
                                     const std::vector<int64_t>& steps) {
  auto& g = stage(&ids, nullptr, positions, pages, params, steps);
  const int64_t B = int64_t(ids.size());
  g.graph->replay();
  ++replays_;
  ++launches_;  // its outputs overwrite what an earlier launch's SampledIds would read
  return Step{g.logits.narrow(0, 0, B), g.routed_experts.narrow(0, 0, B),
              sample_ ? g.sampled.narrow(0, 0, B) : torch::Tensor()};
}

DecodeGraphs::Launched DecodeGraphs::launch(const std::vector<int64_t>& ids, const std::vector<int64_t>& positions,
                                            const std::vector<const std::vector<int64_t>*>& pages,
                                            const std::vector<const SamplingParams*>& params,
                                            const std::vector<int64_t>& steps) {
  if (!sample_) throw std::logic_error("DecodeGraphs::launch: these graphs do not sample (launch needs sample = true)");
  auto& g = stage(&ids, nullptr, positions, pages, params, steps);
  return queue(g, int64_t(ids.size()));
}

DecodeGraphs::Launched DecodeGraphs::launch(const SampledIds& ids, const std::vector<int64_t>& positions,
                                            const std::vector<const std::vector<int64_t>*>& pages,
                                            const std::vector<const SamplingParams*>& params,
                                            const std::vector<int64_t>& steps) {
  if (!sample_) throw std::logic_error("DecodeGraphs::launch: these graphs do not sample (launch needs sample = true)");
  auto& g = stage(nullptr, &ids, positions, pages, params, steps);
  return queue(g, int64_t(ids.rows.size()));
}

DecodeGraphs::Launched DecodeGraphs::queue(Graph& g, int64_t B) {
  g.graph->replay();
  ++replays_;
  Launched l;
  l.rows = B;
  l.serial = ++launches_;
  l.sampled_device = g.sampled.narrow(0, 0, B);
  const auto pinned = torch::TensorOptions().pinned_memory(true);
  l.sampled_host = torch::empty({B, 3}, pinned.dtype(torch::kFloat64));
  l.experts_host = torch::empty({B, g.routed_experts.size(1), g.routed_experts.size(2)}, pinned.dtype(torch::kInt64));
  l.sampled_host.copy_(l.sampled_device, /*non_blocking=*/true);
  l.experts_host.copy_(g.routed_experts.narrow(0, 0, B), /*non_blocking=*/true);
  l.ready = std::make_shared<kernels::StreamEvent>(device_);
  last_ready_ = l.ready;
  return l;
}

DecodeGraphs::Read DecodeGraphs::read(const Launched& step) {
  if (!step.ready) throw std::invalid_argument("DecodeGraphs::read: a step that was not launched");
  step.ready->synchronize();
  return Read{sampled_tokens(step.sampled_host), step.experts_host};
}

}  // namespace kiln::rollout

#include "model/blocks/moe_ep.hpp"

#include <stdexcept>
#include <string>

namespace kiln::model {

namespace {
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::vector<int64_t> to_vector(const torch::Tensor& t) {
  auto c = t.to(torch::kCPU, torch::kInt64).contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

torch::Tensor exchange(const torch::Tensor& x, parallel::Group& group, const std::vector<int64_t>& output_rows,
                       const std::vector<int64_t>& input_rows) {
  std::vector<int64_t> out_shape = x.sizes().vec();
  int64_t rows = 0;
  for (auto r : output_rows) rows += r;
  out_shape[0] = rows;
  auto out = torch::empty(out_shape, x.options());
  group.all_to_all(out, x.contiguous(), output_rows, input_rows);
  return out;
}

// The all-to-all as an autograd node: the gradient of the rows a rank received goes back to
// the rank that sent them, by the same all-to-all with the counts swapped.
struct AllToAllRows : public torch::autograd::Function<AllToAllRows> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, parallel::Group* group,
                               const std::vector<int64_t>& output_rows, const std::vector<int64_t>& input_rows) {
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(group);
    ctx->saved_data["output_rows"] = output_rows;
    ctx->saved_data["input_rows"] = input_rows;
    return exchange(x, *group, output_rows, input_rows);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* group = reinterpret_cast<parallel::Group*>(ctx->saved_data["group"].toInt());
    // Entered by every rank of the group: a zero-row gradient still takes part.
    auto g = exchange(grads[0], *group, ctx->saved_data["input_rows"].toIntVector(),
                      ctx->saved_data["output_rows"].toIntVector());
    return {g, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};
}  // namespace

torch::Tensor all_to_all_rows(const torch::Tensor& x, parallel::Group& group, const std::vector<int64_t>& output_rows,
                              const std::vector<int64_t>& input_rows) {
  return AllToAllRows::apply(x, &group, output_rows, input_rows);
}

RankDispatched dispatch_to_ranks(const Dispatched& d, parallel::Group& ep) {
  const int64_t P = ep.size(), E = d.counts.numel();
  if (d.counts.dim() != 1 || E % P != 0)
    throw std::invalid_argument("dispatch_to_ranks: expert counts of shape " + std::to_string(d.counts.dim()) +
                                "-d, " + std::to_string(E) + " experts, over " + std::to_string(P) +
                                " ranks of ep group '" + ep.name() + "' (E must be a multiple of the ep size)");
  const int64_t El = E / P;
  // Counts first: rank p learns how many rows of each of its local experts every rank sends.
  auto send_counts = d.counts.to(torch::kCPU, torch::kInt64).reshape({P, El}).contiguous();  // [E] -> [P, El]
  // [P source ranks, El] on the group's device, then on the host.
  auto dev_recv = torch::empty({P, El}, torch::TensorOptions(torch::kInt64).device(ep.device()));
  {
    auto dev_send = send_counts.to(ep.device());
    ep.all_to_all(dev_recv, dev_send, std::vector<int64_t>(std::size_t(P), 1), std::vector<int64_t>(std::size_t(P), 1));
  }
  const auto recv_counts = dev_recv.to(torch::kCPU);
  RankDispatched rd;
  rd.send_rows = to_vector(send_counts.sum(1));  // d.x is in expert order, hence in rank order
  rd.recv_rows = to_vector(recv_counts.sum(1));
  auto received = all_to_all_rows(d.x, ep, rd.recv_rows, rd.send_rows);  // [M, D] -> [R, D] by source rank
  // Each source's block is in local expert order; sort all R rows by local expert (stable:
  // within an expert, source rank then the source's order).
  // On the rows' device (the counts are there already; R known, so no further host sync).
  int64_t R = 0;
  for (auto r : rd.recv_rows) R += r;
  auto counts_here = dev_recv.reshape({-1}).to(d.x.device());  // [P*El] (no copy: the group's device)
  auto local_expert = torch::arange(El, counts_here.options()).repeat({P}).repeat_interleave(counts_here, 0, R);  // [R]
  rd.order = std::get<1>(local_expert.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  rd.x = received.index_select(0, rd.order);  // [R, D] local expert order
  rd.counts = recv_counts.sum(0);             // [El]
  return rd;
}

torch::Tensor return_to_ranks(const torch::Tensor& y, const RankDispatched& rd, parallel::Group& ep) {
  const int64_t R = rd.order.numel();
  // inverse[order[i]] = i: back to the order the rows arrived in.
  auto inverse = torch::empty_like(rd.order).scatter_(0, rd.order, torch::arange(R, rd.order.options()));
  auto by_source = y.index_select(0, inverse);                     // [R, D] by source rank
  return all_to_all_rows(by_source, ep, rd.send_rows, rd.recv_rows);  // [R, D] -> [M, D]
}

torch::Tensor gather_experts(const torch::Tensor& local, parallel::Group& ep) {
  torch::NoGradGuard no_grad;
  std::vector<int64_t> shape = local.sizes().vec();
  shape[0] *= ep.size();
  auto full = torch::empty(shape, local.options());
  auto src = local.detach().contiguous();
  ep.all_gather_into_tensor(full, src);  // [El, ...] each -> [P*El, ...]
  return full;
}

}  // namespace kiln::model

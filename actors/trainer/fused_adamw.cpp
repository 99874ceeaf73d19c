#include "actors/trainer/fused_adamw.hpp"

#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/_fused_adamw.h>

#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>

#include "kernels/adamw.hpp"

namespace kiln::trainer {

namespace {

// What one multi-tensor launch may take: tensors of one device and dtype (torch groups the same
// way, Optimizer._group_tensors_by_device_and_dtype; a mixed list would take the slow path or
// be refused). The key orders devices by (type, index).
using GroupKey = std::tuple<int, int, int>;  // device type, device index, dtype
GroupKey key_of(const torch::Tensor& t) { return {int(t.device().type()), int(t.device().index()), int(t.scalar_type())}; }

std::string describe(const torch::Tensor& t) {
  std::string shape = "[";
  for (auto d : t.sizes()) shape += (shape.size() > 1 ? ", " : "") + std::to_string(d);
  return shape + "] " + std::string(c10::toString(t.scalar_type())) + " on " + t.device().str();
}

// Refuses `what` of parameter `index` when it does not match the parameter in shape, dtype and
// device: the fused kernel would read it as the parameter's elements.
void check_like(const torch::Tensor& p, const torch::Tensor& t, std::size_t index, const char* what) {
  if (t.sizes() == p.sizes() && t.scalar_type() == p.scalar_type() && t.device() == p.device() && !t.is_sparse())
    return;
  throw std::invalid_argument("fused_adamw_step: parameter " + std::to_string(index) + " is " + describe(p) + ", its " +
                              what + " is " + (t.is_sparse() ? "sparse " : "") + describe(t));
}

struct AdamWLists {
  std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
};

}  // namespace

void fused_adamw_step(torch::optim::AdamW& adamw, const LowPrecisionGradients* low) {
  torch::NoGradGuard no_grad;
  auto& state = adamw.state();
  // The masters that step from `low`'s gradients: master -> its index there.
  std::unordered_map<const void*, std::size_t> low_index;
  if (low) {
    if (low->grads.size() != low->masters.size() || low->params.size() != low->masters.size())
      throw std::invalid_argument("fused_adamw_step: " + std::to_string(low->masters.size()) + " low-precision masters, " +
                                  std::to_string(low->grads.size()) + " gradients, " +
                                  std::to_string(low->params.size()) + " parameters");
    for (std::size_t k = 0; k < low->masters.size(); ++k) low_index[low->masters[k].unsafeGetTensorImpl()] = k;
  }
  if (low && !low->masters.empty() &&
      !(low->scale.defined() && low->scale.numel() == 1 && low->scale.scalar_type() == torch::kFloat32))
    throw std::invalid_argument("fused_adamw_step: the low-precision gradients' scale must be one fp32 element");
  // First every parameter with a gradient and its state are checked, in every group, so that a
  // refusal changes nothing (no state created, no step counted); then the steps run.
  struct Item {
    torch::Tensor p, g, q;                 // parameter (the master), gradient, low-precision parameter (or none)
    torch::optim::AdamWParamState* state;  // null: created below
  };
  std::vector<std::vector<Item>> checked;
  for (auto& group : adamw.param_groups()) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    auto& items = checked.emplace_back();
    for (std::size_t i = 0; i < group.params().size(); ++i) {
      const auto& p = group.params()[i];
      const auto found = low ? low_index.find(p.unsafeGetTensorImpl()) : low_index.end();
      const bool is_low = found != low_index.end();
      if (is_low && p.grad().defined())
        throw std::invalid_argument("fused_adamw_step: parameter " + std::to_string(i) +
                                    " has a gradient of its own and one among the low-precision gradients");
      const auto& g = is_low ? low->grads[found->second] : p.grad();
      if (!g.defined()) continue;  // as torch::optim::AdamW::step: no update, no state
      torch::Tensor q;
      if (is_low) {
        q = low->params[found->second];
        if (o.amsgrad())
          throw std::invalid_argument("fused_adamw_step: amsgrad with low-precision gradients (parameter " +
                                      std::to_string(i) + ")");
        const auto t = g.scalar_type();
        if (g.sizes() != p.sizes() || q.sizes() != p.sizes() || g.device() != p.device() || q.device() != p.device() ||
            p.scalar_type() != torch::kFloat32 || (t != torch::kBFloat16 && t != torch::kHalf) || q.scalar_type() != t)
          throw std::invalid_argument("fused_adamw_step: parameter " + std::to_string(i) + " is " + describe(p) +
                                      ", its low-precision gradient " + describe(g) + " and parameter " + describe(q) +
                                      " (want an fp32 master, a bf16 or fp16 gradient and parameter of its shape)");
      } else {
        check_like(p, g, i, "gradient");
      }
      torch::optim::AdamWParamState* st = nullptr;
      if (auto it = state.find(p.unsafeGetTensorImpl()); it != state.end()) {
        st = static_cast<torch::optim::AdamWParamState*>(it->second.get());
        check_like(p, st->exp_avg(), i, "exp_avg");
        check_like(p, st->exp_avg_sq(), i, "exp_avg_sq");
        if (o.amsgrad()) check_like(p, st->max_exp_avg_sq(), i, "max_exp_avg_sq");
      }
      items.push_back(Item{p, g, q, st});
    }
  }
  for (std::size_t k = 0; k < checked.size(); ++k) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(adamw.param_groups()[k].options());
    std::map<GroupKey, AdamWLists> lists;
    AdamWLists from_low;  // masters stepping on `low`'s gradients (params: their masters)
    std::vector<torch::Tensor> low_params;
    // The step counts as fp32 scalars on each device, one tensor per distinct count (usually
    // one: every parameter stepped as often); the kernel only reads them.
    std::map<std::tuple<int, int, int64_t>, torch::Tensor> step_tensors;
    for (auto& [p, g, q, st] : checked[k]) {
      if (!st) {  // as torch creates it
        auto fresh = std::make_unique<torch::optim::AdamWParamState>();
        fresh->step(0);
        fresh->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        fresh->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        if (o.amsgrad()) fresh->max_exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        st = fresh.get();
        state.emplace(p.unsafeGetTensorImpl(), std::move(fresh));
      }
      st->step(st->step() + 1);  // the caller increments, the kernel reads (torch's _fused_adam)
      auto& step = step_tensors[{int(p.device().type()), int(p.device().index()), st->step()}];
      if (!step.defined()) step = torch::full({}, double(st->step()), torch::TensorOptions(torch::kFloat32).device(p.device()));
      auto& l = q.defined() ? from_low : lists[key_of(p)];
      l.params.push_back(p);
      l.grads.push_back(g);
      l.exp_avgs.push_back(st->exp_avg());
      l.exp_avg_sqs.push_back(st->exp_avg_sq());
      if (o.amsgrad()) l.max_exp_avg_sqs.push_back(st->max_exp_avg_sq());
      l.steps.push_back(step);
      if (q.defined()) low_params.push_back(q);
    }
    const auto [beta1, beta2] = o.betas();
    for (auto& [key, l] : lists)
      at::_fused_adamw_(l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, l.max_exp_avg_sqs, l.steps, o.lr(), beta1, beta2,
                        o.weight_decay(), o.eps(), o.amsgrad(), /*maximize=*/false);
    if (!from_low.params.empty())
      kernels::adamw_step_low_precision(from_low.params, from_low.exp_avgs, from_low.exp_avg_sqs, from_low.grads,
                                        low_params, low->scale, from_low.steps,
                                        kernels::AdamWHyper{o.lr(), beta1, beta2, o.weight_decay(), o.eps()});
  }
}

std::pair<torch::Tensor, torch::Tensor> grad_norm_and_coefficient(const std::vector<torch::Tensor>& all, double max_norm) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  for (const auto& g : all)
    if (g.defined()) grads.push_back(g);
  if (grads.empty()) return {torch::zeros({}, torch::kFloat32), torch::ones({}, torch::kFloat32)};
  // Per-tensor norms in fp32, one launch per group, back in the gradients' order (the order in
  // which torch's clip_grad_norm_ stacks them).
  std::map<GroupKey, std::vector<std::size_t>> groups;
  for (std::size_t i = 0; i < grads.size(); ++i) groups[key_of(grads[i])].push_back(i);
  std::vector<torch::Tensor> norms(grads.size());
  for (const auto& [key, idx] : groups) {
    std::vector<torch::Tensor> members;
    for (auto i : idx) members.push_back(grads[i]);
    auto n = at::_foreach_norm(members, 2, torch::kFloat32);
    for (std::size_t k = 0; k < idx.size(); ++k) norms[idx[k]] = n[k].to(grads.front().device());
  }
  auto total = norms.size() == 1 ? norms[0] : torch::stack(norms).norm(2);
  // torch's coefficient, as torch computes it (fp32 on the device).
  auto coef = torch::clamp(max_norm / (total + 1e-6), std::nullopt, 1.0);
  return {total, coef};
}

std::pair<double, torch::Tensor> clip_gradients(const std::vector<torch::Tensor>& grads, double max_norm,
                                                const std::vector<torch::Tensor>& scale_now) {
  torch::NoGradGuard no_grad;
  const auto [total, coef] = grad_norm_and_coefficient(grads, max_norm);
  auto host = torch::stack({total.to(coef.scalar_type()), coef}).to(torch::kCPU, torch::kFloat64);
  const double total_norm = host[0].item<double>(), clip = host[1].item<double>();
  if (clip < 1.0) {  // also 0 for an infinite norm, as torch multiplies; NaN compares false
    std::map<GroupKey, std::vector<torch::Tensor>> groups;
    for (const auto& g : scale_now)
      if (g.defined()) groups[key_of(g)].push_back(g);
    for (auto& [key, members] : groups) at::_foreach_mul_(members, coef.to(members.front().device()));
  }
  return {total_norm, coef};
}

double clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return 0.0;
  return clip_gradients(grads, max_norm, grads).first;
}

void copy_tensors(const std::vector<torch::Tensor>& dst, const std::vector<torch::Tensor>& src) {
  if (dst.size() != src.size())
    throw std::invalid_argument("copy_tensors: " + std::to_string(dst.size()) + " destinations, " +
                                std::to_string(src.size()) + " sources");
  torch::NoGradGuard no_grad;
  std::map<std::pair<GroupKey, GroupKey>, std::pair<std::vector<torch::Tensor>, std::vector<torch::Tensor>>> groups;
  for (std::size_t i = 0; i < dst.size(); ++i) {
    auto& [d, s] = groups[{key_of(dst[i]), key_of(src[i])}];
    d.push_back(dst[i]);
    s.push_back(src[i]);
  }
  for (auto& [key, lists] : groups) at::_foreach_copy_(lists.first, lists.second);
}

}  // namespace kiln::trainer

#include "model/blocks/batch_invariant.hpp"

#include <stdexcept>

#include "kernels/attention.hpp"
#include "kernels/batch_invariant.hpp"
#include "kernels/moe.hpp"
#include "model/blocks/basic.hpp"

namespace kiln::model {

namespace {
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The reference op and which inputs want a gradient, carried to the backward.
struct Reference : torch::CustomClassHolder {
  TensorsFn f;
  std::vector<bool> wants_grad;
};

struct InvariantFunction : public torch::autograd::Function<InvariantFunction> {
  static torch::Tensor forward(AutogradContext* ctx, at::TensorList inputs, const TensorsFn& invariant,
                               const c10::intrusive_ptr<Reference>& reference) {
    ctx->save_for_backward(inputs.vec());
    ctx->saved_data["reference"] = c10::IValue::make_capsule(reference);
    return invariant(inputs.vec());  // grad mode is off inside forward
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto saved = ctx->get_saved_variables();
    auto ref = c10::static_intrusive_pointer_cast<Reference>(ctx->saved_data["reference"].toCapsule());
    variable_list grads(saved.size() + 2);  // one per input, then the two functions
    if (!grad_out[0].defined()) return grads;
    std::vector<torch::Tensor> leaves, wrt;
    std::vector<std::size_t> where;
    for (std::size_t i = 0; i < saved.size(); ++i) {
      leaves.push_back(saved[i].detach().requires_grad_(ref->wants_grad[i]));
      if (ref->wants_grad[i]) {
        wrt.push_back(leaves.back());
        where.push_back(i);
      }
    }
    torch::Tensor y;
    {
      torch::AutoGradMode on(true);
      y = ref->f(leaves);
    }
    auto g = torch::autograd::grad({y}, wrt, {grad_out[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                                   /*allow_unused=*/true);
    for (std::size_t j = 0; j < where.size(); ++j) grads[where[j]] = g[j];
    return grads;
  }
};

struct InvariantLinearFunction : public torch::autograd::Function<InvariantLinearFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x_MK, const torch::Tensor& w_NK,
                               std::optional<torch::ScalarType> out_dtype) {
    ctx->save_for_backward({x_MK, w_NK});
    return kernels::bi_linear(x_MK, w_NK, out_dtype);  // [M, N]
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto s = ctx->get_saved_variables();
    const auto& x = s[0];
    const auto& w = s[1];
    auto g = grad_out[0].to(x.scalar_type());  // [M, N]
    return {g.mm(w), g.t().mm(x), torch::Tensor()};
  }
};
}  // namespace

torch::Tensor invariant_forward(const TensorsFn& invariant, const TensorsFn& reference,
                                const std::vector<torch::Tensor>& inputs) {
  auto ref = c10::make_intrusive<Reference>();
  bool any = false;
  for (const auto& t : inputs) {
    const bool wants = t.defined() && t.requires_grad();
    ref->wants_grad.push_back(wants);
    any |= wants;
  }
  if (!torch::GradMode::is_enabled() || !any) {
    torch::NoGradGuard no_grad;  // the invariant ops have no autograd formula of their own
    return invariant(inputs);
  }
  ref->f = reference;
  return InvariantFunction::apply(at::TensorList(inputs), invariant, ref);
}

torch::Tensor invariant_linear(const torch::Tensor& x, const torch::Tensor& w,
                               std::optional<torch::ScalarType> out_dtype) {
  auto flat = x.reshape({-1, x.size(-1)});  // [M, K]
  auto sizes = x.sizes().vec();
  sizes.back() = w.size(0);
  if (!torch::GradMode::is_enabled() || !(x.requires_grad() || w.requires_grad())) {
    torch::NoGradGuard no_grad;
    return kernels::bi_linear(flat, w, out_dtype).view(sizes);
  }
  return InvariantLinearFunction::apply(flat, w, out_dtype).view(sizes);  // [..., N]
}

torch::Tensor invariant_rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  return invariant_forward(
      [eps](const std::vector<torch::Tensor>& in) {
        return kernels::bi_rms_norm(in[0].reshape({-1, in[0].size(-1)}), in[1], eps).view(in[0].sizes());
      },
      [eps](const std::vector<torch::Tensor>& in) { return rms_norm(in[0], in[1], eps); }, {x, w});
}

torch::Tensor invariant_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const torch::Tensor& cu_seqlens, double scale, int64_t max_seqlen) {
  return invariant_forward(
      [scale](const std::vector<torch::Tensor>& in) {
        return kernels::bi_attention(in[0], in[1], in[2], in[3], in[3], scale);
      },
      [scale, max_seqlen](const std::vector<torch::Tensor>& in) {
        return kernels::varlen_attention(in[0], in[1], in[2], in[3], scale, max_seqlen);
      },
      {q, k, v, cu_seqlens});
}

torch::Tensor invariant_silu(const torch::Tensor& x) {
  auto xf = x.to(torch::kFloat32);
  return (xf / (1 + torch::exp(-xf))).to(x.scalar_type());
}

torch::Tensor invariant_sigmoid(const torch::Tensor& x) {
  auto xf = x.to(torch::kFloat32);
  return (1 / (1 + torch::exp(-xf))).to(x.scalar_type());
}

torch::Tensor invariant_swiglu(const torch::Tensor& gate, const torch::Tensor& up) { return invariant_silu(gate) * up; }

torch::Tensor invariant_grouped_swiglu(const torch::Tensor& x, const torch::Tensor& counts,
                                       const torch::Tensor& w_gate_up_EFD, const torch::Tensor& w_down_EDF,
                                       std::optional<double> swiglu_limit) {
  if (swiglu_limit)
    throw std::invalid_argument("invariant_grouped_swiglu: the batch-invariant mode has no clamped SwiGLU (swiglu_limit " +
                                std::to_string(*swiglu_limit) + ")");
  return invariant_forward(
      [](const std::vector<torch::Tensor>& in) {
        const int64_t F = in[2].size(1) / 2;
        auto gate_up = kernels::bi_grouped_linear(in[0], in[1], in[2]);             // [M, 2F]
        auto act = invariant_swiglu(gate_up.narrow(1, 0, F), gate_up.narrow(1, F, F));  // [M, F]
        return kernels::bi_grouped_linear(act, in[1], in[3]);                       // [M, D]
      },
      [](const std::vector<torch::Tensor>& in) { return kernels::grouped_swiglu(in[0], in[1], in[2], in[3]); },
      {x, counts, w_gate_up_EFD, w_down_EDF});
}

}  // namespace kiln::model

#include "model/blocks/activation_checkpoint.hpp"

namespace kiln::model {

namespace {

// f, carried to the backward through the autograd context.
struct Recompute : torch::CustomClassHolder {
  std::function<torch::Tensor(const torch::Tensor&)> f;
};

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const c10::intrusive_ptr<Recompute>& recompute) {
    ctx->save_for_backward({x});
    ctx->saved_data["f"] = c10::IValue::make_capsule(recompute);
    return recompute->f(x);  // grad mode is off inside forward: no graph, no saved activations
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    auto recompute = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["f"].toCapsule());
    torch::Tensor y;
    {
      torch::AutoGradMode on(true);
      y = recompute->f(x);
    }
    torch::autograd::backward({y}, {grad_out[0]});  // accumulates f's parameters' gradients
    return {x.grad(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor checkpointed(const std::function<torch::Tensor(const torch::Tensor&)>& f, const torch::Tensor& x) {
  if (!torch::GradMode::is_enabled() || !x.requires_grad()) return f(x);
  auto recompute = c10::make_intrusive<Recompute>();
  recompute->f = f;
  return CheckpointFunction::apply(x, recompute);
}

}  // namespace kiln::model

#include "kernels/swiglu.hpp"

#include <torch/torch.h>

#include "kernels/alignment.hpp"
#include "kernels/moe.hpp"

#ifdef KILN_CUDA
#include "kernels/swiglu_cuda.hpp"
#endif

namespace kiln::kernels {

namespace {
void check(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "swiglu_packed: gu must be [M, 2F], got ", gu.sizes());
}

#ifdef KILN_CUDA
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct SwigluPacked : public torch::autograd::Function<SwigluPacked> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& gu) {
    ctx->save_for_backward({gu});
    auto out = at::empty({gu.size(0), gu.size(1) / 2}, gu.options());
    if (out.numel() > 0) cuda::swiglu_packed_forward(gu, out);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto gu = ctx->get_saved_variables()[0];
    auto dy = aligned_contiguous(grads[0].to(gu.scalar_type()));  // the kernel's 16-byte loads
    auto dgu = at::empty_like(gu);
    if (dgu.numel() > 0) cuda::swiglu_packed_backward(gu, dy, dgu);
    return {dgu};
  }
};

// The same kernels over two separate [M, F] projections (dense MLPs, shared experts): autograd
// through silu(gate) * up ran silu, mul and, backward, two muls and silu_backward, each a pass
// over [M, F].
struct SwigluPair : public torch::autograd::Function<SwigluPair> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& gate, const torch::Tensor& up) {
    ctx->save_for_backward({gate, up});
    auto out = at::empty({gate.size(0), gate.size(1)}, gate.options());
    if (out.numel() > 0) cuda::swiglu_pair_forward(gate, up, out);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto dy = aligned_contiguous(grads[0].to(s[0].scalar_type()));  // the kernel's 16-byte loads
    auto dgate = at::empty_like(s[0], at::MemoryFormat::Contiguous), dup = at::empty_like(s[1], at::MemoryFormat::Contiguous);
    if (dy.numel() > 0) cuda::swiglu_pair_backward(s[0], s[1], dy, dgate, dup);
    return {dgate, dup};
  }
};
#endif

// A [M, F] operand the kernels' 16-byte loads can read in rows.
[[maybe_unused]] bool rows_ready(const at::Tensor& t) {
  return t.dim() == 2 && t.stride(1) == 1 && t.stride(0) % 8 == 0 && aligned16(t);
}
}  // namespace

bool swiglu_packed_uses_kernel(const at::Tensor& gu, std::optional<double> limit) {
#ifdef KILN_CUDA
  return !limit && gu.is_cuda() && (gu.scalar_type() == at::kBFloat16 || gu.scalar_type() == at::kHalf) &&
         gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 16 == 0 && aligned16(gu);
#else
  (void)gu;
  (void)limit;
  return false;
#endif
}

at::Tensor swiglu_packed_ref(const at::Tensor& gu, std::optional<double> limit) {
  check(gu);
  const int64_t F = gu.size(1) / 2;
  return swiglu(gu.narrow(1, 0, F), gu.narrow(1, F, F), limit);
}

bool swiglu_pair_uses_kernel(const at::Tensor& gate, const at::Tensor& up, std::optional<double> limit) {
#ifdef KILN_CUDA
  const auto t = gate.scalar_type();
  return !limit && gate.is_cuda() && (t == at::kBFloat16 || t == at::kHalf) && up.scalar_type() == t &&
         up.device() == gate.device() && gate.dim() == 2 && gate.sizes() == up.sizes() && gate.size(1) % 8 == 0 &&
         rows_ready(gate) && rows_ready(up);
#else
  (void)gate;
  (void)up;
  (void)limit;
  return false;
#endif
}

at::Tensor swiglu_pair(const at::Tensor& gate, const at::Tensor& up, std::optional<double> limit) {
  TORCH_CHECK(gate.sizes() == up.sizes(), "swiglu_pair: gate ", gate.sizes(), " and up ", up.sizes(), " differ");
#ifdef KILN_CUDA
  if (swiglu_pair_uses_kernel(gate, up, limit)) return SwigluPair::apply(gate, up);
#endif
  return swiglu(gate, up, limit);
}

namespace {
void check_routed(const at::Tensor& gu, const at::Tensor& h, const at::Tensor& w_row) {
  check(gu);
  const int64_t M = gu.size(0), F = gu.size(1) / 2;
  TORCH_CHECK(h.dim() == 2 && h.size(0) == M && h.size(1) == F && h.scalar_type() == gu.scalar_type(),
              "swiglu_routed_backward: h must be [M, F] = [", M, ", ", F, "] ", gu.scalar_type(), " as gu, got ",
              h.sizes(), " ", h.scalar_type());
  TORCH_CHECK(w_row.dim() == 1 && w_row.size(0) == M && w_row.scalar_type() == at::kFloat,
              "swiglu_routed_backward: w_row must be [M] = [", M, "] fp32, got ", w_row.sizes(), " ",
              w_row.scalar_type());
  TORCH_CHECK(h.device() == gu.device() && w_row.device() == gu.device(), "swiglu_routed_backward: gu on ",
              gu.device(), ", h on ", h.device(), ", w_row on ", w_row.device());
}
}  // namespace

SwigluRoutedGrads swiglu_routed_backward_ref(const at::Tensor& gu, const at::Tensor& h, const at::Tensor& w_row,
                                             std::optional<double> limit) {
  check_routed(gu, h, w_row);
  const int64_t F = gu.size(1) / 2;
  const auto dt = gu.scalar_type();
  const auto gate = gu.narrow(1, 0, F), up = gu.narrow(1, F, F);
  const auto gate_c = limit ? gate.clamp_max(*limit) : gate, up_c = limit ? up.clamp(-*limit, *limit) : up;
  const auto s = at::silu(gate_c);                                // [M, F] in gu's dtype, as the forward
  const auto act = swiglu(gate, up, limit).to(at::kFloat);        // the forward's rounded act
  const auto hf = h.to(at::kFloat), w = w_row.unsqueeze(1);
  const auto dy = hf * w;                                         // fp32, not rounded
  auto du = (dy * s.to(at::kFloat)).to(dt);
  const auto ds = (dy * up_c.to(at::kFloat)).to(dt);
  auto dg = at::silu_backward(ds.to(at::kFloat), gate_c.to(at::kFloat)).to(dt);
  if (limit) {  // torch.clamp's gradient: through entries inside [min, max] only
    dg = dg.masked_fill(gate.gt(*limit), 0);
    du = du.masked_fill(up.abs().gt(*limit), 0);
  }
  return {at::cat({dg, du}, 1), (act * w).to(dt), (hf * act).sum(1)};
}

SwigluRoutedGrads swiglu_routed_backward(const at::Tensor& gu, const at::Tensor& h, const at::Tensor& w_row,
                                         std::optional<double> limit) {
  check_routed(gu, h, w_row);
#ifdef KILN_CUDA
  if (swiglu_packed_uses_kernel(gu, limit) && h.is_contiguous() && aligned16(h)) {
    SwigluRoutedGrads g{at::empty_like(gu), at::empty_like(h), at::empty({gu.size(0)}, w_row.options())};
    cuda::swiglu_routed_backward(gu, h, w_row.contiguous(), g.dgu, g.act_w, g.dw_row);
    return g;
  }
#endif
  return swiglu_routed_backward_ref(gu, h, w_row, limit);
}

SwigluPairGrads swiglu_pair_backward(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& dy,
                                     std::optional<double> limit, bool want_act) {
  TORCH_CHECK(gate.sizes() == up.sizes() && dy.sizes() == gate.sizes(), "swiglu_pair_backward: gate ", gate.sizes(),
              ", up ", up.sizes(), " and dy ", dy.sizes(), " differ");
#ifdef KILN_CUDA
  if (swiglu_pair_uses_kernel(gate, up, limit)) {
    auto d = aligned_contiguous(dy.to(gate.scalar_type()));  // the kernel's 16-byte loads
    auto dgate = at::empty_like(gate, at::MemoryFormat::Contiguous), dup = at::empty_like(up, at::MemoryFormat::Contiguous);
    at::Tensor act = want_act ? at::empty_like(gate, at::MemoryFormat::Contiguous) : at::Tensor();
    if (d.numel() > 0) cuda::swiglu_pair_backward(gate, up, d, dgate, dup, want_act ? &act : nullptr);
    return {dgate, dup, act};
  }
#endif
  const at::AutoGradMode grad(true);
  auto g = gate.detach().requires_grad_(), u = up.detach().requires_grad_();
  auto act = swiglu(g, u, limit);
  auto d = torch::autograd::grad({act}, {g, u}, {dy.to(gate.scalar_type())});
  return {d[0].contiguous(), d[1].contiguous(), want_act ? act.detach().contiguous() : at::Tensor()};
}

at::Tensor swiglu_packed(const at::Tensor& gu, std::optional<double> limit) {
  check(gu);
#ifdef KILN_CUDA
  if (swiglu_packed_uses_kernel(gu, limit)) return SwigluPacked::apply(gu);
#endif
  return swiglu_packed_ref(gu, limit);
}

}  // namespace kiln::kernels

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

at::Tensor swiglu_packed(const at::Tensor& gu, std::optional<double> limit) {
  check(gu);
#ifdef KILN_CUDA
  if (swiglu_packed_uses_kernel(gu, limit)) return SwigluPacked::apply(gu);
#endif
  return swiglu_packed_ref(gu, limit);
}

}  // namespace kiln::kernels

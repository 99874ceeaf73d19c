#include "kernels/rms_norm.hpp"

#include <torch/torch.h>

#include "kernels/alignment.hpp"

#ifdef KILN_CUDA
#include "kernels/rms_norm_cuda.hpp"
#endif

namespace kiln::kernels {

namespace {
void check(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0), "rms_norm: x must be [R, D] and w [D], got ",
              x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rms_norm: x and w dtypes differ (", x.scalar_type(), ", ",
              w.scalar_type(), ")");
  TORCH_CHECK(x.device() == w.device(), "rms_norm: x and w on different devices");
}
}  // namespace

bool built_with_cuda() {
#ifdef KILN_CUDA
  return true;
#else
  return false;
#endif
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_ref(const at::Tensor& x, const at::Tensor& w, double eps) {
  auto xf = x.to(at::kFloat);
  auto rstd = torch::rsqrt(xf.pow(2).mean(-1) + eps);                 // [R]
  auto y = w * (xf * rstd.unsqueeze(-1)).to(x.scalar_type());        // [R, D]
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_ref(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                         const at::Tensor& rstd) {
  auto n = x.to(at::kFloat) * rstd.unsqueeze(-1);                     // [R, D]
  auto g = dy.to(at::kFloat);
  auto dn = g * w.to(at::kFloat);
  auto dx = rstd.unsqueeze(-1) * (dn - n * (dn * n).mean(-1, true));
  auto dw = (g * n).sum(0);
  return {dx.to(x.scalar_type()), dw.to(w.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& w, double eps) {
  check(x, w);
  if (!x.is_cuda()) return rms_norm_forward_ref(x, w, eps);
#ifdef KILN_CUDA
  // On 16-byte boundaries (a fresh copy when a view starts off one): which kernel runs, and so a
  // row's bits, then depend on D alone (kernels/rms_norm.cu), not on where the row lies.
  auto xc = aligned_contiguous(x), wc = aligned_contiguous(w);
  auto y = torch::empty_like(xc);
  auto rstd = torch::empty({x.size(0)}, x.options().dtype(at::kFloat));
  cuda::rms_norm_forward(xc, wc, eps, y, rstd);
  return {y, rstd};
#else
  TORCH_CHECK(false, "rms_norm: CUDA tensor, but kiln was built without CUDA");
#endif
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                     const at::Tensor& rstd) {
  check(x, w);
  if (!x.is_cuda()) return rms_norm_backward_ref(dy, x, w, rstd);
#ifdef KILN_CUDA
  auto xc = aligned_contiguous(x), wc = aligned_contiguous(w), dyc = aligned_contiguous(dy);
  auto dx = torch::empty_like(xc);
  auto dw = torch::empty({w.size(0)}, w.options().dtype(at::kFloat));  // written by the kernel's sum
  cuda::rms_norm_backward(dyc, xc, wc, rstd.contiguous(), dx, dw);
  return {dx, dw.to(w.scalar_type())};
#else
  TORCH_CHECK(false, "rms_norm: CUDA tensor, but kiln was built without CUDA");
#endif
}

namespace {
struct RmsNormFn : public torch::autograd::Function<RmsNormFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, double eps) {
    auto [y, rstd] = rms_norm_forward(x, w, eps);
    ctx->save_for_backward({x, w, rstd});
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    auto s = ctx->get_saved_variables();
    auto [dx, dw] = rms_norm_backward(g[0], s[0], s[1], s[2]);
    return {dx, dw, at::Tensor()};
  }
};
}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  auto flat = x.reshape({-1, x.size(-1)});                           // [R, D]
  return RmsNormFn::apply(flat, w, eps).view(x.sizes());
}

}  // namespace kiln::kernels

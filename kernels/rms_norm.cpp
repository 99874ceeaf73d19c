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

namespace {
// x as the kernels take it without a copy: itself when its rows (unit column stride) each start on
// a 16-byte boundary, a row-strided view included (the MLA latent's norm reads the first C columns
// of the [T, C+R] projection: no copy of them forward or backward); else aligned_contiguous(x).
at::Tensor aligned_rows(const at::Tensor& x) { return rows_aligned16(x) ? x : aligned_contiguous(x); }

// rms_norm_forward with an optional residual addend r: -> (y, rstd, h = x + r or undefined).
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_impl(const at::Tensor& x, const at::Tensor& w, double eps,
                                                            const at::Tensor* r) {
  check(x, w);
  if (!x.is_cuda()) {
    const auto h = r ? x + *r : at::Tensor();
    auto [y, rstd] = rms_norm_forward_ref(r ? h : x, w, eps);
    return {y, rstd, h};
  }
#ifdef KILN_CUDA
  // On 16-byte boundaries (a fresh copy when a view starts off one): which kernel runs, and so a
  // row's bits, then depend on D alone (kernels/rms_norm.cu), not on where the row lies.
  auto xc = aligned_rows(x), wc = aligned_contiguous(w);
  auto y = torch::empty({x.size(0), x.size(1)}, x.options());
  auto rstd = torch::empty({x.size(0)}, x.options().dtype(at::kFloat));
  if (!r) {
    cuda::rms_norm_forward(xc, wc, eps, y, rstd);
    return {y, rstd, at::Tensor()};
  }
  auto rc = aligned_contiguous(*r);
  auto h = torch::empty({x.size(0), x.size(1)}, x.options());
  cuda::rms_norm_forward(xc, wc, eps, y, rstd, &rc, &h);
  return {y, rstd, h};
#else
  TORCH_CHECK(false, "rms_norm: CUDA tensor, but kiln was built without CUDA");
#endif
}

// rms_norm_backward with an optional gradient dres added to dx (rounded as autograd's sum).
std::tuple<at::Tensor, at::Tensor> backward_impl(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                 const at::Tensor& rstd, const at::Tensor* dres) {
  check(x, w);
  if (!x.is_cuda()) {
    auto [dx, dw] = rms_norm_backward_ref(dy, x, w, rstd);
    return {dres ? dx + *dres : dx, dw};
  }
#ifdef KILN_CUDA
  auto xc = aligned_rows(x), wc = aligned_contiguous(w), dyc = aligned_contiguous(dy);
  auto dx = torch::empty({x.size(0), x.size(1)}, x.options());
  auto dw = torch::empty({w.size(0)}, w.options().dtype(at::kFloat));  // written by the kernel's sum
  if (dres) {
    auto dc = aligned_contiguous(dres->to(x.scalar_type()));
    cuda::rms_norm_backward(dyc, xc, wc, rstd.contiguous(), dx, dw, &dc);
  } else {
    cuda::rms_norm_backward(dyc, xc, wc, rstd.contiguous(), dx, dw);
  }
  return {dx, dw.to(w.scalar_type())};
#else
  TORCH_CHECK(false, "rms_norm: CUDA tensor, but kiln was built without CUDA");
#endif
}
}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& w, double eps) {
  auto [y, rstd, h] = forward_impl(x, w, eps, nullptr);
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                     const at::Tensor& rstd) {
  return backward_impl(dy, x, w, rstd, nullptr);
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

namespace {
struct AddRmsNormFn : public torch::autograd::Function<AddRmsNormFn> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& r, const at::Tensor& w, double eps) {
    auto [y, rstd, h] = forward_impl(x, w, eps, &r);
    ctx->save_for_backward({h, w, rstd});
    return {h, y};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    auto s = ctx->get_saved_variables();
    auto [dx, dw] = backward_impl(g[1], s[0], s[1], s[2], &g[0]);  // g: {dh, dy}, zeros where unused
    return {dx, dx, dw, at::Tensor()};
  }
};

struct RmsNormPassFn : public torch::autograd::Function<RmsNormPassFn> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& w, double eps) {
    auto [y, rstd, unused] = forward_impl(x, w, eps, nullptr);
    ctx->save_for_backward({x, w, rstd});
    return {x, y};  // x returned: autograd gives it a view with this node as its gradient's source
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    auto s = ctx->get_saved_variables();
    auto [dx, dw] = backward_impl(g[1], s[0], s[1], s[2], &g[0]);  // g: {d x_on, dy}
    return {dx, dw, at::Tensor()};
  }
};

void check_pair(const at::Tensor& x, const at::Tensor& r) {
  TORCH_CHECK(x.sizes() == r.sizes() && x.scalar_type() == r.scalar_type() && x.device() == r.device(),
              "add_rms_norm: x ", x.sizes(), " ", x.scalar_type(), " ", x.device(), " and r ", r.sizes(), " ",
              r.scalar_type(), " ", r.device(), " must match");
}
}  // namespace

std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w,
                                               double eps) {
  check_pair(x, r);
  const int64_t D = x.size(-1);
  auto out = AddRmsNormFn::apply(x.reshape({-1, D}), r.reshape({-1, D}), w, eps);  // [R, D] each
  return {out[0].view(x.sizes()), out[1].view(x.sizes())};
}

std::pair<at::Tensor, at::Tensor> rms_norm_pass(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t D = x.size(-1);
  auto out = RmsNormPassFn::apply(x.reshape({-1, D}), w, eps);
  return {out[0].view(x.sizes()), out[1].view(x.sizes())};
}

}  // namespace kiln::kernels

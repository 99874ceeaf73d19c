#include "kernels/router_logits.hpp"

#include <torch/torch.h>

#include <cstdint>

#include "kernels/alignment.hpp"

#ifdef KILN_CUDA
#include "kernels/router_logits_cuda.hpp"
#endif

namespace kiln::kernels {

namespace {
void check(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "router_logits: x [M, K] and w [N, K] expected, got x ", x.sizes(), " and w ", w.sizes());
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && x.device() == w.device(),
              "router_logits: x and w must share dtype and device, got ", x.scalar_type(), " on ", x.device(), " and ",
              w.scalar_type(), " on ", w.device());
}
}  // namespace

at::Tensor router_logits_ref(const at::Tensor& x_MK, const at::Tensor& w_NK) {
  check(x_MK, w_NK);
  return at::linear(x_MK.to(at::kFloat), w_NK.to(at::kFloat)).contiguous();
}

bool router_logits_uses_kernel(const at::Tensor& x_MK, const at::Tensor& w_NK) {
#ifdef KILN_CUDA
  constexpr int64_t kMax = (int64_t(1) << 31) - 64;  // the kernel's int index sums stay below 2^31
  return x_MK.is_cuda() && x_MK.dim() == 2 && w_NK.dim() == 2 && x_MK.scalar_type() == at::kBFloat16 &&
         w_NK.scalar_type() == at::kBFloat16 && w_NK.device() == x_MK.device() && x_MK.size(1) == w_NK.size(1) &&
         x_MK.size(1) % 8 == 0 && x_MK.size(0) < kMax && w_NK.size(0) <= 65535 * 16 && x_MK.size(1) < kMax &&
         rows_aligned16(x_MK) && w_NK.is_contiguous() && aligned16(w_NK);
#else
  (void)x_MK;
  (void)w_NK;
  return false;
#endif
}

at::Tensor router_logits(const at::Tensor& x_MK, const at::Tensor& w_NK) {
  check(x_MK, w_NK);
#ifdef KILN_CUDA
  if (router_logits_uses_kernel(x_MK, w_NK)) {
    auto y = at::empty({x_MK.size(0), w_NK.size(0)}, x_MK.options().dtype(at::kFloat));
    if (y.numel() == 0) return y;
    if (x_MK.size(1) == 0) return y.zero_();
    cuda::router_logits(x_MK, w_NK, y);
    return y;
  }
#endif
  return router_logits_ref(x_MK, w_NK);
}

}  // namespace kiln::kernels

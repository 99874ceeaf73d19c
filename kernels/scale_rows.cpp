#include "kernels/scale_rows.hpp"

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/mul.h>
#include <c10/util/Exception.h>

#include "kernels/alignment.hpp"

#ifdef KILN_CUDA
#include "kernels/scale_rows_cuda.hpp"
#endif

namespace kiln::kernels {

namespace {
void check(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && a.dim() == 1 && out.sizes() == x.sizes() && a.size(0) == x.size(0),
              "scale_rows: x [N, D], out [N, D] and a [N] expected, got x ", x.sizes(), ", out ", out.sizes(),
              " and a ", a.sizes());
  TORCH_CHECK(a.scalar_type() == at::kFloat, "scale_rows: a must be fp32, got ", a.scalar_type());
  TORCH_CHECK(x.device() == out.device() && a.device() == x.device(), "scale_rows: x (", x.device(), "), out (",
              out.device(), ") and a (", a.device(), ") must share a device");
}

bool kernel_dtype(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat; }
}  // namespace

void scale_rows_out_ref(at::Tensor& out_ND, const at::Tensor& x_ND, const at::Tensor& a_N) {
  check(out_ND, x_ND, a_N);
  at::mul_out(out_ND, x_ND, a_N.unsqueeze(1));
}

bool scale_rows_uses_kernel(const at::Tensor& out_ND, const at::Tensor& x_ND, const at::Tensor& a_N) {
#ifdef KILN_CUDA
  return x_ND.is_cuda() && x_ND.dim() == 2 && out_ND.dim() == 2 && a_N.dim() == 1 && out_ND.sizes() == x_ND.sizes() &&
         a_N.size(0) == x_ND.size(0) && out_ND.device() == x_ND.device() && a_N.device() == x_ND.device() &&
         a_N.scalar_type() == at::kFloat && kernel_dtype(x_ND.scalar_type()) && kernel_dtype(out_ND.scalar_type()) &&
         x_ND.size(1) % 8 == 0 && x_ND.is_contiguous() && out_ND.is_contiguous() && a_N.is_contiguous() &&
         aligned16(x_ND) && aligned16(out_ND);
#else
  (void)out_ND;
  (void)x_ND;
  (void)a_N;
  return false;
#endif
}

void scale_rows_out(at::Tensor& out_ND, const at::Tensor& x_ND, const at::Tensor& a_N) {
  check(out_ND, x_ND, a_N);
  at::assert_no_partial_overlap(out_ND, x_ND);  // out is x itself, or apart from it (as at::mul_out asks)
  at::assert_no_overlap(out_ND, a_N);
#ifdef KILN_CUDA
  if (scale_rows_uses_kernel(out_ND, x_ND, a_N)) {
    if (out_ND.numel() > 0) cuda::scale_rows(out_ND, x_ND, a_N);
    return;
  }
#endif
  scale_rows_out_ref(out_ND, x_ND, a_N);
}

}  // namespace kiln::kernels

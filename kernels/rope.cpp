#include "kernels/rope.hpp"

#include <ATen/core/grad_mode.h>
#include <torch/torch.h>

#ifdef KILN_CUDA
#include "kernels/rope_cuda.hpp"
#endif

namespace kiln::kernels {

namespace {
void check(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_t, const at::Tensor& sin_t) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0 && positions.dim() == 1 && positions.size(0) == x.size(0),
              "rope_rotate: x [T, H, R] (R even) and positions [T] expected, got ", x.sizes(), " and ",
              positions.sizes());
  TORCH_CHECK(positions.scalar_type() == at::kLong, "rope_rotate: positions must be int64, got ",
              positions.scalar_type());
  TORCH_CHECK(cos_t.dim() == 2 && cos_t.sizes() == sin_t.sizes() && cos_t.size(1) == x.size(2) / 2 && cos_t.size(0) >= 1,
              "rope_rotate: cos and sin tables [P, R/2] with R = ", x.size(2), " expected, got ", cos_t.sizes(), " and ",
              sin_t.sizes());
  TORCH_CHECK(cos_t.scalar_type() == x.scalar_type() && sin_t.scalar_type() == x.scalar_type(),
              "rope_rotate: the tables (", cos_t.scalar_type(), ", ", sin_t.scalar_type(), ") must have x's dtype (",
              x.scalar_type(), ")");
  TORCH_CHECK(positions.device() == x.device() && cos_t.device() == x.device() && sin_t.device() == x.device(),
              "rope_rotate: positions (", positions.device(), ") and tables (", cos_t.device(), ", ", sin_t.device(),
              ") must be on x's device (", x.device(), ")");
}
}  // namespace

at::Tensor rope_rotate_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  const int64_t R = x.size(-1);
  auto c = cos.unsqueeze(1), s = sin.unsqueeze(1);  // [T, 1, R/2]
  if (interleaved) {
    auto pairs = x.unflatten(-1, {R / 2, 2});  // [T, H, R/2, 2]
    auto x0 = pairs.select(-1, 0), x1 = pairs.select(-1, 1);
    return torch::stack({x0 * c - x1 * s, x1 * c + x0 * s}, -1).flatten(-2);  // [T, H, R]
  }
  auto x0 = x.narrow(-1, 0, R / 2), x1 = x.narrow(-1, R / 2, R / 2);
  return torch::cat({x0 * c - x1 * s, x1 * c + x0 * s}, -1);
}

at::Tensor rope_rotate_ref(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_table,
                           const at::Tensor& sin_table, bool interleaved) {
  check(x, positions, cos_table, sin_table);
  return rope_rotate_rows(x, cos_table.index_select(0, positions), sin_table.index_select(0, positions), interleaved);
}

at::Tensor rope_rotate(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_table,
                       const at::Tensor& sin_table, bool interleaved) {
  check(x, positions, cos_table, sin_table);
#ifdef KILN_CUDA
  const auto dt = x.scalar_type();
  if (x.is_cuda() && (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf) &&
      !(at::GradMode::is_enabled() && x.requires_grad()) && x.stride(2) == 1) {
    auto out = at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
    if (x.numel() > 0)
      cuda::rope_rotate(x, positions.contiguous(), cos_table.contiguous(), sin_table.contiguous(), interleaved, out);
    return out;
  }
#endif
  return rope_rotate_rows(x, cos_table.index_select(0, positions), sin_table.index_select(0, positions), interleaved);
}

}  // namespace kiln::kernels

// Fused RMSNorm: the LibTorch reference against the model's RMSNorm module on CPU, and the
// CUDA kernel against the reference on every GPU present (values and gradients).
#include <doctest/doctest.h>
#include <torch/torch.h>

#include "kernels/alignment.hpp"
#include "kernels/rms_norm.hpp"
#include "model/blocks/basic.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::rel_error;

TEST_CASE("RMSNorm reference equals the model's RMSNorm, values and gradients (CPU)") {
  torch::manual_seed(0);
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    CAPTURE(dtype);
    model::RMSNorm ref_module(96, 1e-5);
    {
      torch::NoGradGuard g;
      ref_module->weight.copy_(1 + 0.3 * torch::randn({96}));
    }
    ref_module->to(dtype);
    auto x = torch::randn({7, 5, 96}).to(dtype).requires_grad_();
    auto y_module = ref_module(x);
    auto dy = torch::randn_like(y_module);
    auto grads_module = torch::autograd::grad({(y_module * dy).sum()}, {x, ref_module->weight});
    auto w = ref_module->weight.detach().clone().requires_grad_();
    auto y = kernels::rms_norm(x, w, 1e-5);
    auto grads = torch::autograd::grad({(y * dy).sum()}, {x, w});
    const double tol = dtype == torch::kFloat32 ? 1e-6 : 1e-2;
    CHECK(rel_error(y, y_module) <= tol);
    CHECK(rel_error(grads[0], grads_module[0]) <= (dtype == torch::kFloat32 ? 1e-5 : 2e-2));
    CHECK(rel_error(grads[1], grads_module[1]) <= (dtype == torch::kFloat32 ? 1e-5 : 2e-2));
  }
  CHECK_THROWS_AS(kernels::rms_norm_forward(torch::randn({4, 8}), torch::randn({9}), 1e-5), c10::Error);
}

TEST_CASE("RMSNorm CUDA kernel equals the reference, values and gradients") {
  if (test::skip_without_cuda_kernels()) return;
  torch::manual_seed(1);
  for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    // 8192 rows: each warp of the warp kernels' backward takes several rows (its dw summed over them)
    for (auto [rows, dim] : {std::pair<int64_t, int64_t>{333, 64}, {333, 512}, {333, 768}, {333, 2048}, {333, 7168},
                             {8192, 768}, {8192, 2048}}) {
      CAPTURE(dtype);
      CAPTURE(rows);
      CAPTURE(dim);
      auto x = torch::randn({rows, dim}, torch::kCUDA).to(dtype);
      auto w = (1 + 0.3 * torch::randn({dim}, torch::kCUDA)).to(dtype);
      auto dy = torch::randn({rows, dim}, torch::kCUDA).to(dtype);
      auto [y, rstd] = kernels::rms_norm_forward(x, w, 1e-5);
      auto [y_ref, rstd_ref] = kernels::rms_norm_forward_ref(x, w, 1e-5);
      CHECK(rel_error(rstd, rstd_ref) <= 1e-6);
      const double tol = dtype == torch::kFloat32 ? 1e-6 : 1e-2;  // bf16/fp16: one rounding of the output
      CHECK(rel_error(y, y_ref) <= tol);
      auto [dx, dw] = kernels::rms_norm_backward(dy, x, w, rstd);
      auto [dx_ref, dw_ref] = kernels::rms_norm_backward_ref(dy, x, w, rstd_ref);
      CHECK(rel_error(dx, dx_ref) <= (dtype == torch::kFloat32 ? 1e-5 : 1e-2));
      CHECK(rel_error(dw, dw_ref) <= (dtype == torch::kFloat32 ? 1e-5 : 1e-2));
    }
  }
}

TEST_CASE("rows_aligned16 (kernels/alignment.hpp): the row layouts the 16-byte vector kernels read in place (CPU)") {
  auto wide = torch::zeros({6, 576}, torch::kBFloat16);  // the CPU allocator's blocks start on 64 bytes
  CHECK(kernels::rows_aligned16(wide));
  CHECK(kernels::rows_aligned16(wide.narrow(1, 0, 512)));   // rows of 1152 bytes
  CHECK_FALSE(kernels::rows_aligned16(wide.narrow(1, 1, 512)));  // start 2 bytes in
  CHECK(kernels::rows_aligned16(wide.narrow(1, 8, 512)));   // 16 bytes in
  CHECK_FALSE(kernels::rows_aligned16(torch::zeros({6, 70}, torch::kBFloat16)));  // rows of 140 bytes
  CHECK(kernels::rows_aligned16(torch::zeros({1, 70}, torch::kBFloat16)));        // one row: no stride
  CHECK_FALSE(kernels::rows_aligned16(wide.t()));                                 // column stride 576
  CHECK_FALSE(kernels::rows_aligned16(torch::zeros({6, 8, 8}, torch::kBFloat16)));  // not [R, C]
  CHECK(kernels::rows_aligned16(torch::zeros({6, 4}).narrow(1, 0, 2)));           // fp32 rows of 16 bytes
  CHECK_FALSE(kernels::rows_aligned16(torch::zeros({8, 4}).as_strided({4, 4}, {2, 1})));  // overlapping rows
}

TEST_CASE("RMSNorm CUDA: x as row-strided columns of a wider matrix gives the contiguous copy's bits, forward and backward") {
  if (test::skip_without_cuda_kernels()) return;
  torch::manual_seed(2);
  // MLA's latent norm: the first 512 of [T, 576] columns. 4100 rows: the warps loop over rows.
  // [.., 2048 of 2056]: 8 vectors a lane; [.., 64 of 70]: rows off the 16-byte grid, copied.
  for (auto dtype : {torch::kBFloat16, torch::kFloat32})
    for (auto [rows, dim, width] : {std::tuple<int64_t, int64_t, int64_t>{4100, 512, 576}, {333, 2048, 2056}, {37, 64, 70}}) {
      CAPTURE(dtype);
      CAPTURE(dim);
      auto wide = torch::randn({rows, width}, torch::kCUDA).to(dtype);
      auto x = wide.narrow(1, 0, dim);  // [rows, dim], row stride `width`
      REQUIRE_FALSE(x.is_contiguous());
      auto xc = x.contiguous();
      auto w = (1 + 0.3 * torch::randn({dim}, torch::kCUDA)).to(dtype);
      auto dy = torch::randn({rows, dim}, torch::kCUDA).to(dtype);
      auto [y, rstd] = kernels::rms_norm_forward(x, w, 1e-6);
      auto [yc, rstdc] = kernels::rms_norm_forward(xc, w, 1e-6);
      CHECK(torch::equal(y, yc));
      CHECK(torch::equal(rstd, rstdc));
      auto [dx, dw] = kernels::rms_norm_backward(dy, x, w, rstd);
      auto [dxc, dwc] = kernels::rms_norm_backward(dy, xc, w, rstdc);
      CHECK(torch::equal(dx, dxc));
      CHECK(torch::equal(dw, dwc));
      CHECK(dx.is_contiguous());
      // and through autograd (the model's path), the residual form's backward included
      auto xa = wide.clone().requires_grad_(), xb = wide.clone().requires_grad_();
      auto [on_a, ya] = kernels::rms_norm_pass(xa.narrow(1, 0, dim), w, 1e-6);
      auto [on_b, yb] = kernels::rms_norm_pass(xb.narrow(1, 0, dim).contiguous(), w, 1e-6);
      CHECK(torch::equal(ya, yb));
      ((ya.to(torch::kFloat32) * dy.to(torch::kFloat32)).sum() + on_a.to(torch::kFloat32).sum()).backward();
      ((yb.to(torch::kFloat32) * dy.to(torch::kFloat32)).sum() + on_b.to(torch::kFloat32).sum()).backward();
      CHECK(torch::equal(xa.grad(), xb.grad()));
    }
}

namespace {
// The unfused block the fused norms replace: h = x + r, y = norm(h), the pass's y1 = norm(x),
// with a loss over h and both norms' outputs so that every gradient sum is exercised.
struct BlockGrads {
  torch::Tensor h, y, y1, dx, dr, dw;
};
BlockGrads run_block(const torch::Tensor& x0, const torch::Tensor& r0, const torch::Tensor& w0, bool fused,
                     const torch::Tensor& ch, const torch::Tensor& cy, const torch::Tensor& cy1) {
  auto x = x0.clone().requires_grad_(), r = r0.clone().requires_grad_(), w = w0.clone().requires_grad_();
  torch::Tensor x_on, y1, h, y;
  if (fused) {
    std::tie(x_on, y1) = kernels::rms_norm_pass(x, w, 1e-5);
    std::tie(h, y) = kernels::add_rms_norm(x_on, r, w, 1e-5);
  } else {
    y1 = kernels::rms_norm(x, w, 1e-5);
    h = x + r;
    y = kernels::rms_norm(h, w, 1e-5);
  }
  ((h * ch).sum() + (y * cy).sum() + (y1 * cy1).sum()).backward();
  return {h.detach(), y.detach(), y1.detach(), x.grad(), r.grad(), w.grad()};
}
}  // namespace

TEST_CASE("add_rms_norm and rms_norm_pass: the unfused block's values and gradients, bit for bit, and what they refuse") {
  torch::manual_seed(3);
  std::vector<torch::Device> devices{torch::kCPU};
  if (!test::skip_without_cuda_kernels()) devices.push_back(torch::kCUDA);
  for (auto dev : devices)
    for (auto dtype : {torch::kFloat32, torch::kBFloat16})
      // 2048: the warp kernels' residual forms; 100: in bf16 (200-byte rows) the block kernel and
      // the sums by at::add, in fp32 (400 bytes) the warp kernels
      for (auto [rows, dim] : {std::pair<int64_t, int64_t>{333, 2048}, {8192, 2048}, {37, 100}}) {
        if (dev.is_cpu() && rows > 1000) continue;
        CAPTURE(dev);
        CAPTURE(dtype);
        CAPTURE(dim);
        auto opt = torch::TensorOptions().dtype(dtype).device(dev);
        auto x = torch::randn({rows, dim}, opt), r = torch::randn({rows, dim}, opt);
        auto w = (1 + 0.3 * torch::randn({dim}, opt.dtype(torch::kFloat32))).to(dtype);
        auto ch = torch::randn({rows, dim}, opt), cy = torch::randn({rows, dim}, opt), cy1 = torch::randn({rows, dim}, opt);
        auto a = run_block(x, r, w, true, ch, cy, cy1), b = run_block(x, r, w, false, ch, cy, cy1);
        CHECK(torch::equal(a.h, b.h));
        CHECK(torch::equal(a.y, b.y));
        CHECK(torch::equal(a.y1, b.y1));
        CHECK(torch::equal(a.dx, b.dx));
        CHECK(torch::equal(a.dr, b.dr));
        CHECK(torch::equal(a.dw, b.dw));
      }
  CHECK_THROWS_WITH_AS(kernels::add_rms_norm(torch::randn({3, 8}), torch::randn({3, 4}), torch::ones({8}), 1e-5),
                       doctest::Contains("add_rms_norm: x [3, 8]"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::rms_norm_pass(torch::randn({3, 8}), torch::ones({4}), 1e-5),
                       doctest::Contains("rms_norm: x must be [R, D] and w [D]"), c10::Error);
}

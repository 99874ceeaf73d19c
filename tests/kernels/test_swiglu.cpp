// swiglu_packed (kernels/swiglu.hpp): on CPU the reference's value and gradient against
// kernels::swiglu on the two halves, the refusal of a non-[M, 2F] input, and which inputs take
// the kernels; on a GPU the kernels against the reference, forward and backward, in bf16 and
// fp16 at GLM-4.7-Flash's expert width and at small shapes.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include "kernels/moe.hpp"
#include "kernels/swiglu.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::skip_without_cuda_kernels;

namespace {
// Largest |a - b| in units of b's 16-bit rounding step (2^-7 relative for bf16, 2^-10 for fp16;
// below the smallest normal value, the step there).
double max_steps(const torch::Tensor& a, const torch::Tensor& b) {
  const bool bf16 = a.scalar_type() == torch::kBFloat16;
  const double step = bf16 ? 1.0 / 128 : 1.0 / 1024, tiny = bf16 ? 1.2e-38 : 6.2e-5;
  auto af = a.to(torch::kFloat64), bf = b.to(torch::kFloat64);
  auto scale = bf.abs().clamp_min(tiny) * step;
  return ((af - bf).abs() / scale).max().item<double>();
}
}  // namespace

TEST_CASE("swiglu_packed: silu(gate) * up of the two halves, differentiable, and what it refuses") {
  torch::manual_seed(11);
  auto gu = torch::randn({6, 8}).requires_grad_();  // M 6, F 4
  auto y = kernels::swiglu_packed(gu);
  CHECK(y.sizes() == torch::IntArrayRef({6, 4}));
  auto g = gu.detach().narrow(1, 0, 4), u = gu.detach().narrow(1, 4, 4);
  CHECK(torch::allclose(y, g / (1 + torch::exp(-g)) * u, 1e-6, 1e-6));
  auto dy = torch::randn({6, 4});
  y.backward(dy);
  auto sig = torch::sigmoid(g);
  auto want_dg = dy * u * sig * (1 + g * (1 - sig)), want_du = dy * g * sig;
  CHECK(torch::allclose(gu.grad().narrow(1, 0, 4), want_dg, 1e-5, 1e-6));
  CHECK(torch::allclose(gu.grad().narrow(1, 4, 4), want_du, 1e-5, 1e-6));
  CHECK_FALSE(kernels::swiglu_packed_uses_kernel(gu));  // CPU: the reference
  CHECK_THROWS_WITH_AS(kernels::swiglu_packed(torch::randn({3, 5})), doctest::Contains("[M, 2F], got [3, 5]"),
                       c10::Error);
  CHECK_THROWS_WITH_AS(kernels::swiglu_packed(torch::randn({8})), doctest::Contains("[M, 2F]"), c10::Error);
}

TEST_CASE("CUDA: swiglu_packed kernels equal the reference within one 16-bit rounding step, forward and backward") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(12);
  const torch::Device dev(torch::kCUDA);
  for (auto dtype : {torch::kBFloat16, torch::kHalf})
    for (auto [M, F] : {std::pair<int64_t, int64_t>{1, 8}, {37, 64}, {32768, 1536}}) {
      auto opt = torch::TensorOptions().dtype(dtype).device(dev);
      auto gu = (2 * torch::randn({M, 2 * F}, opt)).requires_grad_();
      auto gu_ref = gu.detach().clone().requires_grad_();
      REQUIRE(kernels::swiglu_packed_uses_kernel(gu));
      auto dy = torch::randn({M, F}, opt);
      auto y = kernels::swiglu_packed(gu), y_ref = kernels::swiglu_packed_ref(gu_ref);
      y.backward(dy);
      y_ref.backward(dy);
      INFO("dtype " << dtype << " M " << M << " F " << F);
      CHECK((y.scalar_type() == dtype));
      CHECK(max_steps(y, y_ref) <= 1.0);
      CHECK(max_steps(gu.grad(), gu_ref.grad()) <= 1.0);
      // nearly all bits equal: the same ops and roundings as LibTorch's
      const double same = torch::eq(gu.grad(), gu_ref.grad()).to(torch::kFloat64).mean().item<double>();
      INFO("equal gradient elements " << same);
      CHECK(same >= 0.999);
    }
  // a limit or fp32 takes the reference
  auto gu = torch::randn({4, 32}, torch::TensorOptions().dtype(torch::kBFloat16).device(dev));
  CHECK_FALSE(kernels::swiglu_packed_uses_kernel(gu, 7.0));
  CHECK_FALSE(kernels::swiglu_packed_uses_kernel(gu.to(torch::kFloat32)));
  CHECK(torch::equal(kernels::swiglu_packed(gu, 7.0), kernels::swiglu_packed_ref(gu, 7.0)));
}

TEST_CASE("swiglu_pair: silu(gate) * up of two tensors, differentiable in both, and what it refuses") {
  torch::manual_seed(13);
  auto gate = torch::randn({5, 8}).requires_grad_(), up = torch::randn({5, 8}).requires_grad_();
  auto y = kernels::swiglu_pair(gate, up);
  CHECK(torch::equal(y, kernels::swiglu(gate, up)));
  auto dy = torch::randn({5, 8});
  y.backward(dy);
  auto g = gate.detach(), sig = torch::sigmoid(g);
  CHECK(torch::allclose(gate.grad(), dy * up.detach() * sig * (1 + g * (1 - sig)), 1e-5, 1e-6));
  CHECK(torch::allclose(up.grad(), dy * g * sig, 1e-5, 1e-6));
  CHECK_FALSE(kernels::swiglu_pair_uses_kernel(gate, up));  // CPU: kernels::swiglu
  CHECK(torch::equal(kernels::swiglu_pair(g, up.detach(), 0.5), kernels::swiglu(g, up.detach(), 0.5)));
  CHECK_THROWS_WITH_AS(kernels::swiglu_pair(torch::randn({5, 8}), torch::randn({5, 4})),
                       doctest::Contains("gate [5, 8] and up [5, 4] differ"), c10::Error);
}

TEST_CASE("CUDA: swiglu_pair kernels equal kernels::swiglu within one 16-bit rounding step, from strided rows too") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(14);
  const torch::Device dev(torch::kCUDA);
  for (auto dtype : {torch::kBFloat16, torch::kHalf})
    for (auto [M, F] : {std::pair<int64_t, int64_t>{1, 8}, {37, 64}, {8192, 10240}}) {
      auto opt = torch::TensorOptions().dtype(dtype).device(dev);
      // gate contiguous, up a column block of a wider tensor (rows at a stride)
      auto gate = (2 * torch::randn({M, F}, opt)).requires_grad_();
      auto wide = (2 * torch::randn({M, F + 16}, opt)).requires_grad_();
      auto up = wide.narrow(1, 16, F);
      REQUIRE(kernels::swiglu_pair_uses_kernel(gate, up));
      auto gate_ref = gate.detach().clone().requires_grad_(), up_ref = up.detach().clone().requires_grad_();
      auto dy = torch::randn({M, F}, opt);
      auto y = kernels::swiglu_pair(gate, up), y_ref = kernels::swiglu(gate_ref, up_ref);
      y.backward(dy);
      y_ref.backward(dy);
      INFO("dtype " << dtype << " M " << M << " F " << F);
      CHECK(max_steps(y, y_ref) <= 1.0);
      CHECK(max_steps(gate.grad(), gate_ref.grad()) <= 1.0);
      CHECK(max_steps(wide.grad().narrow(1, 16, F), up_ref.grad()) <= 1.0);
      CHECK(torch::equal(wide.grad().narrow(1, 0, 16), torch::zeros({M, 16}, opt)));
      const double same = torch::eq(y, y_ref).to(torch::kFloat64).mean().item<double>();
      INFO("equal output elements " << same);
      CHECK(same >= 0.999);
    }
}

TEST_CASE("swiglu_pair_backward: autograd's gradients of kernels::swiglu, clamped too, and what it refuses (CPU)") {
  torch::manual_seed(15);
  for (std::optional<double> limit : {std::optional<double>(), std::optional<double>(0.6)}) {
    auto gate = torch::randn({7, 8}).requires_grad_(), up = torch::randn({7, 8}).requires_grad_();
    auto dy = torch::randn({7, 8});
    auto want = torch::autograd::grad({kernels::swiglu(gate, up, limit)}, {gate, up}, {dy});
    auto [dg, du, act] = kernels::swiglu_pair_backward(gate.detach(), up.detach(), dy, limit);
    INFO("limit " << (limit ? *limit : 0.0));
    CHECK(torch::equal(dg, want[0]));
    CHECK(torch::equal(du, want[1]));
    CHECK_FALSE(act.defined());  // not asked for
    if (limit) CHECK(du.eq(0).any().item<bool>());  // clamped entries pass no gradient
    auto with_act = kernels::swiglu_pair_backward(gate.detach(), up.detach(), dy, limit, /*want_act=*/true);
    CHECK(torch::equal(with_act.dgate, want[0]));
    CHECK(torch::equal(with_act.dup, want[1]));
    CHECK(torch::equal(with_act.act, kernels::swiglu(gate.detach(), up.detach(), limit)));
  }
  CHECK_THROWS_WITH_AS(kernels::swiglu_pair_backward(torch::randn({2, 8}), torch::randn({2, 8}), torch::randn({2, 4})),
                       doctest::Contains("dy [2, 4] differ"), c10::Error);
}

TEST_CASE("CUDA: swiglu_pair_backward's kernel gives swiglu_pair's autograd gradients, bit for bit") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(16);
  auto opt = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  for (auto [M, F] : {std::pair<int64_t, int64_t>{37, 64}, {8192, 10240}}) {
    auto gate = (2 * torch::randn({M, F}, opt)).requires_grad_(), up = (2 * torch::randn({M, F}, opt)).requires_grad_();
    REQUIRE(kernels::swiglu_pair_uses_kernel(gate, up));
    auto dy = torch::randn({M, F}, opt);
    auto want = torch::autograd::grad({kernels::swiglu_pair(gate, up)}, {gate, up}, {dy});
    auto [dg, du, no_act] = kernels::swiglu_pair_backward(gate.detach(), up.detach(), dy);
    CHECK(torch::equal(dg, want[0]));
    CHECK(torch::equal(du, want[1]));
    CHECK_FALSE(no_act.defined());
    // The activation from the same pass: swiglu_pair's forward bits, the gradients unchanged.
    auto r = kernels::swiglu_pair_backward(gate.detach(), up.detach(), dy, std::nullopt, /*want_act=*/true);
    CHECK(torch::equal(r.act, kernels::swiglu_pair(gate.detach(), up.detach())));
    CHECK(torch::equal(r.dgate, want[0]));
    CHECK(torch::equal(r.dup, want[1]));
  }
}

// kernels::router_logits (kernels/router_logits.hpp): on CPU the reference and what it refuses;
// on a GPU the kernel against its contract, every output summed over k in order in fp32 (the
// host sums the same way: the same bits), at GLM-4.7-Flash's router [64, 2048] and at shapes
// that leave partial blocks and a partial K slice, from a strided x, the same bits for a row
// whatever M, and the model's unsplit_linear_fp32 taking it.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <cstring>
#include <vector>

#include "kernels/router_logits.hpp"
#include "model/blocks/basic.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::skip_without_cuda_kernels;

namespace {
// y[m, n] = sum over k in order, in fp32, of float(x) float(w): exact products, one rounding per add.
torch::Tensor sequential_fp32(const torch::Tensor& x, const torch::Tensor& w) {
  const auto xf = x.to(torch::kCPU).to(torch::kFloat32).contiguous(), wf = w.to(torch::kCPU).to(torch::kFloat32).contiguous();
  const int64_t M = xf.size(0), N = wf.size(0), K = xf.size(1);
  auto y = torch::empty({M, N});
  const float *xp = xf.data_ptr<float>(), *wp = wf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += xp[m * K + k] * wp[n * K + k];
      yp[m * N + n] = acc;
    }
  return y;
}
bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  const auto ac = a.to(torch::kCPU).contiguous(), bc = b.to(torch::kCPU).contiguous();
  return ac.sizes() == bc.sizes() && ac.scalar_type() == bc.scalar_type() &&
         std::memcmp(ac.data_ptr(), bc.data_ptr(), size_t(ac.numel()) * ac.element_size()) == 0;
}
}  // namespace

TEST_CASE("router_logits: the fp32 linear of the casts on CPU, and what it refuses") {
  torch::manual_seed(5);
  const auto x = torch::randn({13, 24}).to(torch::kBFloat16), w = torch::randn({6, 24}).to(torch::kBFloat16);
  CHECK_FALSE(kernels::router_logits_uses_kernel(x, w));
  const auto y = kernels::router_logits(x, w);
  CHECK((y.scalar_type() == torch::kFloat32));
  CHECK(y.sizes() == torch::IntArrayRef({13, 6}));
  CHECK(torch::equal(y, torch::nn::functional::linear(x.to(torch::kFloat32), w.to(torch::kFloat32))));
  CHECK(torch::allclose(y, sequential_fp32(x, w), 1e-5, 1e-5));
  CHECK_THROWS_WITH_AS(kernels::router_logits(x, torch::zeros({6, 23}, torch::kBFloat16)),
                       doctest::Contains("router_logits: x [M, K] and w [N, K] expected, got x [13, 24] and w [6, 23]"),
                       c10::Error);
  CHECK_THROWS_WITH_AS(kernels::router_logits(x, w.to(torch::kFloat32)),
                       doctest::Contains("router_logits: x and w must share dtype and device"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::router_logits(x.view({13, 2, 12}), w),
                       doctest::Contains("router_logits: x [M, K] and w [N, K] expected"), c10::Error);
}

TEST_CASE("router_logits CUDA: each output summed over k in order in fp32, the same bits at every M") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(6);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  struct Shape {
    int64_t M, N, K;
  };
  // GLM-4.7-Flash's router; partial row and column blocks; a K that is not a whole 32-wide slice;
  // one row (a decode step). The row counts reach each of the kernel's block shapes
  // (kernels/router_logits_cuda.hpp: 16 x 16 below 2048 rows, 32 x 32 to 4096, 64 x 64 above),
  // each with partial blocks.
  for (const auto s : {Shape{300, 64, 2048}, Shape{131, 100, 40}, Shape{1, 64, 2048}, Shape{70, 3, 8},
                       Shape{2050, 100, 40}, Shape{2100, 64, 2048}, Shape{2077, 3, 8}, Shape{6200, 100, 40},
                       Shape{4183, 3, 8}}) {
    CAPTURE(s.M);
    CAPTURE(s.N);
    CAPTURE(s.K);
    const auto x = torch::randn({s.M, s.K}, cuda), w = (torch::randn({s.N, s.K}, cuda) * 0.05).to(torch::kBFloat16);
    REQUIRE(kernels::router_logits_uses_kernel(x, w));
    const auto y = kernels::router_logits(x, w);
    CHECK((y.scalar_type() == torch::kFloat32));
    CHECK(same_bits(y, sequential_fp32(x, w)));
    // Within fp32 rounding of the reference GEMM (summed in cuBLAS's order).
    CHECK(torch::allclose(y, kernels::router_logits_ref(x, w), 1e-4, 1e-4));
  }
  // What the kernel does not take goes to the reference: K not a multiple of 8, rows off a
  // 16-byte boundary, fp32 operands.
  {
    const auto w12 = torch::randn({64, 12}, cuda), x12 = torch::randn({5, 12}, cuda);
    CHECK_FALSE(kernels::router_logits_uses_kernel(x12, w12));
    CHECK(torch::equal(kernels::router_logits(x12, w12), kernels::router_logits_ref(x12, w12)));
    const auto wide = torch::randn({9, 2056}, cuda), w2048 = torch::randn({64, 2048}, cuda);
    const auto shifted = wide.narrow(1, 1, 2048);  // starts 2 bytes past the row's boundary
    CHECK_FALSE(kernels::router_logits_uses_kernel(shifted, w2048));
    CHECK(torch::equal(kernels::router_logits(shifted, w2048), kernels::router_logits_ref(shifted, w2048)));
    CHECK_FALSE(kernels::router_logits_uses_kernel(shifted.to(torch::kFloat32), w2048.to(torch::kFloat32)));
  }
  // Rows with a stride (x a view of wider rows: in the 16 x 16 and the 64 x 64 block shapes) and a
  // row with a NaN (only its own outputs NaN).
  const auto wide = torch::randn({6200, 4096}, cuda);
  const auto w = (torch::randn({64, 2048}, cuda) * 0.05).to(torch::kBFloat16);
  const auto x_all = wide.narrow(1, 1024, 2048);
  REQUIRE(x_all.stride(0) == 4096);
  REQUIRE(kernels::router_logits_uses_kernel(x_all, w));
  CHECK(same_bits(kernels::router_logits(x_all, w), sequential_fp32(x_all, w)));
  const auto x = x_all.narrow(0, 0, 257);
  CHECK(same_bits(kernels::router_logits(x, w), sequential_fp32(x, w)));
  const auto x_nan = x.clone();
  x_nan[7][100] = std::nanf("");
  const auto y_nan = kernels::router_logits(x_nan, w).cpu();
  CHECK(y_nan[7].isnan().all().item<bool>());
  CHECK_FALSE(y_nan.narrow(0, 0, 7).isnan().any().item<bool>());
  CHECK_FALSE(y_nan.narrow(0, 8, 249).isnan().any().item<bool>());
  // A token's logits the same bits alone, in a few rows and in the trainer's 8192 (the row
  // counts reach each of the kernel's block shapes: kernels/router_logits_cuda.hpp).
  const auto big = torch::randn({8192, 2048}, cuda);
  const auto y_big = kernels::router_logits(big, w);
  CHECK(same_bits(y_big, sequential_fp32(big, w)));
  for (const int64_t m : {int64_t(1), int64_t(5), int64_t(77), int64_t(1024), int64_t(4096)}) {
    CAPTURE(m);
    CHECK(same_bits(kernels::router_logits(big.narrow(0, 8192 - m, m), w), y_big.narrow(0, 8192 - m, m)));
  }
  // The model's router GEMM takes it: unsplit_linear_fp32's forward is these bits, its
  // gradients those of the bf16 backward (kernels/router_logits.hpp; model/blocks/basic.hpp).
  const auto xs = big.narrow(0, 0, 512).detach().requires_grad_(true);
  const auto ws = w.detach().requires_grad_(true);
  const auto y_model = model::unsplit_linear_fp32(xs, ws);
  CHECK(same_bits(y_model.detach(), y_big.narrow(0, 0, 512)));
  const auto g = torch::randn({512, 64}, cuda.dtype(torch::kFloat32));
  const auto grads = torch::autograd::grad({y_model}, {xs, ws}, {g});
  const auto g16 = g.to(torch::kBFloat16);
  CHECK(same_bits(grads[0], g16.mm(w)));
  CHECK(same_bits(grads[1], g16.t().mm(big.narrow(0, 0, 512))));
}

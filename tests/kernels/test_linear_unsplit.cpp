// kernels::linear_unsplit and model::unsplit_linear: on CPU the value of at::linear and its
// gradients, and the errors; on a GPU (GLM-4.7-Flash's two projections that cuBLAS splits over
// K at few rows: o_proj [2048 x 5120], the dense layer's down projection [2048 x 10240]; the
// router's fp32 [64 x 2048], which cuBLAS splits at every row count) every row has the same bits
// whatever the number of rows sharing the call (1 .. 8192), its offset in the batch or the row
// stride, inside a CUDA graph too, and the backward is torch's.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <vector>

#include "kernels/cuda_graph.hpp"
#include "kernels/linear_unsplit.hpp"
#include "model/blocks/basic.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::skip_without_cuda_kernels;

namespace {
bool same_bits(const torch::Tensor& a, const torch::Tensor& b) { return a.sizes() == b.sizes() && torch::equal(a, b); }
}  // namespace

TEST_CASE("linear_unsplit on CPU is at::linear, unsplit_linear has linear's gradients, and bad shapes are refused by name") {
  torch::manual_seed(1);
  auto x = torch::randn({5, 3, 16});
  auto w = torch::randn({24, 16});
  CHECK(same_bits(kernels::linear_unsplit(x.view({15, 16}), w), at::linear(x.view({15, 16}), w)));
  auto xa = x.clone().requires_grad_(), wa = w.clone().requires_grad_();
  auto xb = x.clone().requires_grad_(), wb = w.clone().requires_grad_();
  auto ya = model::unsplit_linear(xa, wa);
  CHECK(ya.sizes() == std::vector<int64_t>{5, 3, 24});
  (ya * ya).sum().backward();
  (torch::linear(xb, wb).pow(2)).sum().backward();
  CHECK(torch::allclose(xa.grad(), xb.grad()));
  CHECK(torch::allclose(wa.grad(), wb.grad()));
  CHECK_THROWS_WITH_AS(kernels::linear_unsplit(torch::randn({4, 8}), torch::randn({6, 9})),
                       doctest::Contains("x [M, K] and w [N, K] with one K, got x [4, 8] and w [6, 9]"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::linear_unsplit(torch::randn({4, 8}), torch::randn({6, 8}, torch::kFloat64)),
                       doctest::Contains("x is Float, w is Double"), c10::Error);
  CHECK_THROWS_WITH_AS(model::unsplit_linear(torch::randn({4, 7}), torch::randn({6, 8})),
                       doctest::Contains("x's last dim must be w's K = 8, got x [4, 7]"), std::invalid_argument);
  CHECK_FALSE(kernels::linear_unsplit_uses_cublaslt(torch::randn({4, 8}).to(torch::kBFloat16), torch::randn({8, 8}).to(torch::kBFloat16)));
}

TEST_CASE("CUDA: linear_unsplit gives a row the same bits at every batch size, offset and row stride (GLM-4.7-Flash's split-K shapes)") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(2);
  torch::NoGradGuard no_grad;
  const auto opt = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  for (auto [N, K] : std::vector<std::pair<int64_t, int64_t>>{{2048, 5120}, {2048, 10240}, {576, 2048}}) {
    CAPTURE(N);
    CAPTURE(K);
    auto w = torch::randn({N, K}, opt) / std::sqrt(double(K));
    auto x = torch::randn({8192, K}, opt);
    REQUIRE(kernels::linear_unsplit_uses_cublaslt(x, w));
    const auto ref = kernels::linear_unsplit(x, w);  // [8192, N]
    // cuBLAS's own GEMM at this many rows does not split either: the same bits.
    CHECK(same_bits(ref, at::linear(x, w)));
    int64_t split_rows = 0;  // batch sizes at which cuBLAS's own choice differs (split-K)
    for (int64_t m : {1, 2, 3, 8, 17, 32, 64, 128, 256, 1000, 1024, 4097}) {
      CAPTURE(m);
      CHECK(same_bits(kernels::linear_unsplit(x.narrow(0, 0, m), w), ref.narrow(0, 0, m)));
      CHECK(same_bits(kernels::linear_unsplit(x.narrow(0, 8192 - m, m).contiguous(), w), ref.narrow(0, 8192 - m, m)));
      split_rows += !same_bits(at::linear(x.narrow(0, 0, m), w), ref.narrow(0, 0, m));
    }
    // Rows of a wider tensor (row stride 2K) and an odd offset into it.
    auto wide = torch::randn({40, 2 * K}, opt);
    auto view = wide.narrow(1, 8, K);
    CHECK(same_bits(kernels::linear_unsplit(view, w), kernels::linear_unsplit(view.contiguous(), w)));
    auto odd = wide.narrow(1, 1, K);  // 2 bytes past a 16-byte boundary: copied, not refused
    CHECK(same_bits(kernels::linear_unsplit(odd, w), kernels::linear_unsplit(odd.contiguous(), w)));
    MESSAGE("N " << N << " K " << K << ": cuBLAS's own GEMM differs from the unsplit one at " << split_rows
                 << " of 12 batch sizes");
  }
}

TEST_CASE("CUDA: linear_unsplit in fp32 (the router's [64 x 2048]) gives a row the same bits at every batch size, close to at::linear") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(4);
  torch::NoGradGuard no_grad;
  const auto opt = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat32);
  auto w = torch::randn({64, 2048}, opt) / std::sqrt(2048.0);
  auto x = torch::randn({8192, 2048}, opt);
  REQUIRE(kernels::linear_unsplit_uses_cublaslt(x, w));
  const auto ref = kernels::linear_unsplit(x, w);
  CHECK(torch::allclose(ref, at::linear(x, w), 1e-5, 1e-5));
  CHECK(torch::allclose(ref.cpu(), at::linear(x.cpu(), w.cpu()), 1e-5, 1e-5));  // full fp32, not TF32
  for (int64_t m : {1, 2, 32, 128, 1024}) {
    CAPTURE(m);
    CHECK(same_bits(kernels::linear_unsplit(x.narrow(0, 8192 - m, m).contiguous(), w), ref.narrow(0, 8192 - m, m)));
  }
}

TEST_CASE("CUDA: linear_unsplit in a CUDA graph, and unsplit_linear's gradients are torch's") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(3);
  const auto opt = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  auto w = torch::randn({2048, 5120}, opt) / 70.0;
  auto x = torch::randn({32, 5120}, opt);
  torch::Tensor y;
  {
    torch::NoGradGuard no_grad;
    auto pool = kernels::GraphPool::make();
    kernels::CapturedGraph graph(torch::Device(torch::kCUDA), pool, [&] { y = kernels::linear_unsplit(x, w); });
    for (int round = 0; round < 2; ++round) {
      x.copy_(torch::randn_like(x));
      graph.replay();
      CHECK(same_bits(y, kernels::linear_unsplit(x, w)));
    }
  }
  auto xa = x.clone().requires_grad_(), wa = w.clone().requires_grad_();
  auto xb = x.clone().requires_grad_(), wb = w.clone().requires_grad_();
  auto g = torch::randn({32, 2048}, opt);
  (model::unsplit_linear(xa, wa) * g).sum().backward();
  (torch::linear(xb, wb) * g).sum().backward();
  CHECK(same_bits(xa.grad(), xb.grad()));
  CHECK(torch::allclose(wa.grad().to(torch::kFloat32), wb.grad().to(torch::kFloat32), 1e-2, 1e-2));
}

TEST_CASE("linear_unsplit_into_groups on CPU: each group's slot gets linear_unsplit's values, the rest of out is untouched, bad shapes refused") {
  torch::manual_seed(3);
  const int64_t M = 7, G = 3, N = 8, K = 16, W = 12;  // each group's N columns in a slot of W
  auto x = torch::randn({M, K}), w = torch::randn({G, N, K});
  auto out = torch::full({M, G, W}, 7.0f);
  kernels::linear_unsplit_into_groups(x, w, out.narrow(2, 0, N));
  CHECK(same_bits(out.narrow(2, 0, N), kernels::linear_unsplit(x, w.view({G * N, K})).view({M, G, N})));
  CHECK(torch::all(out.narrow(2, N, W - N) == 7.0f).item<bool>());
  // A group-strided weight (a narrow of a wider one) is taken as it is.
  auto wide = torch::randn({G, N + 4, K});
  kernels::linear_unsplit_into_groups(x, wide.narrow(1, 0, N), out.narrow(2, 0, N));
  CHECK(same_bits(out.narrow(2, 0, N), kernels::linear_unsplit(x, wide.narrow(1, 0, N).reshape({G * N, K})).view({M, G, N})));
  CHECK_THROWS_WITH_AS(kernels::linear_unsplit_into_groups(x, w, torch::empty({M, G, N + 1})),
                       doctest::Contains("w [G, N, K] and out [M, G, N] expected for x [M, K], got x [7, 16], w [3, 8, 16] and out [7, 3, 9]"),
                       c10::Error);
  CHECK_THROWS_WITH_AS(kernels::linear_unsplit_into_groups(x, torch::randn({G, N, K + 1}), torch::empty({M, G, N})),
                       doctest::Contains("with one K"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::linear_unsplit_into_groups(x, w, torch::empty({M, G, N}, torch::kFloat64)),
                       doctest::Contains("out is Double"), c10::Error);
}

TEST_CASE("CUDA: linear_unsplit_into_groups writes linear_unsplit's bits into strided slots (MLA's keys), in one call or copied in") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(4);
  const torch::Device dev(torch::kCUDA);
  // GLM-4.7-Flash's key projection: 20 heads of 192 from the 512-wide latent, into [M, 20, 256].
  const int64_t G = 20, N = 192, K = 512, W = 256;
  for (auto dtype : {torch::kBFloat16, torch::kFloat32})
    for (int64_t M : {1, 31, 1500, 8192}) {
      INFO("dtype " << dtype << " M " << M);
      auto opt = torch::TensorOptions().dtype(dtype).device(dev);
      auto x = torch::randn({M, K}, opt), wide = torch::randn({G, N + 256, K}, opt) / 16;
      const auto w = wide.narrow(1, 0, N);  // the key rows of kv_b's [H, N+V, C]
      const auto expect = kernels::linear_unsplit(x, w.reshape({G * N, K})).view({M, G, N});
      auto out = torch::full({M, G, W}, 3.0, opt);
      kernels::linear_unsplit_into_groups(x, w, out.narrow(2, 0, N));
      CHECK(same_bits(out.narrow(2, 0, N), expect));
      CHECK(torch::all(out.narrow(2, N, W - N) == 3.0).item<bool>());
      // Slots off the 16-byte grid (group stride 193): copied in, the same bits.
      auto odd = torch::full({M, G, N + 1}, 3.0, opt);
      kernels::linear_unsplit_into_groups(x, w, odd.narrow(2, 0, N));
      CHECK(same_bits(odd.narrow(2, 0, N), expect));
      CHECK(torch::all(odd.narrow(2, N, 1) == 3.0).item<bool>());
    }
}

TEST_CASE("unsplit_linear_pair: two projections of one x, linear's values and gradients, frozen and unused parts, bad shapes refused") {
  torch::manual_seed(4);
  const auto x = torch::randn({6, 16}, torch::kFloat64), w1 = torch::randn({24, 16}, torch::kFloat64),
             w2 = torch::randn({10, 16}, torch::kFloat64);
  // fp64: the pair's sum g1 w1 + g2 w2 (a GEMM, then one accumulated into it) against autograd's
  // two GEMMs and an add, to fp64 rounding
  const auto close = [](const torch::Tensor& a, const torch::Tensor& b) { return torch::allclose(a, b, 1e-12, 1e-12); };
  for (const bool x_grad : {true, false})
    for (const bool w1_grad : {true, false})
      for (const bool use_y2 : {true, false}) {
        CAPTURE(x_grad);
        CAPTURE(w1_grad);
        CAPTURE(use_y2);
        if (!x_grad && !w1_grad && !use_y2) continue;  // nothing with a gradient: autograd's side refuses backward()
        auto xa = x.clone().requires_grad_(x_grad), w1a = w1.clone().requires_grad_(w1_grad), w2a = w2.clone().requires_grad_();
        auto xb = x.clone().requires_grad_(x_grad), w1b = w1.clone().requires_grad_(w1_grad), w2b = w2.clone().requires_grad_();
        auto [y1, y2] = model::unsplit_linear_pair(xa, w1a, w2a);
        CHECK(same_bits(y1, at::linear(x, w1)));
        CHECK(same_bits(y2, at::linear(x, w2)));
        (y1.pow(2).sum() + (use_y2 ? y2.sin().sum() : torch::zeros({}, torch::kFloat64))).backward();
        (torch::linear(xb, w1b).pow(2).sum() + (use_y2 ? torch::linear(xb, w2b).sin().sum() : torch::zeros({}, torch::kFloat64)))
            .backward();
        CHECK(xa.grad().defined() == x_grad);
        if (x_grad) CHECK(close(xa.grad(), xb.grad()));
        CHECK(w1a.grad().defined() == w1_grad);
        if (w1_grad) CHECK(close(w1a.grad(), w1b.grad()));
        CHECK(w2a.grad().defined() == use_y2);  // an output without a gradient: none for its weight
        if (use_y2) CHECK(close(w2a.grad(), w2b.grad()));
      }
  CHECK_THROWS_WITH_AS(model::unsplit_linear_pair(torch::randn({4, 16}), torch::randn({24, 16}), torch::randn({10, 15})),
                       doctest::Contains("x must be [M, K] for w1 [N1, K] and w2 [N2, K], got x [4, 16], w1 [24, 16], w2 [10, 15]"),
                       std::invalid_argument);
}

TEST_CASE("CUDA: unsplit_linear_pair's outputs are unsplit_linear's bits, its weights' gradients too, and x's no further from fp64 than two calls'") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(5);
  const auto opt = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  // MLA's q_a / kv_a at GLM-4.7-Flash's shapes, and one output without a gradient
  for (const bool both : {true, false}) {
    CAPTURE(both);
    auto x = torch::randn({4096, 2048}, opt), w1 = torch::randn({768, 2048}, opt) / 45.0,
         w2 = torch::randn({576, 2048}, opt) / 45.0;
    REQUIRE(kernels::linear_unsplit_uses_cublaslt(x, w1));
    auto g1 = torch::randn({4096, 768}, opt), g2 = torch::randn({4096, 576}, opt);
    auto xa = x.clone().requires_grad_(), w1a = w1.clone().requires_grad_(), w2a = w2.clone().requires_grad_();
    auto [y1, y2] = model::unsplit_linear_pair(xa, w1a, w2a);
    CHECK(same_bits(y1, kernels::linear_unsplit(x, w1)));
    CHECK(same_bits(y2, kernels::linear_unsplit(x, w2)));
    ((y1 * g1).sum() + (both ? (y2 * g2).sum() : torch::zeros({}, opt))).backward();
    auto xb = x.clone().requires_grad_(), w1b = w1.clone().requires_grad_(), w2b = w2.clone().requires_grad_();
    ((model::unsplit_linear(xb, w1b) * g1).sum() + (both ? (model::unsplit_linear(xb, w2b) * g2).sum() : torch::zeros({}, opt)))
        .backward();
    CHECK(same_bits(w1a.grad(), w1b.grad()));  // the same GEMM
    if (both) CHECK(same_bits(w2a.grad(), w2b.grad()));
    else CHECK_FALSE(w2a.grad().defined());
    // x's: bf16(g1 w1) + g2 w2 summed in the second GEMM's fp32 and rounded (two roundings), against
    // bf16(g1 w1) + bf16(g2 w2) rounded again (three): no further from the fp64 sum, in its
    // largest and its mean difference
    auto truth = g1.to(torch::kFloat64).mm(w1.to(torch::kFloat64));
    if (both) truth += g2.to(torch::kFloat64).mm(w2.to(torch::kFloat64));
    const auto err_pair = (xa.grad().to(torch::kFloat64) - truth).abs(), err_two = (xb.grad().to(torch::kFloat64) - truth).abs();
    INFO("|x grad - fp64|: pair max " << err_pair.max().item<double>() << " mean " << err_pair.mean().item<double>()
                                     << ", two calls max " << err_two.max().item<double>() << " mean "
                                     << err_two.mean().item<double>());
    CHECK(err_pair.max().item<double>() <= err_two.max().item<double>() * 1.01);
    CHECK(err_pair.mean().item<double>() <= err_two.mean().item<double>() * 1.01);
  }
}

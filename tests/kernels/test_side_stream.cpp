// kernels::run_beside (kernels/side_stream.hpp): on the CPU side() then main() in this thread;
// on a GPU two GEMM chains on two streams give the sequential chains' bits, the side's result
// is safe to use on the current stream at once, and a throwing main() still joins.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <stdexcept>
#include <string>

#include "kernels/side_stream.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::skip_without_cuda_kernels;

TEST_CASE("run_beside on the CPU: side() first, then main(), both results returned, a throw propagates") {
  std::string order;
  auto x = torch::arange(6, torch::kFloat32);
  auto [m, s] = kernels::run_beside(
      torch::kCPU, [&] { order += "main "; return x * 2; }, [&] { order += "side "; return x + 1; }, {x});
  CHECK(order == "side main ");
  CHECK(torch::equal(m, x * 2));
  CHECK(torch::equal(s, x + 1));
  CHECK_THROWS_WITH_AS(kernels::run_beside(
                           torch::kCPU, [&]() -> torch::Tensor { throw std::runtime_error("main failed"); },
                           [&] { return x; }, {}),
                       "main failed", std::runtime_error);
  bool main_ran = false;
  CHECK_THROWS_WITH_AS(kernels::run_beside(
                           torch::kCPU, [&] { main_ran = true; return x; },
                           [&]() -> torch::Tensor { throw std::runtime_error("side failed"); }, {}),
                       "side failed", std::runtime_error);
  CHECK_FALSE(main_ran);
}

TEST_CASE("CUDA: run_beside's two GEMM chains give the sequential chains' bits, its results usable at once, a throwing main still joined") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(7);
  const auto opt = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  auto a = torch::randn({2048, 2048}, opt) * 0.03, b = torch::randn({2048, 2048}, opt) * 0.03;
  auto chain = [](torch::Tensor x, const torch::Tensor& w, int n) {
    for (int i = 0; i < n; ++i) x = torch::tanh(torch::mm(x, w));
    return x;
  };
  const auto want_main = chain(a, b, 20), want_side = chain(b, a, 20);
  for (int rep = 0; rep < 3; ++rep) {
    // Inputs written just before on the current stream: the side stream must wait for them.
    auto a2 = a.clone(), b2 = b.clone();
    auto [m, s] = kernels::run_beside(
        a.device(), [&] { return chain(a2, b2, 20); }, [&] { return chain(b2, a2, 20); }, {a2, b2});
    auto sum = m.to(torch::kFloat32) + s.to(torch::kFloat32);  // s read on the current stream at once
    CHECK(torch::equal(m, want_main));
    CHECK(torch::equal(s, want_side));
    CHECK(torch::equal(sum, want_main.to(torch::kFloat32) + want_side.to(torch::kFloat32)));
  }
  // With autograd: the gradients through both streams equal the sequential ones.
  auto w1 = (torch::randn({512, 512}, opt) * 0.05).requires_grad_(), w2 = (torch::randn({512, 512}, opt) * 0.05).requires_grad_();
  auto x = torch::randn({4096, 512}, opt).requires_grad_();
  auto grads = [&](bool beside) {
    torch::Tensor y;
    if (beside) {
      auto [m, s] = kernels::run_beside(
          x.device(), [&] { return torch::relu(torch::mm(x, w1)); }, [&] { return torch::gelu(torch::mm(x, w2)); }, {x});
      y = m + s;
    } else {
      auto s = torch::gelu(torch::mm(x, w2));
      y = torch::relu(torch::mm(x, w1)) + s;
    }
    return torch::autograd::grad({y.to(torch::kFloat32).square().sum()}, {x, w1, w2});
  };
  const auto g_seq = grads(false), g_side = grads(true);
  for (std::size_t i = 0; i < g_seq.size(); ++i) {
    CAPTURE(i);
    CHECK(torch::equal(g_seq[i], g_side[i]));
  }
  // main() throws after side() queued its work: the error propagates and the current stream has
  // waited for the side's work (its result, read back here, is complete).
  torch::Tensor side_out;
  CHECK_THROWS_WITH_AS(kernels::run_beside(
                           a.device(), [&]() -> torch::Tensor { throw std::runtime_error("main failed"); },
                           [&] { return side_out = chain(b, a, 20); }, {}),
                       "main failed", std::runtime_error);
  CHECK(torch::equal(side_out, want_side));
}

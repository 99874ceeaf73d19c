// The decode-step routed experts (kernels/moe_decode.hpp): against the per-row formula in fp64 on
// fresh random inputs (empty experts, experts holding more rows than a pass of 32 takes), with the
// SwiGLU clamp, inside kernels::DecodeExpertsGuard only for inference at few rows, and captured in
// a CUDA graph with the row counts rewritten between replays.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include "kernels/cuda_graph.hpp"
#include "kernels/moe.hpp"
#include "kernels/moe_decode.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::rel_error;
using kiln::test::skip_without_cuda_kernels;

namespace {

// y[r] = w2[e] swiglu(w1[e] x[r]) in fp64, rows in expert order.
torch::Tensor formula(const torch::Tensor& x, const std::vector<int64_t>& counts, const torch::Tensor& w1,
                      const torch::Tensor& w2, std::optional<double> limit) {
  auto xd = x.cpu().to(torch::kFloat64), w1d = w1.cpu().to(torch::kFloat64), w2d = w2.cpu().to(torch::kFloat64);
  const int64_t F = w2.size(2);
  std::vector<torch::Tensor> rows;
  int64_t r = 0;
  for (std::size_t e = 0; e < counts.size(); ++e)
    for (int64_t i = 0; i < counts[e]; ++i, ++r) {
      auto h = torch::mv(w1d[int64_t(e)], xd[r]);
      auto g = h.narrow(0, 0, F), u = h.narrow(0, F, F);
      if (limit) {
        g = g.clamp_max(*limit);
        u = u.clamp(-*limit, *limit);
      }
      rows.push_back(torch::mv(w2d[int64_t(e)], torch::silu(g) * u));
    }
  return torch::stack(rows);
}

struct Experts {
  torch::Tensor x, counts, w1, w2;
  std::vector<int64_t> n;
};

Experts make(int64_t D, int64_t F, const std::vector<int64_t>& n, const torch::Device& dev) {
  int64_t M = 0;
  for (auto c : n) M += c;
  const int64_t E = int64_t(n.size());
  auto bf = torch::TensorOptions().dtype(torch::kBFloat16).device(dev);
  return Experts{torch::randn({M, D}).to(bf), torch::tensor(n, torch::kInt64).to(dev),
                 (torch::randn({E, 2 * F, D}) / std::sqrt(double(D))).to(bf),
                 (torch::randn({E, D, F}) / std::sqrt(double(F))).to(bf), n};
}

}  // namespace

TEST_CASE("DecodeExpertsGuard nests and restores, and off the GPU the decode path is the grouped reference (CPU)") {
  CHECK(kernels::DecodeExpertsGuard::max_rows() == 0);
  {
    kernels::DecodeExpertsGuard on(true);
    CHECK(kernels::DecodeExpertsGuard::max_rows() == kernels::DecodeExpertsGuard::kDecodeExpertsMaxRows);
    {
      kernels::DecodeExpertsGuard off(false);
      CHECK(kernels::DecodeExpertsGuard::max_rows() == 0);
    }
    CHECK(kernels::DecodeExpertsGuard::max_rows() == kernels::DecodeExpertsGuard::kDecodeExpertsMaxRows);
  }
  CHECK(kernels::DecodeExpertsGuard::max_rows() == 0);
  torch::manual_seed(1);
  auto ex = make(32, 16, {2, 0, 3}, torch::kCPU);
  auto x = ex.x.to(torch::kFloat32), w1 = ex.w1.to(torch::kFloat32), w2 = ex.w2.to(torch::kFloat32);
  CHECK_FALSE(kernels::grouped_swiglu_decode_supports(x, w1, w2));
  auto y = kernels::grouped_swiglu_decode(x, ex.counts, w1, w2);
  CHECK(rel_error(y, formula(x, ex.n, w1, w2, std::nullopt)) < 1e-5);
}

TEST_CASE("CUDA: decode experts equal the per-row formula in bf16, empty and crowded experts, with and without the clamp") {
  if (skip_without_cuda_kernels()) return;
  const torch::Device dev(torch::kCUDA);
  torch::manual_seed(7);
  struct Case {
    int64_t D, F;
    std::vector<int64_t> n;
    std::optional<double> limit;
  };
  std::vector<Case> cases = {
      {2048, 1536, {0, 1, 2, 5, 0, 13, 3, 0}, std::nullopt},  // GLM-4.7-Flash's widths
      {512, 256, {}, 2.0},                                    // 64 experts, 128 rows at random
      {256, 4096, {1, 0, 0, 6}, std::nullopt},
      {2048, 1536, {0, 70, 33, 32, 9}, 3.0},  // experts past a pass of 32 rows: 3, 2 and 1 passes
  };
  for (int64_t e = 0; e < 64; ++e) cases[1].n.push_back(0);
  for (int i = 0; i < 128; ++i) ++cases[1].n[std::size_t(torch::randint(64, {1}).item<int64_t>())];
  for (const auto& c : cases) {
    CAPTURE(c.D);
    CAPTURE(c.F);
    auto ex = make(c.D, c.F, c.n, dev);
    if (c.limit) ex.x = ex.x * 4;  // so that the clamp bites
    REQUIRE(kernels::grouped_swiglu_decode_supports(ex.x, ex.w1, ex.w2));
    auto y = kernels::grouped_swiglu_decode(ex.x, ex.counts, ex.w1, ex.w2, c.limit);
    REQUIRE(y.sizes() == ex.x.sizes());
    REQUIRE(torch::isfinite(y).all().item<bool>());
    const double err = rel_error(y, formula(ex.x, c.n, ex.w1, ex.w2, c.limit));
    CAPTURE(err);
    CHECK(err < 1e-2);  // bf16 operands and outputs
    const double vs_grouped = rel_error(y, kernels::grouped_swiglu(ex.x, ex.counts, ex.w1, ex.w2, c.limit));
    CAPTURE(vs_grouped);
    CHECK(vs_grouped < 1e-2);
    CHECK(torch::equal(y, kernels::grouped_swiglu_decode(ex.x, ex.counts, ex.w1, ex.w2, c.limit)));  // run to run
  }
}

TEST_CASE("CUDA: grouped_swiglu takes the decode kernels inside the guard, for inference at few rows only") {
  if (skip_without_cuda_kernels()) return;
  const torch::Device dev(torch::kCUDA);
  torch::manual_seed(8);
  auto ex = make(512, 512, {3, 0, 4, 1}, dev);
  torch::NoGradGuard no_grad;
  auto decode = kernels::grouped_swiglu_decode(ex.x, ex.counts, ex.w1, ex.w2);
  auto grouped = kernels::grouped_swiglu(ex.x, ex.counts, ex.w1, ex.w2);
  const int64_t calls = kernels::grouped_swiglu_decode_kernel_calls();
  {
    kernels::DecodeExpertsGuard guard(true);
    CHECK(torch::equal(kernels::grouped_swiglu(ex.x, ex.counts, ex.w1, ex.w2), decode));
    CHECK(kernels::grouped_swiglu_decode_kernel_calls() == calls + 1);
    {
      torch::AutoGradMode grad(true);  // training: the grouped GEMM, differentiable
      auto y = kernels::grouped_swiglu(ex.x, ex.counts, ex.w1, ex.w2);
      CHECK(torch::equal(y, grouped));
    }
  }
  {
    kernels::DecodeExpertsGuard guard(true, /*max_rows=*/4);  // 8 rows: over the bound
    CHECK(torch::equal(kernels::grouped_swiglu(ex.x, ex.counts, ex.w1, ex.w2), grouped));
  }
  CHECK(kernels::grouped_swiglu_decode_kernel_calls() == calls + 1);  // neither training nor 8 rows over 4 took it
  const std::string same = torch::equal(decode, grouped) ? "equal" : "not equal";
  MESSAGE("decode kernels vs grouped GEMM: " << same << " bit for bit");
}

TEST_CASE("CUDA: decode experts captured in a CUDA graph follow row counts rewritten on the device") {
  if (skip_without_cuda_kernels()) return;
  const torch::Device dev(torch::kCUDA);
  torch::manual_seed(9);
  auto ex = make(512, 256, {2, 2, 2, 2, 0, 0, 0, 0}, dev);
  torch::NoGradGuard no_grad;
  torch::Tensor y;
  kernels::CapturedGraph graph(dev, kernels::GraphPool::make(),
                               [&] { y = kernels::grouped_swiglu_decode(ex.x, ex.counts, ex.w1, ex.w2); });
  for (const auto& n : std::vector<std::vector<int64_t>>{{0, 0, 0, 0, 8, 0, 0, 0}, {1, 0, 3, 0, 0, 2, 0, 2}}) {
    ex.counts.copy_(torch::tensor(n, torch::kInt64));
    ex.x.copy_(torch::randn(ex.x.sizes()));
    graph.replay();
    CHECK(torch::equal(y, kernels::grouped_swiglu_decode(ex.x, ex.counts, ex.w1, ex.w2)));
    CHECK(rel_error(y, formula(ex.x, n, ex.w1, ex.w2, std::nullopt)) < 1e-2);
  }
}

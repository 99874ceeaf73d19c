// kernels::routed_experts_combine and kernels::swiglu_routed_backward (kernels/moe.hpp,
// kernels/swiglu.hpp): on CPU, values and every gradient against autograd through the three
// steps they replace (the dispatch's gather, grouped_swiglu_ref, the weighted sum over k), with
// an expert without rows and with a swiglu limit that clamps; the routed backward's reference
// against autograd's formulas; what each refuses. On a GPU: the kernel against its reference in
// bf16 and fp16 (GLM-4.7-Flash's expert width at 32768 rows), and the function against the
// grouped-GEMM path it replaces in training: the same forward bits, gradients within bf16's error.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include "kernels/moe.hpp"
#include "kernels/moe_dispatch.hpp"
#include "kernels/swiglu.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::skip_without_cuda_kernels;

namespace {
double rel_error(const torch::Tensor& a, const torch::Tensor& b) {
  auto af = a.to(torch::kFloat64), bf = b.to(torch::kFloat64);
  return ((af - bf).norm() / bf.norm().clamp_min(1e-30)).item<double>();
}

// A routing of T tokens to K of E experts (expert 1 never chosen) and its dispatch order.
struct Routing {
  torch::Tensor ids, weights;
  kernels::DispatchOrder order;
};
Routing routing(int64_t T, int64_t K, int64_t E, torch::Device dev) {
  auto scores = torch::rand({T, E});
  scores.select(1, 1).fill_(-1);  // expert 1 gets no rows
  auto ids = std::get<1>(scores.topk(K, 1)).to(dev);
  auto w = torch::rand({T, K}).add_(0.1).to(dev);
  return {ids, w, kernels::dispatch_order(ids, E)};
}

// The three steps as autograd runs them without the function: y [T, D].
torch::Tensor three_steps(const torch::Tensor& x, const Routing& r, const torch::Tensor& w1, const torch::Tensor& w2,
                          const torch::Tensor& weights, std::optional<double> limit, bool grouped) {
  const int64_t T = weights.size(0), K = weights.size(1);
  auto xm = x.index_select(0, r.order.token_index);
  auto rows = grouped ? kernels::grouped_swiglu(xm, r.order.counts, w1, w2, limit)
                      : kernels::grouped_swiglu_ref(xm, r.order.counts, w1, w2, limit);
  auto by_slot = rows.index_select(0, r.order.row_of_slot).view({T, K, x.size(1)}).to(torch::kFloat32);
  return (by_slot * weights.unsqueeze(-1)).sum(1);
}
}  // namespace

TEST_CASE("routed_experts_combine: the gather, the experts and the combine's values and gradients (CPU)") {
  for (std::optional<double> limit : {std::optional<double>(), std::optional<double>(0.5)}) {
    torch::manual_seed(31);
    const int64_t T = 11, K = 3, E = 6, D = 16, F = 8;
    auto r = routing(T, K, E, torch::kCPU);
    auto x = torch::randn({T, D}).requires_grad_();
    auto w1 = torch::randn({E, 2 * F, D}).mul_(0.3).requires_grad_(), w2 = torch::randn({E, D, F}).mul_(0.3).requires_grad_();
    auto weights = r.weights.clone().requires_grad_();
    auto y = kernels::routed_experts_combine(x, r.order.token_index, r.order.slot, r.order.row_of_slot, r.order.counts,
                                             w1, w2, weights, limit);
    auto x2 = x.detach().clone().requires_grad_(), w12 = w1.detach().clone().requires_grad_();
    auto w22 = w2.detach().clone().requires_grad_(), weights2 = r.weights.clone().requires_grad_();
    auto y_ref = three_steps(x2, r, w12, w22, weights2, limit, /*grouped=*/false);
    INFO("limit " << (limit ? *limit : 0.0));
    if (limit) {  // the limit clamps entries of the gate/up projection: its masks are exercised
      auto gu_all = torch::matmul(x.detach(), w1.detach().transpose(1, 2));  // [E, T, 2F], every expert
      CHECK(gu_all.abs().gt(*limit).to(torch::kFloat64).mean().item<double>() > 0.2);
    }
    CHECK(torch::allclose(y, y_ref, 1e-5, 1e-6));
    auto dy = torch::randn({T, D});
    auto g = torch::autograd::grad({(y * dy).sum()}, {x, w1, w2, weights});
    auto gr = torch::autograd::grad({(y_ref * dy).sum()}, {x2, w12, w22, weights2});
    const char* names[] = {"x", "w_gate_up", "w_down", "weights"};
    for (int i = 0; i < 4; ++i) {
      INFO("gradient of " << names[i] << " rel err " << rel_error(g[i], gr[i]));
      CHECK(rel_error(g[i], gr[i]) <= 1e-5);
    }
    CHECK(torch::equal(g[1][1], torch::zeros({2 * F, D})));  // expert 1: no rows, no gradient
    CHECK(torch::equal(g[2][1], torch::zeros({D, F})));
  }
}

TEST_CASE("routed_experts_combine: gradients only where asked, and what it refuses") {
  torch::manual_seed(32);
  const int64_t T = 5, K = 2, E = 4, D = 8, F = 8;
  auto r = routing(T, K, E, torch::kCPU);
  auto x = torch::randn({T, D}), w1 = torch::randn({E, 2 * F, D}).requires_grad_(), w2 = torch::randn({E, D, F});
  auto y = kernels::routed_experts_combine(x, r.order.token_index, r.order.slot, r.order.row_of_slot, r.order.counts,
                                           w1, w2, r.weights);
  auto g = torch::autograd::grad({y.sum()}, {w1});  // only w_gate_up needs one
  CHECK(g[0].sizes() == w1.sizes());
  auto& o = r.order;
  CHECK_THROWS_WITH_AS(kernels::routed_experts_combine(x, o.token_index, o.slot, o.row_of_slot, o.counts, w1, w2,
                                                       r.weights.narrow(1, 0, 1)),
                       doctest::Contains("weights must be [T, K] fp32 with T = 5 and T*K = M = 10, got [5, 1]"),
                       c10::Error);
  CHECK_THROWS_WITH_AS(kernels::routed_experts_combine(x, o.token_index, o.slot.narrow(0, 0, 3), o.row_of_slot,
                                                       o.counts, w1, w2, r.weights),
                       doctest::Contains("token_index, slot and row_of_slot must be [M]"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::routed_experts_combine(x, o.token_index, o.slot, o.row_of_slot, o.counts, w1,
                                                       torch::randn({E, D, F + 1}), r.weights),
                       doctest::Contains("do not fit"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::routed_experts_combine(x, o.token_index, o.slot, o.row_of_slot, o.counts + 1, w1, w2,
                                                       r.weights),
                       doctest::Contains("counts sum to 14, not M = 10"), c10::Error);
}

TEST_CASE("swiglu_routed_backward: the reference equals autograd through w * swiglu(gu) (CPU)") {
  for (std::optional<double> limit : {std::optional<double>(), std::optional<double>(0.7)}) {
    torch::manual_seed(33);
    const int64_t M = 13, F = 8;
    auto gu = torch::randn({M, 2 * F}).requires_grad_();
    auto h = torch::randn({M, F}), w = torch::rand({M}).add_(0.1);
    auto act = kernels::swiglu_packed_ref(gu, limit);  // [M, F]
    auto dgu = torch::autograd::grad({(act * h * w.unsqueeze(1)).sum()}, {gu})[0];
    auto r = kernels::swiglu_routed_backward(gu.detach(), h, w, limit);
    INFO("limit " << (limit ? *limit : 0.0));
    if (limit) CHECK(gu.detach().abs().gt(*limit).any().item<bool>());  // some entries clamp
    CHECK(torch::allclose(r.dgu, dgu, 1e-5, 1e-6));
    CHECK(torch::allclose(r.act_w, act.detach() * w.unsqueeze(1), 1e-6, 1e-7));
    CHECK(torch::allclose(r.dw_row, (act.detach() * h).sum(1), 1e-5, 1e-6));
  }
  CHECK_THROWS_WITH_AS(kernels::swiglu_routed_backward(torch::randn({4, 16}), torch::randn({4, 7}), torch::rand({4})),
                       doctest::Contains("h must be [M, F] = [4, 8]"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::swiglu_routed_backward(torch::randn({4, 16}), torch::randn({4, 8}),
                                                       torch::rand({4}, torch::kFloat64)),
                       doctest::Contains("w_row must be [M] = [4] fp32"), c10::Error);
}

TEST_CASE("CUDA: swiglu_routed_backward's kernel equals its reference within one 16-bit rounding step") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(34);
  const torch::Device dev(torch::kCUDA);
  for (auto dtype : {torch::kBFloat16, torch::kHalf})
    for (auto [M, F] : {std::pair<int64_t, int64_t>{1, 8}, {37, 64}, {32768, 1536}}) {
      auto opt = torch::TensorOptions().dtype(dtype).device(dev);
      auto gu = 2 * torch::randn({M, 2 * F}, opt), h = torch::randn({M, F}, opt);
      auto w = torch::rand({M}, opt.dtype(torch::kFloat32)).add_(0.05);
      auto r = kernels::swiglu_routed_backward(gu, h, w), ref = kernels::swiglu_routed_backward_ref(gu, h, w);
      INFO("dtype " << dtype << " M " << M << " F " << F);
      // within one rounding step of the reference's value (its expf may differ in the last bit)
      const double step = dtype == torch::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;
      for (auto [a, b] : {std::pair{r.dgu, ref.dgu}, {r.act_w, ref.act_w}}) {
        auto d = (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs();
        auto bound = b.to(torch::kFloat64).abs().clamp_min(dtype == torch::kBFloat16 ? 1.2e-38 : 6.2e-5) * step;
        CHECK((d <= bound).all().item<bool>());
        CHECK(torch::eq(a, b).to(torch::kFloat64).mean().item<double>() >= 0.999);
      }
      CHECK(rel_error(r.dw_row, ref.dw_row) <= 1e-5);  // fp32 sums in another order
    }
}

TEST_CASE("CUDA: routed_experts_combine keeps the grouped path's forward bits, gradients within bf16's error") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(35);
  const torch::Device dev(torch::kCUDA);
  auto opt = torch::TensorOptions().device(dev).dtype(torch::kBFloat16);
  const int64_t T = 1024, K = 4, E = 64, D = 2048, F = 1536;
  auto r = routing(T, K, E, dev);
  auto x = torch::randn({T, D}, opt).requires_grad_();
  auto w1 = (0.02 * torch::randn({E, 2 * F, D}, opt)).requires_grad_();
  auto w2 = (0.02 * torch::randn({E, D, F}, opt)).requires_grad_();
  auto weights = r.weights.clone().requires_grad_();
  REQUIRE(kernels::grouped_swiglu_uses_grouped_mm(x, w1));
  auto& o = r.order;
  auto y = kernels::routed_experts_combine(x, o.token_index, o.slot, o.row_of_slot, o.counts, w1, w2, weights);
  {  // the forward of the three steps as training ran them: the same kernels, the same bits
    torch::NoGradGuard no_grad;
    auto rows = kernels::grouped_swiglu(x.index_select(0, o.token_index), o.counts, w1, w2);
    CHECK(torch::equal(y, kernels::moe_combine(rows, o.row_of_slot, r.weights)));
  }
  auto dy = torch::randn({T, D}, opt);
  auto g = torch::autograd::grad({(y.to(torch::kFloat32) * dy.to(torch::kFloat32)).sum()}, {x, w1, w2, weights});
  // against fp32 autograd through the reference, and the bf16 grouped path against the same
  auto f32 = [](const torch::Tensor& t) { return t.detach().to(torch::kFloat32).requires_grad_(); };
  auto xf = f32(x), w1f = f32(w1), w2f = f32(w2), wf = f32(weights);
  auto y_ref = three_steps(xf, r, w1f, w2f, wf, std::nullopt, /*grouped=*/false);
  auto gr = torch::autograd::grad({(y_ref * dy.to(torch::kFloat32)).sum()}, {xf, w1f, w2f, wf});
  auto xb = x.detach().clone().requires_grad_(), w1b = w1.detach().clone().requires_grad_();
  auto w2b = w2.detach().clone().requires_grad_(), wb = r.weights.clone().requires_grad_();
  auto y_old = three_steps(xb, r, w1b, w2b, wb, std::nullopt, /*grouped=*/true);
  auto go = torch::autograd::grad({(y_old * dy.to(torch::kFloat32)).sum()}, {xb, w1b, w2b, wb});
  const char* names[] = {"x", "w_gate_up", "w_down", "weights"};
  for (int i = 0; i < 4; ++i) {
    const double e_new = rel_error(g[i], gr[i]), e_old = rel_error(go[i], gr[i]);
    MESSAGE("gradient of " << names[i] << " rel err against fp32: routed_experts_combine " << e_new
                           << ", the grouped path " << e_old);
    CHECK(e_new <= 2e-2);
    CHECK(e_new <= 1.5 * e_old + 1e-4);  // no less accurate than what it replaces
  }
}

TEST_CASE("gather_rows: index_select's rows, repeated and out of order, and what it refuses") {
  torch::manual_seed(36);
  auto src = torch::randn({7, 16});
  auto index = torch::tensor({3, 0, 6, 3, 3, 1}, torch::kInt64);
  CHECK(torch::equal(kernels::gather_rows(src, index), src.index_select(0, index)));
  CHECK(kernels::gather_rows(src, index.narrow(0, 0, 0)).sizes() == torch::IntArrayRef({0, 16}));
  CHECK_THROWS_WITH_AS(kernels::gather_rows(src, index.to(torch::kInt32)),
                       doctest::Contains("src [N, D] and index [M] int64"), c10::Error);
  if (!kiln::test::have_cuda_kernels()) return;
  for (auto dtype : {torch::kBFloat16, torch::kHalf, torch::kFloat32})
    for (int64_t D : {2048, 24, 7}) {  // 16-byte vectors, and rows too narrow or unaligned for them
      CAPTURE(dtype);
      CAPTURE(D);
      auto s = torch::randn({4096, D}, torch::TensorOptions().dtype(dtype).device(torch::kCUDA));
      auto i = torch::randint(0, 4096, {16384}, torch::TensorOptions().dtype(torch::kInt64).device(torch::kCUDA));
      CHECK(torch::equal(kernels::gather_rows(s, i), s.index_select(0, i)));
    }
}

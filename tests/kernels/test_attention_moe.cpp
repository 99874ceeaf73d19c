// Varlen attention (full and cached), grouped-GEMM experts and the router top-k: each LibTorch reference against
// a plain formula on CPU (fp64), and each CUDA path against its reference on every GPU present,
// values and gradients, on fresh random inputs.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include "kernels/attention.hpp"
#include "kernels/moe.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::rel_error;
using kiln::test::skip_without_cuda_kernels;

namespace {

// Dense attention with an explicit [T, T] mask (same document and causal), fp64.
torch::Tensor masked_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const std::vector<int64_t>& cu, double scale) {
  const int64_t T = q.size(0);
  std::vector<int64_t> doc_of(static_cast<std::size_t>(T));
  for (std::size_t b = 0; b + 1 < cu.size(); ++b)
    for (int64_t t = cu[b]; t < cu[b + 1]; ++t) doc_of[std::size_t(t)] = int64_t(b);
  auto d = torch::tensor(doc_of);
  auto same = d.unsqueeze(1) == d.unsqueeze(0);
  auto causal = torch::arange(T).unsqueeze(1) >= torch::arange(T).unsqueeze(0);
  auto s = torch::einsum("thd,jhd->htj", {q.to(torch::kFloat64), k.to(torch::kFloat64)}) * scale;  // [H, T, T]
  s = s.masked_fill(~(same & causal), -std::numeric_limits<double>::infinity());
  return torch::einsum("htj,jhd->thd", {torch::softmax(s, -1), v.to(torch::kFloat64)});  // [T, H, Dv]
}

torch::Tensor naive_experts(const torch::Tensor& x, const std::vector<int64_t>& counts, const torch::Tensor& w1,
                            const torch::Tensor& w2) {
  std::vector<torch::Tensor> rows;
  int64_t r = 0;
  const int64_t F = w2.size(2);
  for (std::size_t e = 0; e < counts.size(); ++e)
    for (int64_t i = 0; i < counts[e]; ++i, ++r) {
      auto h = torch::mv(w1[int64_t(e)].to(torch::kFloat64), x[r].to(torch::kFloat64));
      rows.push_back(torch::mv(w2[int64_t(e)].to(torch::kFloat64), torch::silu(h.narrow(0, 0, F)) * h.narrow(0, F, F)));
    }
  return torch::stack(rows);
}
}  // namespace

TEST_CASE("varlen attention reference equals dense masked attention (CPU, fp64 formula)") {
  torch::manual_seed(1);
  std::vector<int64_t> cu = {0, 5, 6, 19, 32};
  for (auto [dqk, dv] : {std::pair<int64_t, int64_t>{24, 16}, {32, 32}}) {
    auto q = torch::randn({32, 3, dqk}), k = torch::randn({32, 3, dqk}), v = torch::randn({32, 3, dv});
    auto out = kernels::varlen_attention(q, k, v, torch::tensor(cu), 0.3);
    REQUIRE((out.sizes() == torch::IntArrayRef{32, 3, dv}));
    CHECK(rel_error(out, masked_attention(q, k, v, cu, 0.3)) <= 1e-6);
  }
  CHECK_THROWS_WITH(kernels::varlen_attention(torch::randn({8, 2, 16}), torch::randn({8, 2, 16}),
                                              torch::randn({8, 2, 16}), torch::tensor({0, 5}), 1.0),
                    doctest::Contains("cu_seqlens ends at 5, not T = 8"));
  CHECK_THROWS_WITH(kernels::varlen_attention(torch::randn({8, 2, 16}), torch::randn({8, 3, 16}),
                                              torch::randn({8, 2, 16}), torch::tensor({0, 8}), 1.0),
                    doctest::Contains("differ"));
}

TEST_CASE("grouped experts reference equals the per-row formula, empty experts included (CPU)") {
  torch::manual_seed(2);
  std::vector<int64_t> counts = {3, 0, 5, 1, 0, 7};
  const int64_t M = 16, D = 16, F = 8, E = 6;
  auto x = torch::randn({M, D}), w1 = 0.3 * torch::randn({E, 2 * F, D}), w2 = 0.3 * torch::randn({E, D, F});
  auto y = kernels::grouped_swiglu(x, torch::tensor(counts), w1, w2);
  CHECK(rel_error(y, naive_experts(x, counts, w1, w2)) <= 1e-6);
  CHECK_THROWS_WITH(kernels::grouped_swiglu(x, torch::tensor({3, 0, 5, 1, 0, 6}), w1, w2),
                    doctest::Contains("counts sum to 15, not M = 16"));
}

TEST_CASE("router top-k reference: experts by descending sigmoid + bias (CPU)") {
  auto logits = torch::tensor({{0.0f, 2.0f, -1.0f, 1.0f}, {3.0f, -3.0f, 0.5f, 0.4f}});
  auto bias = torch::tensor({0.0f, 0.0f, 0.0f, 0.5f});
  auto ids = kernels::router_topk(logits, bias, 2);
  CHECK(torch::equal(ids, torch::tensor({{3, 1}, {3, 0}})));  // sigmoid(1)+.5 > sigmoid(2); sigmoid(.4)+.5 > sigmoid(3)
}

TEST_CASE("CUDA: FlashAttention varlen equals the reference in bf16, values and gradients") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(3);
  auto dev = torch::Device(torch::kCUDA);
  // GLM-4.7-Flash heads (qk 256, v 256) and a narrower v (padded to qk inside).
  for (auto [dqk, dv] : {std::pair<int64_t, int64_t>{256, 256}, {192, 128}}) {
    CAPTURE(dqk);
    std::vector<int64_t> cu = {0, 700, 701, 1500, 2048};
    auto opt = torch::TensorOptions().device(dev).dtype(torch::kBFloat16);
    auto q = torch::randn({2048, 4, dqk}, opt).requires_grad_(), k = torch::randn({2048, 4, dqk}, opt).requires_grad_();
    auto v = torch::randn({2048, 4, dv}, opt).requires_grad_();
    REQUIRE(kernels::varlen_attention_uses_flash(q, v));
    const double scale = 1.0 / std::sqrt(double(dqk));
    auto out = kernels::varlen_attention(q, k, v, torch::tensor(cu), scale);
    auto dout = torch::randn_like(out);
    auto g = torch::autograd::grad({(out * dout).sum()}, {q, k, v});
    // Reference on fp32 copies of the same inputs.
    auto qf = q.detach().to(torch::kFloat32).requires_grad_(), kf = k.detach().to(torch::kFloat32).requires_grad_();
    auto vf = v.detach().to(torch::kFloat32).requires_grad_();
    auto ref = kernels::varlen_attention_ref(qf, kf, vf, torch::tensor(cu), scale);
    auto gr = torch::autograd::grad({(ref * dout.to(torch::kFloat32)).sum()}, {qf, kf, vf});
    const double eo = rel_error(out, ref), eq = rel_error(g[0], gr[0]), ek = rel_error(g[1], gr[1]), ev = rel_error(g[2], gr[2]);
    MESSAGE("flash vs reference rel err: out " << eo << " dq " << eq << " dk " << ek << " dv " << ev);
    CHECK(eo <= 1e-2);
    CHECK(eq <= 2e-2);
    CHECK(ek <= 2e-2);
    CHECK(ev <= 2e-2);
  }
}

TEST_CASE("CUDA: grouped-GEMM experts equal the reference in bf16, values and gradients") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(4);
  auto opt = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  const int64_t E = 64, D = 2048, F = 1536, M = 4096;
  auto probs = torch::rand({E});
  probs.narrow(0, 5, 3).zero_();  // some experts get no rows
  auto counts = torch::bincount(torch::multinomial(probs, M, true), {}, E);
  auto x = torch::randn({M, D}, opt).requires_grad_();
  auto w1 = (0.02 * torch::randn({E, 2 * F, D}, opt)).requires_grad_();
  auto w2 = (0.02 * torch::randn({E, D, F}, opt)).requires_grad_();
  REQUIRE(kernels::grouped_swiglu_uses_grouped_mm(x, w1));
  auto y = kernels::grouped_swiglu(x, counts.to(torch::kCUDA), w1, w2);
  auto dy = torch::randn_like(y);
  auto g = torch::autograd::grad({(y * dy).sum()}, {x, w1, w2});
  auto xf = x.detach().to(torch::kFloat32).requires_grad_(), w1f = w1.detach().to(torch::kFloat32).requires_grad_();
  auto w2f = w2.detach().to(torch::kFloat32).requires_grad_();
  auto ref = kernels::grouped_swiglu_ref(xf, counts, w1f, w2f);
  auto gr = torch::autograd::grad({(ref * dy.to(torch::kFloat32)).sum()}, {xf, w1f, w2f});
  const double ey = rel_error(y, ref), ex = rel_error(g[0], gr[0]), e1 = rel_error(g[1], gr[1]), e2 = rel_error(g[2], gr[2]);
  MESSAGE("grouped_mm vs reference rel err: y " << ey << " dx " << ex << " dw1 " << e1 << " dw2 " << e2);
  CHECK(ey <= 1e-2);
  CHECK(ex <= 2e-2);
  CHECK(e1 <= 2e-2);
  CHECK(e2 <= 2e-2);
}

TEST_CASE("CUDA: router top-k kernel picks the reference's experts") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(5);
  for (int64_t E : {8, 64, 256}) {
    CAPTURE(E);
    auto logits = torch::randn({10000, E}, torch::kCUDA), bias = 0.01 * torch::randn({E}, torch::kCUDA);
    auto got = kernels::router_topk(logits, bias, 4), want = kernels::router_topk_ref(logits, bias, 4);
    CHECK(torch::equal(got, want));
  }
}

TEST_CASE("cached varlen attention (end-aligned causal) equals full attention's last rows (CPU)") {
  torch::manual_seed(8);
  // Two sequences of 9 and 4 positions; the last 3 and 1 of them are the new queries.
  auto q_all = torch::randn({13, 2, 16}), k = torch::randn({13, 2, 16}), v = torch::randn({13, 2, 8});
  auto full = masked_attention(q_all, k, v, {0, 9, 13}, 0.25);  // [13, 2, 8]
  auto q = torch::cat({q_all.narrow(0, 6, 3), q_all.narrow(0, 12, 1)});
  auto out = kernels::varlen_attention_cached(q, k, v, torch::tensor({0, 3, 4}), torch::tensor({0, 9, 13}), 0.25, 3, 9);
  auto want = torch::cat({full.narrow(0, 6, 3), full.narrow(0, 12, 1)});
  CHECK(rel_error(out, want) <= 1e-6);
}

TEST_CASE("CUDA: cached FlashAttention equals the cached reference in bf16") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(9);
  auto opt = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  auto q = torch::randn({5, 4, 256}, opt), k = torch::randn({700, 4, 256}, opt), v = torch::randn({700, 4, 256}, opt);
  auto cu_q = torch::tensor({0, 1, 4, 5}), cu_k = torch::tensor({0, 300, 650, 700});
  auto out = kernels::varlen_attention_cached(q, k, v, cu_q, cu_k, 0.0625, 3, 350);
  auto ref = kernels::varlen_attention_cached_ref(q.to(torch::kFloat32), k.to(torch::kFloat32), v.to(torch::kFloat32),
                                                  cu_q, cu_k, 0.0625);
  const double e = rel_error(out, ref);
  MESSAGE("cached flash vs reference rel err " << e);
  CHECK(e <= 1e-2);
}

// Batch-invariant ops (kernels/batch_invariant.hpp) on the CPU: a row's output has the same
// bits alone, at another position, and in batches of other sizes; and it is close to the
// ordinary op (explicit tolerances). fp32 and bf16 inputs.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include "kernels/attention.hpp"
#include "kernels/batch_invariant.hpp"
#include "kernels/rms_norm.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::rel_error;

namespace {
// Row-wise op f over [M, ...] inputs x: row r of f(x) must equal f of x[r] alone, of x[r]
// placed at other positions among other rows, and of batches of other sizes.
void check_rows_invariant(const std::function<torch::Tensor(const torch::Tensor&)>& f, const torch::Tensor& x) {
  auto full = f(x);
  const int64_t M = x.size(0);
  for (int64_t r : {int64_t(0), M / 2, M - 1}) {
    CAPTURE(r);
    auto row = x.narrow(0, r, 1);
    CHECK(torch::equal(f(row)[0], full[r]));                              // alone
    auto others = torch::randn_like(x.narrow(0, 0, std::min<int64_t>(M, 5)));
    CHECK(torch::equal(f(torch::cat({others, row}))[others.size(0)], full[r]));  // last of 6
    CHECK(torch::equal(f(torch::cat({row, others, others}))[0], full[r]));       // first of 11
    auto many = torch::cat({x, x.flip(0), row});                                 // 2M + 1 rows
    CHECK(torch::equal(f(many)[2 * M], full[r]));
  }
}
}  // namespace

TEST_CASE("bi_linear: a row's output is the same alone, at any position and in any batch, close to linear (CPU)") {
  torch::manual_seed(0);
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    CAPTURE(dtype);
    auto w = torch::randn({50, 70}).to(dtype);  // K = 70: 8 full lanes blocks and a tail
    auto x = torch::randn({37, 70}).to(dtype);
    check_rows_invariant([&](const torch::Tensor& a) { return kernels::bi_linear(a, w); }, x);
    check_rows_invariant([&](const torch::Tensor& a) { return kernels::bi_linear(a, w, torch::kFloat32); }, x);
    auto ref = torch::nn::functional::linear(x.to(torch::kFloat32), w.to(torch::kFloat32));
    auto y32 = kernels::bi_linear(x, w, torch::kFloat32);
    CHECK((y32.scalar_type() == torch::kFloat32));
    CHECK(rel_error(y32, ref) <= 1e-6);
    CHECK((kernels::bi_linear(x, w).scalar_type() == dtype));
    CHECK(rel_error(kernels::bi_linear(x, w), ref) <= (dtype == torch::kFloat32 ? 1e-6 : 1e-2));
  }
  CHECK_THROWS_AS(kernels::bi_linear(torch::randn({4, 8}), torch::randn({3, 9})), c10::Error);
  CHECK_THROWS_AS(kernels::bi_linear(torch::randn({4, 8}), torch::randn({3, 8}).to(torch::kBFloat16)), c10::Error);
  CHECK_THROWS_AS(kernels::bi_linear(torch::randn({4, 8}).to(torch::kFloat64), torch::randn({3, 8}).to(torch::kFloat64)),
                  c10::Error);
}

TEST_CASE("bi_grouped_linear: a row's output depends on its row and expert only, close to per-expert GEMMs (CPU)") {
  torch::manual_seed(1);
  const int64_t E = 4, N = 24, K = 33;
  auto w = torch::randn({E, N, K});
  auto counts = torch::tensor({5, 0, 9, 3}, torch::kInt64);
  auto x = torch::randn({17, K});
  auto y = kernels::bi_grouped_linear(x, counts, w);
  std::vector<torch::Tensor> ref;
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t c = counts[e].item<int64_t>();
    ref.push_back(x.narrow(0, row, c).mm(w[e].t()));
    // Each row alone, as the only row of its expert.
    for (int64_t r = row; r < row + c; ++r) {
      auto one = torch::zeros({E}, torch::kInt64);
      one[e] = 1;
      CHECK(torch::equal(kernels::bi_grouped_linear(x.narrow(0, r, 1), one, w)[0], y[r]));
      CHECK(torch::equal(kernels::bi_linear(x.narrow(0, r, 1), w[e])[0], y[r]));  // the same dot as bi_linear
    }
    row += c;
  }
  CHECK(rel_error(y, torch::cat(ref)) <= 1e-6);
  auto yb = kernels::bi_grouped_linear(x.to(torch::kBFloat16), counts, w.to(torch::kBFloat16));
  CHECK((yb.scalar_type() == torch::kBFloat16));
  CHECK(rel_error(yb, torch::cat(ref)) <= 1e-2);
  CHECK_THROWS_AS(kernels::bi_grouped_linear(x, torch::tensor({5, 0, 9, 4}), w), c10::Error);   // sums to 18
  CHECK_THROWS_AS(kernels::bi_grouped_linear(x, torch::tensor({5, 9, 3}), w), c10::Error);      // not [E]
  CHECK_THROWS_AS(kernels::bi_grouped_linear(x, torch::tensor({5, -1, 10, 3}), w), c10::Error);  // negative
}

TEST_CASE("bi_attention: a query's output is the same packed for training and cached for decode, close to SDPA (CPU)") {
  torch::manual_seed(2);
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    CAPTURE(dtype);
    const int64_t H = 3, Dqk = 12, Dv = 8;
    std::vector<int64_t> lens = {150, 7, 64, 65};  // past one 64-key block, shorter, exactly one, one more
    std::vector<int64_t> cu = {0};
    for (auto l : lens) cu.push_back(cu.back() + l);
    const int64_t T = cu.back();
    auto q = torch::randn({T, H, Dqk}).to(dtype), k = torch::randn({T, H, Dqk}).to(dtype);
    auto v = torch::randn({T, H, Dv}).to(dtype);
    auto cu_t = torch::tensor(cu, torch::kInt64);
    auto packed = kernels::bi_attention(q, k, v, cu_t, cu_t, 0.3);  // [T, H, Dv]
    CHECK((packed.scalar_type() == dtype));
    auto ref = kernels::varlen_attention_cached_ref(q.to(torch::kFloat32), k.to(torch::kFloat32),
                                                    v.to(torch::kFloat32), cu_t, cu_t, 0.3);
    CHECK(rel_error(packed, ref) <= (dtype == torch::kFloat32 ? 1e-5 : 1e-2));
    // Decode: document b's query j alone against its keys 0..j, in a step with other sequences.
    for (std::size_t b = 0; b < lens.size(); ++b)
      for (int64_t j : {int64_t(0), lens[b] / 2, lens[b] - 1}) {
        CAPTURE(b);
        CAPTURE(j);
        const int64_t t = cu[b] + j;
        auto kb = k.narrow(0, cu[b], j + 1), vb = v.narrow(0, cu[b], j + 1);
        auto alone = kernels::bi_attention(q.narrow(0, t, 1), kb, vb, torch::tensor({int64_t(0), int64_t(1)}),
                                           torch::tensor({int64_t(0), j + 1}), 0.3);
        CHECK(torch::equal(alone[0], packed[t]));
        // Second sequence of a step whose first adds 2 queries over 9 keys.
        auto q2 = torch::cat({torch::randn({2, H, Dqk}).to(dtype), q.narrow(0, t, 1)});
        auto k2 = torch::cat({torch::randn({9, H, Dqk}).to(dtype), kb});
        auto v2 = torch::cat({torch::randn({9, H, Dv}).to(dtype), vb});
        auto step = kernels::bi_attention(q2, k2, v2, torch::tensor({int64_t(0), int64_t(2), int64_t(3)}),
                                          torch::tensor({int64_t(0), int64_t(9), 10 + j}), 0.3);
        CHECK(torch::equal(step[2], packed[t]));
      }
  }
  auto q = torch::randn({4, 2, 8});
  CHECK_THROWS_AS(kernels::bi_attention(q, q, q, torch::tensor({int64_t(0), int64_t(4)}),
                                        torch::tensor({int64_t(0), int64_t(3)}), 1.0),
                  c10::Error);  // ends at 3, not Tk = 4
  CHECK_THROWS_AS(kernels::bi_attention(q, q.narrow(0, 0, 2), q.narrow(0, 0, 2), torch::tensor({int64_t(0), int64_t(4)}),
                                        torch::tensor({int64_t(0), int64_t(2)}), 1.0),
                  c10::Error);  // 4 queries over 2 keys
}

TEST_CASE("bi_rms_norm and bi_logsumexp: a row's output is the same in any batch, close to the ordinary ops (CPU)") {
  torch::manual_seed(3);
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    CAPTURE(dtype);
    auto w = (1 + 0.3 * torch::randn({96})).to(dtype);
    auto x = torch::randn({29, 96}).to(dtype);
    check_rows_invariant([&](const torch::Tensor& a) { return kernels::bi_rms_norm(a, w, 1e-5); }, x);
    auto y = kernels::bi_rms_norm(x, w, 1e-5);
    CHECK((y.scalar_type() == dtype));
    CHECK(rel_error(y, std::get<0>(kernels::rms_norm_forward_ref(x, w, 1e-5))) <= (dtype == torch::kFloat32 ? 1e-6 : 1e-2));

    auto z = (5 * torch::randn({23, 1001})).to(dtype);
    check_rows_invariant([](const torch::Tensor& a) { return kernels::bi_logsumexp(a); }, z);
    auto lse = kernels::bi_logsumexp(z);
    CHECK((lse.scalar_type() == torch::kFloat32));
    CHECK(rel_error(lse, torch::logsumexp(z.to(torch::kFloat32), -1)) <= 1e-6);
  }
  auto minus_inf = torch::full({1, 4}, -std::numeric_limits<float>::infinity());
  CHECK(std::isinf(kernels::bi_logsumexp(minus_inf)[0].item<float>()));
  CHECK_THROWS_AS(kernels::bi_rms_norm(torch::randn({4, 8}), torch::randn({9}), 1e-5), c10::Error);
  CHECK_THROWS_AS(kernels::bi_logsumexp(torch::randn({8})), c10::Error);
}

// mla_rope_q / mla_rope_kv (kernels/mla_rope.hpp): on CPU the references against the rotation
// written out in fp64 (interleaved and half-split pairs), their gradients through autograd, and
// what they refuse; on a GPU the kernels against the references: the forward bit for bit, the
// gradients against an fp64 reference, at GLM-4.7-Flash's widths and at small shapes, from
// strided views, in bf16, fp16 and fp32.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include "kernels/mla_rope.hpp"
#include "model/blocks/basic.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::rel_max;
using kiln::test::skip_without_cuda_kernels;

namespace {
// x [T, H, R] rotated in fp64 by angle pos * theta^(-2i/R) of pair i.
torch::Tensor rotate_f64(const torch::Tensor& x, const torch::Tensor& pos, double theta, bool interleaved) {
  const int64_t R = x.size(-1);
  auto xd = x.to(torch::kFloat64);
  auto inv = 1.0 / torch::pow(theta, torch::arange(0, R, 2, torch::kFloat64) / double(R));      // [R/2]
  auto ang = pos.to(torch::kFloat64).unsqueeze(-1) * inv;                                        // [T, R/2]
  auto c = ang.cos().unsqueeze(1), s = ang.sin().unsqueeze(1);                                   // [T, 1, R/2]
  torch::Tensor x0, x1;
  if (interleaved) {
    auto p = xd.unflatten(-1, {R / 2, 2});
    x0 = p.select(-1, 0), x1 = p.select(-1, 1);
    return torch::stack({x0 * c - x1 * s, x1 * c + x0 * s}, -1).flatten(-2);
  }
  x0 = xd.narrow(-1, 0, R / 2), x1 = xd.narrow(-1, R / 2, R / 2);
  return torch::cat({x0 * c - x1 * s, x1 * c + x0 * s}, -1);
}
}  // namespace

TEST_CASE("mla_rope_q and mla_rope_kv references: the query's and keys' rope, the value split, and their gradients") {
  torch::manual_seed(21);
  const int64_t T = 7, H = 3, N = 4, R = 6, V = 5;
  auto pos = torch::tensor({0, 1, 2, 0, 1, 5, 3}, torch::kInt64);
  for (bool interleaved : {true, false}) {
    INFO("interleaved " << interleaved);
    const auto t = model::rope_table(8, R, 10000.0, torch::kFloat32, torch::kCPU);
    auto qs = torch::randn({T, H, N + R}).requires_grad_();
    auto q = kernels::mla_rope_q(qs, N, pos, t.cos, t.sin, interleaved);
    CHECK(q.sizes() == torch::IntArrayRef({T, H, N + R}));
    CHECK(torch::equal(q.narrow(-1, 0, N), qs.narrow(-1, 0, N)));
    CHECK(rel_max(q.narrow(-1, N, R), rotate_f64(qs.detach().narrow(-1, N, R), pos, 10000.0, interleaved)) < 1e-5);

    auto kv = torch::randn({T, H, N + V}).requires_grad_(), k_pe = torch::randn({T, R}).requires_grad_();
    auto [k, v] = kernels::mla_rope_kv(kv, k_pe, N, pos, t.cos, t.sin, interleaved);
    CHECK(k.sizes() == torch::IntArrayRef({T, H, N + R}));
    CHECK(torch::equal(k.narrow(-1, 0, N), kv.narrow(-1, 0, N)));
    CHECK(torch::equal(v, kv.narrow(-1, N, V)));
    auto want = rotate_f64(k_pe.detach().unsqueeze(1), pos, 10000.0, interleaved).expand({T, H, R});
    CHECK(rel_max(k.narrow(-1, N, R), want) < 1e-5);
    CHECK_FALSE(kernels::mla_rope_q_uses_kernel(qs, N));  // CPU: the references
    CHECK_FALSE(kernels::mla_rope_kv_uses_kernel(kv, k_pe, N));

    // Gradients: the rotation's transpose, and k_pe's summed over the heads.
    auto dq = torch::randn({T, H, N + R}), dk = torch::randn({T, H, N + R}), dv = torch::randn({T, H, V});
    torch::autograd::backward({q, k, v}, {dq, dk, dv});
    CHECK(torch::equal(qs.grad().narrow(-1, 0, N), dq.narrow(-1, 0, N)));
    auto back = [&](const torch::Tensor& g) { return rotate_f64(g, -pos, 10000.0, interleaved); };  // R(-a) = R(a)^T
    CHECK(rel_max(qs.grad().narrow(-1, N, R), back(dq.narrow(-1, N, R))) < 1e-5);
    CHECK(torch::equal(kv.grad().narrow(-1, 0, N), dk.narrow(-1, 0, N)));
    CHECK(torch::equal(kv.grad().narrow(-1, N, V), dv));
    CHECK(rel_max(k_pe.grad(), back(dk.narrow(-1, N, R).sum(1, true)).squeeze(1)) < 1e-5);
  }
}

TEST_CASE("mla_rope_q and mla_rope_kv refuse shapes, dtypes and devices that disagree, naming them") {
  const auto t = model::rope_table(8, 4, 10000.0, torch::kFloat32, torch::kCPU);
  auto pos = torch::zeros({5}, torch::kInt64);
  CHECK_THROWS_WITH_AS(kernels::mla_rope_q(torch::randn({5, 2, 7}), 4, pos, t.cos, t.sin, true),
                       doctest::Contains("even R > 0"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::mla_rope_q(torch::randn({5, 2, 8}), 8, pos, t.cos, t.sin, true),
                       doctest::Contains("N = 8"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::mla_rope_q(torch::randn({5, 2, 8}), 4, torch::zeros({4}, torch::kInt64), t.cos, t.sin, true),
                       doctest::Contains("positions must be [T] int64 with T = 5"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::mla_rope_q(torch::randn({5, 2, 10}), 4, pos, t.cos, t.sin, true),
                       doctest::Contains("R = 6"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::mla_rope_q(torch::randn({5, 2, 8}, torch::kFloat64), 4, pos, t.cos, t.sin, true),
                       doctest::Contains("must have the input's dtype"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::mla_rope_kv(torch::randn({5, 2, 8}), torch::randn({4, 4}), 4, pos, t.cos, t.sin, true),
                       doctest::Contains("k_pe [T, R]"), c10::Error);
  CHECK_THROWS_WITH_AS(
      kernels::mla_rope_kv(torch::randn({5, 2, 8}), torch::randn({5, 4}, torch::kFloat64), 4, pos, t.cos, t.sin, true),
      doctest::Contains("must have kv's dtype"), c10::Error);
}

TEST_CASE("CUDA: mla_rope kernels from padded head strides, and a loss that uses k alone") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(23);
  const torch::Device dev(torch::kCUDA);
  const int64_t T = 300, H = 4, N = 64, R = 32, V = 48;
  auto opt = torch::TensorOptions().dtype(torch::kBFloat16).device(dev);
  const auto t = model::rope_table(512, R, 1e4, torch::kBFloat16, dev);
  auto pos = torch::randint(0, 512, {T}, opt.dtype(torch::kInt64));
  // heads 8 elements apart beyond their width (head strides N+R+8 and N+V+8)
  auto qs_wide = torch::randn({T, H, N + R + 8}, opt), kv_wide = torch::randn({T, H, N + V + 8}, opt);
  auto qs = qs_wide.narrow(-1, 0, N + R);
  auto k_pe = torch::randn({T, R}, opt);
  REQUIRE(kernels::mla_rope_q_uses_kernel(qs, N));
  REQUIRE(kernels::mla_rope_kv_uses_kernel(kv_wide.narrow(-1, 0, N + V), k_pe, N));
  CHECK(torch::equal(kernels::mla_rope_q(qs, N, pos, t.cos, t.sin, true),
                     kernels::mla_rope_q_ref(qs, N, pos, t.cos, t.sin, true)));
  auto kvw1 = kv_wide.clone().requires_grad_(), kpe1 = k_pe.clone().requires_grad_();
  auto kvw2 = kv_wide.clone().requires_grad_(), kpe2 = k_pe.clone().requires_grad_();
  auto [k1, v1] = kernels::mla_rope_kv(kvw1.narrow(-1, 0, N + V), kpe1, N, pos, t.cos, t.sin, false);
  auto [k2, v2] = kernels::mla_rope_kv_ref(kvw2.narrow(-1, 0, N + V), kpe2, N, pos, t.cos, t.sin, false);
  CHECK(torch::equal(k1, k2));
  CHECK(torch::equal(v1, v2));
  auto dk = torch::randn_like(k1);
  (k1.to(torch::kFloat32) * dk).sum().backward();  // v takes no part: its gradient is zeros
  (k2.to(torch::kFloat32) * dk).sum().backward();
  CHECK(torch::equal(kvw1.grad().narrow(-1, N, V + 8), torch::zeros({T, H, V + 8}, opt)));
  CHECK(torch::equal(kvw1.grad().narrow(-1, 0, N), kvw2.grad().narrow(-1, 0, N)));
  CHECK(rel_max(kpe1.grad(), kpe2.grad()) <= 1.0 / 128);
}

TEST_CASE("CUDA: mla_rope_q and mla_rope_kv kernels give the references' bits, and gradients within a rounding step") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(22);
  const torch::Device dev(torch::kCUDA);
  struct Shape {
    int64_t T, H, N, R, V, C;
  };
  // GLM-4.7-Flash's attention (kv_lora 512 ahead of the rope key in kv_a's output), and a small one.
  for (const Shape& sh : {Shape{1500, 20, 192, 64, 256, 512}, Shape{3, 2, 16, 32, 8, 24}})
    for (auto dtype : {torch::kBFloat16, torch::kHalf, torch::kFloat32})
      for (bool interleaved : {true, false}) {
        INFO("T " << sh.T << " H " << sh.H << " dtype " << dtype << " interleaved " << interleaved);
        auto opt = torch::TensorOptions().dtype(dtype).device(dev);
        const auto t = model::rope_table(2048, sh.R, 1e6, dtype, dev);
        auto pos = torch::randint(0, 2048, {sh.T}, opt.dtype(torch::kInt64));
        // Strided views, as MLA hands them over: qs of q_b's output rows, kv of kv_b's, k_pe the
        // tail of kv_a's [T, C+R] output.
        auto qs = torch::randn({sh.T, sh.H * (sh.N + sh.R)}, opt).view({sh.T, sh.H, sh.N + sh.R});
        auto kv = torch::randn({sh.T, sh.H, sh.N + sh.V}, opt);
        auto ckv = torch::randn({sh.T, sh.C + sh.R}, opt);
        auto k_pe = ckv.narrow(-1, sh.C, sh.R);
        REQUIRE(kernels::mla_rope_q_uses_kernel(qs, sh.N));
        REQUIRE(kernels::mla_rope_kv_uses_kernel(kv, k_pe, sh.N));
        auto leaf = [](const torch::Tensor& x) { return x.detach().clone().requires_grad_(); };
        auto qs1 = leaf(qs), kv1 = leaf(kv), ckv1 = leaf(ckv);
        auto qs2 = leaf(qs), kv2 = leaf(kv), ckv2 = leaf(ckv);
        auto q1 = kernels::mla_rope_q(qs1, sh.N, pos, t.cos, t.sin, interleaved);
        auto kv_out1 = kernels::mla_rope_kv(kv1, ckv1.narrow(-1, sh.C, sh.R), sh.N, pos, t.cos, t.sin, interleaved);
        auto q2 = kernels::mla_rope_q_ref(qs2, sh.N, pos, t.cos, t.sin, interleaved);
        auto kv_out2 = kernels::mla_rope_kv_ref(kv2, ckv2.narrow(-1, sh.C, sh.R), sh.N, pos, t.cos, t.sin, interleaved);
        CHECK(torch::equal(q1, q2));
        CHECK(torch::equal(kv_out1.first, kv_out2.first));
        CHECK(torch::equal(kv_out1.second, kv_out2.second));
        CHECK(q1.is_contiguous());
        CHECK(kv_out1.first.is_contiguous());
        CHECK(kv_out1.second.is_contiguous());

        auto dq = torch::randn_like(q1), dk = torch::randn_like(kv_out1.first), dv = torch::randn_like(kv_out1.second);
        torch::autograd::backward({q1, kv_out1.first, kv_out1.second}, {dq, dk, dv});
        torch::autograd::backward({q2, kv_out2.first, kv_out2.second}, {dq, dk, dv});
        // fp64 reference gradients: the same tables' values, autograd through the reference.
        auto d64 = torch::TensorOptions().dtype(torch::kFloat64).device(dev);
        auto qs3 = qs.to(d64).requires_grad_(), kv3 = kv.to(d64).requires_grad_(), ckv3 = ckv.to(d64).requires_grad_();
        auto c64 = t.cos.to(torch::kFloat64), s64 = t.sin.to(torch::kFloat64);
        auto q3 = kernels::mla_rope_q_ref(qs3, sh.N, pos, c64, s64, interleaved);
        auto kv_out3 = kernels::mla_rope_kv_ref(kv3, ckv3.narrow(-1, sh.C, sh.R), sh.N, pos, c64, s64, interleaved);
        torch::autograd::backward({q3, kv_out3.first, kv_out3.second},
                                  {dq.to(torch::kFloat64), dk.to(torch::kFloat64), dv.to(torch::kFloat64)});
        // One rounding step of the largest value: 2^-8 (bf16), 2^-11 (fp16); fp32's sums over heads ~1e-6.
        const double tol = dtype == torch::kBFloat16 ? 1.0 / 256 : dtype == torch::kHalf ? 1.0 / 2048 : 1e-5;
        CHECK(rel_max(qs1.grad(), qs3.grad()) <= tol);
        CHECK(rel_max(kv1.grad(), kv3.grad()) <= tol);
        CHECK(rel_max(ckv1.grad(), ckv3.grad()) <= tol);
        MESSAGE("k_pe gradient vs fp64: kernel " << rel_max(ckv1.grad(), ckv3.grad()) << ", autograd in the dtype "
                                                 << rel_max(ckv2.grad(), ckv3.grad()));
        CHECK(torch::equal(kv1.grad().narrow(-1, sh.N, sh.V), dv));  // the value's gradient untouched
      }
}

TEST_CASE("mla_rope_q_ and mla_project_rope_q: mla_rope_q's bits in place, its gradients, a caller's gradient left untouched (CPU)") {
  torch::manual_seed(24);
  const int64_t M = 9, K = 12, H = 3, N = 4, R = 6;
  auto pos = torch::tensor({0, 1, 2, 3, 0, 1, 2, 7, 5}, torch::kInt64);
  const auto t = model::rope_table(8, R, 10000.0, torch::kFloat32, torch::kCPU);
  for (bool interleaved : {true, false}) {
    INFO("interleaved " << interleaved);
    auto qs = torch::randn({M, H, N + R});
    auto q = qs.clone();
    kernels::mla_rope_q_(q, N, pos, t.cos, t.sin, interleaved);
    CHECK(torch::equal(q, kernels::mla_rope_q(qs, N, pos, t.cos, t.sin, interleaved)));
    kernels::mla_rope_q_(q, N, pos, t.cos, t.sin, interleaved, /*inverse=*/true);  // R(a)^T R(a) = 1
    CHECK(rel_max(q, qs) < 1e-6);
    auto shared_heads = torch::randn({M, 1, N + R}).expand({M, H, N + R});  // every head one memory
    CHECK_THROWS_WITH_AS(kernels::mla_rope_q_(shared_heads, N, pos, t.cos, t.sin, interleaved),
                         doctest::Contains("single memory location"), c10::Error);

    // The fused projection against the composite: the same forward bits, the same gradients.
    auto x = torch::randn({M, K}), w = torch::randn({H * (N + R), K});
    auto x1 = x.clone().requires_grad_(), w1 = w.clone().requires_grad_();
    auto x2 = x.clone().requires_grad_(), w2 = w.clone().requires_grad_();
    auto q1 = kernels::mla_project_rope_q(x1, w1, H, N, pos, t.cos, t.sin, interleaved);
    auto q2 = kernels::mla_rope_q(model::unsplit_linear(x2, w2).view({M, H, N + R}), N, pos, t.cos, t.sin, interleaved);
    CHECK(q1.sizes() == torch::IntArrayRef({M, H, N + R}));
    CHECK(torch::equal(q1, q2));
    // A gradient the caller still holds (the copy path): left as it was.
    auto dq = torch::randn({M, H, N + R});
    const auto dq_before = dq.clone();
    torch::autograd::backward({q1, q2}, {dq, dq});
    CHECK(torch::equal(dq, dq_before));
    CHECK(rel_max(x1.grad(), x2.grad()) < 1e-5);
    CHECK(rel_max(w1.grad(), w2.grad()) < 1e-5);
    // A gradient made for the function alone (the in-place path): the same gradients.
    auto x3 = x.clone().requires_grad_(), w3 = w.clone().requires_grad_();
    (kernels::mla_project_rope_q(x3, w3, H, N, pos, t.cos, t.sin, interleaved) * dq).sum().backward();
    CHECK(rel_max(x3.grad(), x2.grad()) < 1e-5);
    CHECK(rel_max(w3.grad(), w2.grad()) < 1e-5);
  }
  CHECK_THROWS_WITH_AS(kernels::mla_project_rope_q(torch::randn({M, K}), torch::randn({H * (N + R) + 1, K}), H, N, pos,
                                                   t.cos, t.sin, true),
                       doctest::Contains("w [H (N+R), K] with H = 3"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::mla_project_rope_q(torch::randn({M, K}), torch::randn({H * (N + R), K + 1}), H, N, pos,
                                                   t.cos, t.sin, true),
                       doctest::Contains("x [9, 12]"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::mla_project_rope_q(torch::randn({M, K}), torch::randn({H * (N + R), K}), H, N + 1, pos,
                                                   t.cos, t.sin, true),
                       doctest::Contains("N = 5 must leave an even R > 0"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::mla_project_rope_q(torch::randn({M, K}), torch::randn({H * (N + R), K}, torch::kFloat64),
                                                   H, N, pos, t.cos, t.sin, true),
                       doctest::Contains("must share dtype and device"), c10::Error);
}

TEST_CASE("CUDA: mla_project_rope_q gives the composite's bits forward and backward, and rotates FlashAttention-like fresh gradients in place") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(25);
  const torch::Device dev(torch::kCUDA);
  // GLM-4.7-Flash's query: q_lora_rank 768 -> 20 heads of 192 + 64.
  const int64_t M = 1500, K = 768, H = 20, N = 192, R = 64;
  for (auto dtype : {torch::kBFloat16, torch::kFloat32})
    for (bool interleaved : {true, false}) {
      INFO("dtype " << dtype << " interleaved " << interleaved);
      auto opt = torch::TensorOptions().dtype(dtype).device(dev);
      const auto t = model::rope_table(2048, R, 1e6, dtype, dev);
      auto pos = torch::randint(0, 2048, {M}, opt.dtype(torch::kInt64));
      auto x = torch::randn({M, K}, opt), w = torch::randn({H * (N + R), K}, opt) / 32;
      auto qs = torch::randn({M, H, N + R}, opt);
      REQUIRE(kernels::mla_rope_q_uses_kernel(qs, N));
      auto q = qs.clone();
      kernels::mla_rope_q_(q, N, pos, t.cos, t.sin, interleaved);
      CHECK(torch::equal(q, kernels::mla_rope_q(qs, N, pos, t.cos, t.sin, interleaved)));
      // From a view with padded heads: the padding untouched.
      auto wide = torch::randn({M, H, N + R + 8}, opt);
      const auto wide0 = wide.clone();
      auto view = wide.narrow(-1, 0, N + R);
      REQUIRE(kernels::mla_rope_q_uses_kernel(view, N));
      kernels::mla_rope_q_(view, N, pos, t.cos, t.sin, interleaved);
      CHECK(torch::equal(view, kernels::mla_rope_q(wide0.narrow(-1, 0, N + R), N, pos, t.cos, t.sin, interleaved)));
      CHECK(torch::equal(wide.narrow(-1, N + R, 8), wide0.narrow(-1, N + R, 8)));

      auto x1 = x.clone().requires_grad_(), w1 = w.clone().requires_grad_();
      auto x2 = x.clone().requires_grad_(), w2 = w.clone().requires_grad_();
      auto q1 = kernels::mla_project_rope_q(x1, w1, H, N, pos, t.cos, t.sin, interleaved);
      auto q2 = kernels::mla_rope_q(model::unsplit_linear(x2, w2).view({M, H, N + R}), N, pos, t.cos, t.sin, interleaved);
      CHECK(torch::equal(q1, q2));
      auto c = torch::randn({M, H, N + R}, opt);
      (q1 * c).sum().backward();  // a fresh gradient: rotated in place
      (q2 * c).sum().backward();
      CHECK(torch::equal(x1.grad(), x2.grad()));
      CHECK(torch::equal(w1.grad(), w2.grad()));
    }
}

TEST_CASE("mla_project_rope_kv: mla_rope_kv's keys and values of the projection, its gradients without the assembled one, and what it refuses (CPU)") {
  torch::manual_seed(26);
  const int64_t M = 9, C = 10, H = 3, N = 4, R = 6, V = 5;
  auto pos = torch::tensor({0, 1, 2, 3, 0, 1, 2, 7, 5}, torch::kInt64);
  const auto t = model::rope_table(8, R, 10000.0, torch::kFloat32, torch::kCPU);
  for (bool interleaved : {true, false}) {
    INFO("interleaved " << interleaved);
    auto lat = torch::randn({M, C}), w = torch::randn({H * (N + V), C}), kpe = torch::randn({M, R});
    auto l1 = lat.clone().requires_grad_(), w1 = w.clone().requires_grad_(), p1 = kpe.clone().requires_grad_();
    auto l2 = lat.clone().requires_grad_(), w2 = w.clone().requires_grad_(), p2 = kpe.clone().requires_grad_();
    auto [k1, v1] = kernels::mla_project_rope_kv(l1, w1, p1, H, N, pos, t.cos, t.sin, interleaved);
    auto [k2, v2] = kernels::mla_rope_kv(model::unsplit_linear(l2, w2).view({M, H, N + V}), p2, N, pos, t.cos, t.sin,
                                         interleaved);
    CHECK(torch::equal(k1, k2));
    CHECK(torch::equal(v1, v2));
    auto dk = torch::randn({M, H, N + R}), dv = torch::randn({M, H, V});
    torch::autograd::backward({k1, v1}, {dk, dv});
    torch::autograd::backward({k2, v2}, {dk, dv});
    CHECK(rel_max(l1.grad(), l2.grad()) < 1e-5);
    CHECK(rel_max(w1.grad(), w2.grad()) < 1e-5);
    CHECK(rel_max(p1.grad(), p2.grad()) < 1e-5);
    // A loss of k alone: v's gradient is zeros, the weight's value rows get none.
    auto l3 = lat.clone().requires_grad_(), w3 = w.clone().requires_grad_();
    auto kv3 = kernels::mla_project_rope_kv(l3, w3, kpe, H, N, pos, t.cos, t.sin, interleaved);
    (kv3.first * dk).sum().backward();
    CHECK(torch::equal(w3.grad().view({H, N + V, C}).narrow(1, N, V), torch::zeros({H, V, C})));
  }
  auto lat = torch::randn({M, C});
  CHECK_THROWS_WITH_AS(kernels::mla_project_rope_kv(lat, torch::randn({H * (N + V) + 1, C}), torch::randn({M, R}), H,
                                                    N, pos, t.cos, t.sin, true),
                       doctest::Contains("w [H (N+V), C] with H = 3"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::mla_project_rope_kv(lat, torch::randn({H * (N + V), C}), torch::randn({M, R + 1}), H,
                                                    N, pos, t.cos, t.sin, true),
                       doctest::Contains("even R > 0"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::mla_project_rope_kv(lat, torch::randn({H * (N + V), C}), torch::randn({M, R}), H,
                                                    N + V, pos, t.cos, t.sin, true),
                       doctest::Contains("N = 9"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::mla_project_rope_kv(lat, torch::randn({H * (N + V), C}),
                                                    torch::randn({M, R}, torch::kFloat64), H, N, pos, t.cos, t.sin, true),
                       doctest::Contains("must have latent's dtype"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::mla_project_rope_kv(lat, torch::randn({H * (N + V), C}), torch::randn({M, R}), H, N,
                                                    torch::zeros({4}, torch::kInt64), t.cos, t.sin, true),
                       doctest::Contains("positions must be [T] int64 with T = 9"), c10::Error);
}

TEST_CASE("CUDA: mla_project_rope_kv gives the composite's keys and values, and gradients within a rounding step") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(27);
  const torch::Device dev(torch::kCUDA);
  // GLM-4.7-Flash: kv_lora_rank 512 -> 20 heads of 192 + 256, the rope key 64 wide.
  const int64_t M = 1500, C = 512, H = 20, N = 192, R = 64, V = 256;
  for (auto dtype : {torch::kBFloat16, torch::kFloat32})
    for (bool interleaved : {true, false}) {
      INFO("dtype " << dtype << " interleaved " << interleaved);
      auto opt = torch::TensorOptions().dtype(dtype).device(dev);
      const auto t = model::rope_table(2048, R, 1e6, dtype, dev);
      auto pos = torch::randint(0, 2048, {M}, opt.dtype(torch::kInt64));
      auto lat = torch::randn({M, C}, opt), w = torch::randn({H * (N + V), C}, opt) / 16;
      auto ckv = torch::randn({M, C + R}, opt);  // k_pe as MLA hands it over: the tail of kv_a's output
      auto leaf = [](const torch::Tensor& x) { return x.detach().clone().requires_grad_(); };
      auto l1 = leaf(lat), w1 = leaf(w), c1 = leaf(ckv), l2 = leaf(lat), w2 = leaf(w), c2 = leaf(ckv);
      auto [k1, v1] = kernels::mla_project_rope_kv(l1, w1, c1.narrow(-1, C, R), H, N, pos, t.cos, t.sin, interleaved);
      auto [k2, v2] = kernels::mla_rope_kv(model::unsplit_linear(l2, w2).view({M, H, N + V}), c2.narrow(-1, C, R), N,
                                           pos, t.cos, t.sin, interleaved);
      CHECK(torch::equal(k1, k2));
      CHECK(torch::equal(v1, v2));
      auto dk = torch::randn_like(k1), dv = torch::randn_like(v1);
      torch::autograd::backward({k1, v1}, {dk, dv});
      torch::autograd::backward({k2, v2}, {dk, dv});
      const double tol = dtype == torch::kBFloat16 ? 1.0 / 128 : 1e-5;  // dlatent: two GEMMs, one rounding between
      CHECK(rel_max(l1.grad(), l2.grad()) <= tol);
      CHECK(rel_max(w1.grad(), w2.grad()) <= tol);
      CHECK(torch::equal(c1.grad(), c2.grad()));  // the same dk_pe kernel
      MESSAGE("latent gradient vs the assembled path: " << rel_max(l1.grad(), l2.grad()) << ", weight "
                                                       << rel_max(w1.grad(), w2.grad()));
    }
}

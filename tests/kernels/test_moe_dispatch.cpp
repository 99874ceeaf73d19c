// The MoE dispatch order, combine and router weights as kernels (kernels/moe_dispatch.hpp,
// kernels/moe.hpp router_topk_weights): on CPU the references' properties and the errors; on
// a GPU the kernels against the references: the same integers for the order (every slot count
// of a decode step, 8 to 1024 experts, skewed and uniform choices), the combine within the
// rounding of its fp32 sum, the router's ids equal and weights within fp32 rounding.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <vector>

#include "kernels/moe.hpp"
#include "kernels/moe_dispatch.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::skip_without_cuda_kernels;

namespace {
// [T, K] distinct experts per token (as top-k gives), drawn from the first `spread` experts.
torch::Tensor random_ids(int64_t T, int64_t K, int64_t E, int64_t spread) {
  auto ids = torch::empty({T, K}, torch::kInt64);
  for (int64_t t = 0; t < T; ++t) ids[t] = torch::randperm(spread, torch::kInt64).narrow(0, 0, K);
  (void)E;
  return ids;
}
// The stable order by expert as an independent oracle: ids * M + slot, distinct keys, any sort.
torch::Tensor oracle_slots(const torch::Tensor& ids_TK) {
  const auto flat = ids_TK.reshape({-1}).to(torch::kCPU);
  const int64_t M = flat.size(0);
  return std::get<1>((flat * M + torch::arange(M, flat.options())).sort());
}
}  // namespace

TEST_CASE("dispatch_order_ref: rows in expert order, ties in slot order, and its inverse and counts") {
  auto ids = torch::tensor({2, 0, 1, 2, 0, 1, 2, 3}, torch::kInt64).view({4, 2});  // T 4, K 2
  auto d = kernels::dispatch_order_ref(ids, 5);
  CHECK(torch::equal(d.slot, torch::tensor({1, 4, 2, 5, 0, 3, 6, 7}, torch::kInt64)));
  CHECK(torch::equal(d.token_index, torch::tensor({0, 2, 1, 2, 0, 1, 3, 3}, torch::kInt64)));
  CHECK(torch::equal(d.row_of_slot.index_select(0, d.slot), torch::arange(8, torch::kInt64)));
  CHECK(torch::equal(d.counts, torch::tensor({2, 2, 3, 1, 0}, torch::kInt64)));
  CHECK(torch::equal(kernels::dispatch_order(ids, 5).slot, d.slot));  // CPU: the reference
  CHECK_THROWS_WITH_AS(kernels::dispatch_order(ids.to(torch::kInt32), 5), doctest::Contains("[T, K] int64"),
                       c10::Error);
  CHECK_THROWS_WITH_AS(kernels::dispatch_order(ids, 0), doctest::Contains("num_experts 0 < 1"), c10::Error);
}

TEST_CASE("dispatch_order_ref at a training step's size and at the int16 sort's bound: the stable order by expert") {
  torch::manual_seed(41);
  // T 8192, K 4 of 64 experts (the order's int16 keys); 32766 experts, ids up to the largest
  // (still int16); 40000 experts, ids past int16 (the int64 keys)
  for (const int64_t E : {int64_t(64), int64_t(32766), int64_t(40000)}) {
    CAPTURE(E);
    const int64_t T = E == 64 ? 8192 : 2048, K = 4;
    auto ids = torch::randint(0, E, {T, K}, torch::kInt64);
    ids.view({-1}).narrow(0, 0, 3).copy_(torch::tensor({E - 1, int64_t(0), E - 1}, torch::kInt64));
    const auto d = kernels::dispatch_order_ref(ids, E);
    CHECK(torch::equal(d.slot, oracle_slots(ids)));
    CHECK(torch::equal(d.token_index, torch::div(d.slot, K, "floor")));
    CHECK(torch::equal(d.counts, torch::bincount(ids.view({-1}), {}, E)));
  }
}

TEST_CASE("moe_combine_ref sums each token's weighted rows, and names what it refuses") {
  auto rows = torch::tensor({1.f, 2.f, 10.f, 20.f, 100.f, 200.f}).view({3, 2});  // M 3 (T 3, K 1)
  auto w = torch::tensor({0.5f, 2.f, 1.f}).view({3, 1});
  auto y = kernels::moe_combine(rows, torch::tensor({2, 0, 1}, torch::kInt64), w);
  CHECK(torch::equal(y, torch::tensor({50.f, 100.f, 2.f, 4.f, 10.f, 20.f}).view({3, 2})));
  CHECK_THROWS_WITH_AS(kernels::moe_combine(rows, torch::tensor({0, 1}, torch::kInt64), w),
                       doctest::Contains("M = T*K"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::moe_combine(rows, torch::tensor({2, 0, 1}, torch::kInt64), w.to(torch::kFloat64)),
                       doctest::Contains("weights fp32"), c10::Error);
}

TEST_CASE("moe_combine_backward_ref equals autograd through the reference forward, and names what it refuses") {
  torch::manual_seed(9);
  const int64_t T = 5, K = 3, D = 7;
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    auto rows = torch::randn({T * K, D}).to(dtype).requires_grad_();
    auto w = torch::rand({T, K}).requires_grad_();
    auto perm = torch::randperm(T * K, torch::kInt64);
    auto g = torch::randn({T, D}).to(dtype);
    kernels::moe_combine_ref(rows, perm, w).backward(g);
    auto got = kernels::moe_combine_backward_ref(rows.detach(), perm, w.detach(), g);
    INFO("dtype " << dtype);
    CHECK((got.rows_MD.scalar_type() == dtype));
    CHECK((got.weights_TK.scalar_type() == torch::kFloat32));
    CHECK(torch::equal(got.rows_MD, rows.grad()));  // the same products, rounded once
    CHECK(torch::allclose(got.weights_TK, w.grad(), 1e-5, 1e-6));
    // the row of slot (t, k) gets weight[t, k] * g[t]: slot 4 is token 1's k = 1
    auto want_row = (g[1].to(torch::kFloat32) * w[1][1].item<float>()).to(dtype);
    CHECK(torch::equal(got.rows_MD[perm[4].item<int64_t>()], want_row));
  }
  auto rows = torch::randn({T * K, D}), w = torch::rand({T, K});
  auto perm = torch::randperm(T * K, torch::kInt64);
  CHECK_THROWS_WITH_AS(kernels::moe_combine_backward(rows, perm, w, torch::randn({T, D + 1})),
                       doctest::Contains("grad must be [T, D] = [5, 7]"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::moe_combine_backward(rows, perm, w, torch::randn({T, D}).to(torch::kBFloat16)),
                       doctest::Contains("must have rows' dtype"), c10::Error);
}

TEST_CASE("CUDA: dispatch_order kernel gives the reference's integers") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(6);
  const torch::Device dev(torch::kCUDA);
  struct Case {
    int64_t T, K, E, spread;
  };
  const std::vector<Case> cases{{1, 4, 64, 64},   {32, 4, 64, 64},   {256, 4, 64, 64}, {256, 4, 64, 5},
                                {7, 2, 8, 8},     {128, 8, 288, 288}, {1, 1, 1, 1},    {1024, 1, 1024, 1024},
                                {100, 3, 1024, 17}, {33, 8, 512, 512}};
  for (const auto& c : cases) {
    auto ids = random_ids(c.T, c.K, c.E, c.spread).to(dev);
    auto want = kernels::dispatch_order_ref(ids, c.E);
    auto got = kernels::dispatch_order(ids, c.E);
    INFO("T " << c.T << " K " << c.K << " E " << c.E << " spread " << c.spread);
    CHECK(torch::equal(got.slot, want.slot));
    CHECK(torch::equal(got.token_index, want.token_index));
    CHECK(torch::equal(got.row_of_slot, want.row_of_slot));
    CHECK(torch::equal(got.counts, want.counts));
  }
}

TEST_CASE("CUDA: dispatch_order at a training step's size (the sort, not the one-CTA kernel) gives the stable order by expert") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(42);
  for (const int64_t E : {int64_t(64), int64_t(256), int64_t(40000)}) {
    CAPTURE(E);
    const int64_t T = 8192, K = 4;
    auto ids = torch::randint(0, E, {T, K}, torch::kInt64);
    const auto d = kernels::dispatch_order(ids.to(torch::kCUDA), E);
    CHECK(torch::equal(d.slot.cpu(), oracle_slots(ids)));
    CHECK(torch::equal(d.row_of_slot.cpu().index_select(0, d.slot.cpu()), torch::arange(T * K, torch::kInt64)));
    CHECK(torch::equal(d.counts.cpu(), torch::bincount(ids.view({-1}), {}, E)));
  }
}

TEST_CASE("CUDA: moe_combine kernel equals the reference within its fp32 sum's rounding") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(7);
  const torch::Device dev(torch::kCUDA);
  for (auto dtype : {torch::kBFloat16, torch::kFloat32})
    for (int64_t T : {1, 32, 256}) {
      const int64_t K = 4, D = 2048;
      auto rows = torch::randn({T * K, D}, torch::TensorOptions().dtype(dtype).device(dev));
      auto perm = torch::randperm(T * K, torch::TensorOptions().dtype(torch::kInt64).device(dev));
      auto w = torch::rand({T, K}, torch::TensorOptions().dtype(torch::kFloat32).device(dev));
      auto got = kernels::moe_combine(rows, perm, w), want = kernels::moe_combine_ref(rows, perm, w);
      auto err = (got.to(torch::kFloat32) - want.to(torch::kFloat32)).abs().max().item<float>();
      auto scale = want.to(torch::kFloat32).abs().max().item<float>();
      INFO("dtype " << dtype << " T " << T << " err " << err << " of " << scale);
      CHECK(err <= scale * (dtype == torch::kBFloat16 ? 1.0f / 128 : 1e-6f));
      // The same rows from an address off a 16-byte boundary take the element-wise kernel: the
      // same bits as the 16-byte one (the rollout engine's combine and the trainer's agree).
      auto flat = torch::empty({T * K * D + 1}, rows.options());
      auto shifted = flat.narrow(0, 1, T * K * D).view({T * K, D}).copy_(rows);
      CHECK(torch::equal(kernels::moe_combine(shifted, perm, w), got));
    }
}

TEST_CASE("CUDA: moe_combine's 16-byte kernels give the element kernels' bits, at every K they are built for and a ragged D") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(8);
  const torch::Device dev(torch::kCUDA);
  auto opt = torch::TensorOptions().dtype(torch::kBFloat16).device(dev);
  for (int64_t K : {1, 2, 4, 6, 8})
    for (int64_t D : {2048, 2056}) {  // 2056: 257 vectors, one thread of the CTA takes two
      const int64_t T = 37;
      INFO("K " << K << " D " << D);
      auto rows = torch::randn({T * K, D}, opt);
      auto perm = torch::randperm(T * K, torch::TensorOptions().dtype(torch::kInt64).device(dev));
      auto w = torch::rand({T, K}, torch::TensorOptions().dtype(torch::kFloat32).device(dev));
      auto g = torch::randn({T, D}, opt);
      // the same values from an address off a 16-byte boundary: the element kernels
      auto shifted = [&](const torch::Tensor& t) {
        auto flat = torch::empty({t.numel() + 1}, t.options());
        return flat.narrow(0, 1, t.numel()).view(t.sizes()).copy_(t);
      };
      CHECK(torch::equal(kernels::moe_combine(rows, perm, w), kernels::moe_combine(shifted(rows), perm, w)));
      auto vec = kernels::moe_combine_backward(rows, perm, w, g);
      auto elem = kernels::moe_combine_backward(shifted(rows), perm, w, shifted(g));
      CHECK(torch::equal(vec.rows_MD, elem.rows_MD));
      // the weights' fp32 dot products in another order per thread
      CHECK((vec.weights_TK - elem.weights_TK).abs().max().item<float>() <=
            1e-4f * (elem.weights_TK.abs().max().item<float>() + 1.f));
    }
}

TEST_CASE("CUDA: moe_combine_backward kernel equals the reference, the same bits on every run") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(10);
  const torch::Device dev(torch::kCUDA);
  for (auto dtype : {torch::kBFloat16, torch::kFloat32})
    for (int64_t T : {1, 33, 512}) {
      const int64_t K = 4, D = 2048;
      auto opt = torch::TensorOptions().dtype(dtype).device(dev);
      auto rows = torch::randn({T * K, D}, opt);
      auto perm = torch::randperm(T * K, torch::TensorOptions().dtype(torch::kInt64).device(dev));
      auto w = torch::rand({T, K}, torch::TensorOptions().dtype(torch::kFloat32).device(dev));
      auto g = torch::randn({T, D}, opt);
      auto got = kernels::moe_combine_backward(rows, perm, w, g);
      auto want = kernels::moe_combine_backward_ref(rows, perm, w, g);
      INFO("dtype " << dtype << " T " << T);
      CHECK(torch::equal(got.rows_MD, want.rows_MD));  // one fp32 product, rounded once, both ways
      auto err = (got.weights_TK - want.weights_TK).abs().max().item<float>();
      auto scale = want.weights_TK.abs().max().item<float>() + 1.f;
      INFO("weights err " << err << " of " << scale);
      CHECK(err <= scale * 1e-4f);  // fp32 dot products of 2048 terms in two orders
      auto again = kernels::moe_combine_backward(rows, perm, w, g);
      CHECK(torch::equal(again.weights_TK, got.weights_TK));
      CHECK(torch::equal(again.rows_MD, got.rows_MD));
    }
}

TEST_CASE("CUDA: router_topk_weights kernel equals the reference") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(8);
  const torch::Device dev(torch::kCUDA);
  for (bool norm : {true, false})
    for (int64_t T : {1, 32, 300}) {
      auto logits = torch::randn({T, 64}, torch::TensorOptions().device(dev)) * 3;
      auto bias = torch::randn({64}, torch::TensorOptions().device(dev)) * 0.1;
      auto [ids, w] = kernels::router_topk_weights(logits, bias, 4, norm, 1.8);
      auto [ids_ref, w_ref] = kernels::router_topk_weights_ref(logits, bias, 4, norm, 1.8);
      CHECK(torch::equal(ids, ids_ref));
      // Bit for bit: the trainer's route_from_scores (the reference's formula, LibTorch's sigmoid)
      // and the engine's kernel give a token the same routing weights.
      CHECK(torch::equal(w, w_ref));
      CHECK(torch::equal(ids, kernels::router_topk(logits, bias, 4)));
    }
}

// kernels::embedding / embedding_backward (kernels/embedding.hpp): on CPU the function against
// at::embedding's autograd; on a GPU the kernels against at::embedding_dense_backward at
// GLM-4.7-Flash's vocabulary and width, with ids drawn at random, one id repeated through the
// whole pack and through part of it (the chunked sums), packs that are not whole chunks, fp32,
// and the same bits on a second run.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include "kernels/embedding.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::skip_without_cuda_kernels;


TEST_CASE("embedding: at::embedding's rows and weight gradient, and what it refuses (CPU)") {
  torch::manual_seed(31);
  auto w = torch::randn({11, 6}, torch::requires_grad());
  auto ids = torch::tensor({{3, 3, 0}, {10, 3, 7}}, torch::kInt64);
  auto y = kernels::embedding(w, ids);
  CHECK(y.sizes() == torch::IntArrayRef({2, 3, 6}));
  CHECK(torch::equal(y, torch::embedding(w, ids)));
  auto dy = torch::randn({2, 3, 6});
  auto got = torch::autograd::grad({y}, {w}, {dy})[0];
  auto want = torch::autograd::grad({torch::embedding(w, ids)}, {w}, {dy})[0];
  CHECK(torch::equal(got, want));
  CHECK_FALSE(kernels::embedding_backward_uses_kernel(dy.view({6, 6}), ids.view({6}), 11));
  // No tokens: a zero gradient.
  auto none = torch::autograd::grad({kernels::embedding(w, torch::zeros({0}, torch::kInt64))}, {w},
                                    {torch::zeros({0, 6})})[0];
  CHECK(torch::equal(none, torch::zeros({11, 6})));
  CHECK_THROWS_WITH_AS(kernels::embedding_backward(torch::randn({4, 6}), torch::zeros({5}, torch::kInt64), 11),
                       doctest::Contains("dy [T, D], ids [T] and V > 0 expected, got dy [4, 6], ids [5]"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::embedding_backward(torch::randn({4, 6}), torch::zeros({4}, torch::kInt32), 11),
                       doctest::Contains("ids must be int64"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::embedding(torch::randn({11, 6}), torch::zeros({4}, torch::kInt32)),
                       doctest::Contains("int64 ids"), c10::Error);
}

TEST_CASE("CUDA: embedding_backward's kernels give at::embedding_dense_backward's gradient, long runs of one id too") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(32);
  const torch::Device dev(torch::kCUDA);
  const int64_t V = 154880, D = 2048;
  auto li = torch::TensorOptions().dtype(torch::kInt64).device(dev);
  struct Case {
    const char* what;
    torch::Tensor ids;
  };
  auto random = torch::randint(0, V, {8192}, li);
  auto repeated = torch::full({8192}, 4242, li);
  auto part = random.clone();
  part.narrow(0, 1000, 3000).fill_(77);  // a run of 3000 beside random ids
  auto odd = torch::randint(0, 50, {1000}, li);  // not a whole number of chunks, runs of ~20
  odd.narrow(0, 100, 517).fill_(V - 1);          // and a long run at the last row
  for (const auto& c : {Case{"random", random}, Case{"one id", repeated}, Case{"a run of 3000", part},
                        Case{"1000 tokens", odd}})
    for (auto dtype : {torch::kBFloat16, torch::kFloat32}) {
      INFO(c.what << " " << dtype);
      auto dy = torch::randn({c.ids.size(0), D}, torch::TensorOptions().dtype(dtype).device(dev));
      REQUIRE(kernels::embedding_backward_uses_kernel(dy, c.ids, V));
      auto got = kernels::embedding_backward(dy, c.ids, V);
      // LibTorch's backward over dy in fp32, rounded once to dy's dtype: what the kernel computes.
      // (At 3072 tokens or fewer LibTorch's own bf16 backward rounds its running sum to bf16 after
      // every 32-token chunk, ~17 roundings in the 517-token row; not the reference here.)
      auto want = kernels::embedding_backward_ref(dy.to(torch::kFloat32), c.ids, V).to(dtype);
      // fp32 sums in another order, each rounded once: every row within a rounding step of the
      // dtype of its largest value (a row of one token exactly dy's)
      const double tol = dtype == torch::kBFloat16 ? 1.0 / 128 : 1e-5;
      auto err = (got.to(torch::kFloat64) - want.to(torch::kFloat64)).abs().amax(1);
      auto scale = want.to(torch::kFloat64).abs().amax(1).clamp_min(1e-30);
      CHECK((err / scale).max().item<double>() <= tol);
      const auto count = torch::bincount(c.ids, {}, V);     // tokens a row
      auto once = count.eq(1).nonzero().flatten();           // rows of one token
      CHECK(torch::equal(got.index_select(0, once), want.index_select(0, once)));
      auto none = count.eq(0).nonzero().flatten();  // rows without tokens: zero
      CHECK(none.numel() > 0);
      CHECK(got.index_select(0, none).eq(0).all().item<bool>());
      CHECK(torch::equal(got, kernels::embedding_backward(dy, c.ids, V)));  // the same bits again
    }
  // Through autograd: the weight's gradient of kernels::embedding.
  auto w = torch::randn({V, D}, torch::TensorOptions().dtype(torch::kBFloat16).device(dev)).requires_grad_();
  auto dy = torch::randn({8192, D}, torch::TensorOptions().dtype(torch::kBFloat16).device(dev));
  auto g = torch::autograd::grad({kernels::embedding(w, random)}, {w}, {dy})[0];
  CHECK(torch::equal(g, kernels::embedding_backward(dy, random, V)));
}

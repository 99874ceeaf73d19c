// kernels::embedding and embedding_backward (kernels/embedding.hpp): on CPU the forward's rows
// and the weight's gradient through autograd against a sum worked in fp64 (repeated ids, ids no
// token reads, the first and last row), and what the backward refuses; on a GPU the kernel
// against that fp64 sum rounded once (every row of [V, D], in fp32, bf16 and fp16, at
// GLM-4.7-Flash's V and D), the same bits on a second run, and what takes the reference.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include "kernels/embedding.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::skip_without_cuda_kernels;

namespace {
// dweight[v] = sum of grad[t] over ids[t] == v, in fp64 on the host, token order.
torch::Tensor grad_fp64(const torch::Tensor& grad, const torch::Tensor& ids, int64_t V) {
  auto g = grad.to(torch::kCPU, torch::kFloat64), i = ids.to(torch::kCPU);
  return torch::zeros({V, grad.size(1)}, g.options()).index_add_(0, i, g);
}
}  // namespace

TEST_CASE("embedding: the ids' rows, and the weight's gradient sums each id's tokens (0 for ids no token reads)") {
  torch::manual_seed(31);
  const int64_t V = 11, D = 8;
  auto w = torch::randn({V, D}, torch::kFloat32).requires_grad_();
  const auto ids = torch::tensor({3, 0, 3, 10, 7, 3, 0}, torch::kLong);  // 3 three times, 0 twice, 10 the last row
  auto out = kernels::embedding(w, ids);
  CHECK(torch::equal(out, w.detach().index_select(0, ids)));
  auto dy = torch::randn({ids.size(0), D});
  out.backward(dy);
  const auto want = grad_fp64(dy, ids, V);
  CHECK(torch::allclose(w.grad().to(torch::kFloat64), want, 1e-6, 1e-6));
  CHECK(w.grad()[1].abs().sum().item<double>() == 0.0);  // no token reads row 1
  CHECK(torch::allclose(kernels::embedding_backward(dy, ids, V).to(torch::kFloat64), want, 1e-6, 1e-6));
  // [B, S] ids: the same per token
  auto out2 = kernels::embedding(w, ids.narrow(0, 0, 6).view({2, 3}));
  CHECK(out2.sizes() == torch::IntArrayRef({2, 3, D}));
  CHECK(torch::equal(out2.view({6, D}), out.narrow(0, 0, 6)));
  // refused: int32 ids, a [T, D] grad with ids of another T, fp64 grads, a negative V
  CHECK_THROWS_WITH_AS(kernels::embedding(w, ids.to(torch::kInt)), doctest::Contains("ids must be int64"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::embedding_backward(dy, ids.narrow(0, 0, 5), V), doctest::Contains("[T, D] and ids [T]"),
                       c10::Error);
  CHECK_THROWS_WITH_AS(kernels::embedding_backward(dy.to(torch::kFloat64), ids, V), doctest::Contains("fp32, bf16"),
                       c10::Error);
  CHECK_THROWS_WITH_AS(kernels::embedding_backward(dy, ids, -1), doctest::Contains("V = -1"), c10::Error);
  CHECK_FALSE(kernels::embedding_backward_uses_kernel(dy, ids));  // CPU: the reference
}

TEST_CASE("CUDA: embedding_backward's kernel writes every row of [V, D] as the fp64 sum rounded once, the same bits twice") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(32);
  const torch::Device dev(torch::kCUDA);
  for (auto dtype : {torch::kBFloat16, torch::kHalf, torch::kFloat32})
    for (auto [T, V, D] : {std::tuple<int64_t, int64_t, int64_t>{1, 3, 8}, {300, 37, 64}, {8192, 154880, 2048}}) {
      auto opt = torch::TensorOptions().dtype(dtype).device(dev);
      // ids drawn from a few rows so that some ids carry many tokens, and the last row always
      auto ids = torch::randint(0, std::min<int64_t>(V, 64), {T}, torch::TensorOptions().dtype(torch::kLong).device(dev));
      ids.index_fill_(0, torch::tensor({T - 1}, ids.options()), V - 1);
      auto dy = torch::randn({T, D}, opt);
      INFO("dtype " << dtype << " T " << T << " V " << V << " D " << D);
      REQUIRE(kernels::embedding_backward_uses_kernel(dy, ids));
      const auto got = kernels::embedding_backward(dy, ids, V);
      CHECK((got.scalar_type() == dtype));
      CHECK(got.sizes() == torch::IntArrayRef({V, D}));
      // The rows some token reads against fp64 sums (fp32 sums of ~T/64 terms: within a rounding
      // step of the result's dtype), every other row exactly 0 (checked on the device).
      const auto read = std::get<0>(at::_unique(ids.to(torch::kCPU)));  // sorted ids
      auto unread = torch::ones({V}, torch::kBool);
      unread.index_fill_(0, read, false);
      const auto unread_rows = unread.nonzero().squeeze(1).to(dev);
      CHECK(got.index_select(0, unread_rows).abs().max().item<double>() == 0.0);
      const auto want = grad_fp64(dy, ids, V).index_select(0, read);
      const double step = dtype == torch::kBFloat16 ? 1.0 / 128 : dtype == torch::kHalf ? 1.0 / 1024 : 1e-5;
      const auto off = [&](const torch::Tensor& t) {
        const auto rows = t.index_select(0, read.to(t.device())).to(torch::kCPU, torch::kFloat64);
        return ((rows - want).abs() - want.abs() * step - 1e-4).clamp_min(0).max().item<double>();
      };
      CHECK(off(got) == 0.0);
      CHECK(torch::equal(got, kernels::embedding_backward(dy, ids, V)));  // no atomics: the same bits
      // through autograd, and LibTorch's backward within the same bound
      auto w = torch::randn({V, D}, opt).requires_grad_();
      kernels::embedding(w, ids).backward(dy);
      CHECK(torch::equal(w.grad(), got));
      CHECK(off(kernels::embedding_backward_ref(dy, ids, V)) == 0.0);
    }
  // rows of a size not a multiple of 16 bytes take the reference
  auto ids = torch::tensor({0, 1}, torch::TensorOptions().dtype(torch::kLong).device(dev));
  auto dy = torch::randn({2, 5}, torch::TensorOptions().dtype(torch::kBFloat16).device(dev));
  CHECK_FALSE(kernels::embedding_backward_uses_kernel(dy, ids));
  CHECK(torch::equal(kernels::embedding_backward(dy, ids, 4), kernels::embedding_backward_ref(dy, ids, 4)));
}

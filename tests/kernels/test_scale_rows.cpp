// kernels::scale_rows_out (kernels/scale_rows.hpp): on CPU the reference (at::mul_out of the
// rows by their factors) and what it refuses; on a GPU the kernel's bits against the host's
// fp32 products rounded once, for each input and output dtype, at the log-prob head's rows
// (8192 x 2048) and at small shapes, factors of 0, -0, inf and NaN, and the layouts it leaves to
// the reference (D not a multiple of 8, a view off the 16-byte grid, strided rows).
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <limits>

#include "kernels/scale_rows.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::skip_without_cuda_kernels;

namespace {
// The contract on the host: fp32 product of x's value and the row's factor, rounded to out's dtype.
torch::Tensor host_scaled(const torch::Tensor& x, const torch::Tensor& a, torch::ScalarType out) {
  return (x.to(torch::kCPU).to(torch::kFloat32) * a.to(torch::kCPU).unsqueeze(1)).to(out);
}
// The two tensors' bit patterns equal wherever `want` is not NaN (a NaN's payload is free).
bool same_bits(const torch::Tensor& got, const torch::Tensor& want) {
  const auto bits = want.element_size() == 4 ? torch::kInt32 : torch::kInt16;
  const auto keep = want.isnan().logical_not();
  return torch::equal(got.contiguous().view(bits).masked_select(keep), want.contiguous().view(bits).masked_select(keep));
}
}  // namespace

TEST_CASE("scale_rows on CPU: the reference's values and what it refuses") {
  auto x = torch::randn({5, 12}), a = torch::randn({5});
  auto out = torch::empty({5, 12}, torch::kBFloat16);
  kernels::scale_rows_out(out, x, a);
  CHECK(torch::equal(out, host_scaled(x, a, torch::kBFloat16)));
  CHECK_FALSE(kernels::scale_rows_uses_kernel(out, x, a));
  auto bad_rows = torch::empty({4, 12});
  CHECK_THROWS_WITH_AS(kernels::scale_rows_out(bad_rows, x, a), doctest::Contains("x [N, D], out [N, D] and a [N]"),
                       c10::Error);
  auto out32 = torch::empty({5, 12});
  CHECK_THROWS_WITH_AS(kernels::scale_rows_out(out32, x, a.to(torch::kFloat64)), doctest::Contains("a must be fp32"),
                       c10::Error);
  CHECK_THROWS_WITH_AS(kernels::scale_rows_out(out32, x, torch::randn({4})), doctest::Contains("and a [4]"), c10::Error);
  // out a partial overlap of x (a shifted view of one buffer): refused before any write
  auto buf = torch::randn({6 * 12});
  auto x5 = buf.narrow(0, 0, 60).view({5, 12}), o5 = buf.narrow(0, 12, 60).view({5, 12});
  CHECK_THROWS_AS(kernels::scale_rows_out(o5, x5, a), c10::Error);
  auto in_place = x.clone();
  kernels::scale_rows_out(in_place, in_place, a);  // out is x: allowed
  CHECK(torch::equal(in_place, host_scaled(x, a, torch::kFloat32)));
}

TEST_CASE("scale_rows CUDA: the host's fp32 products rounded once, every dtype pair, and the layouts left to the reference") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(3);
  const std::pair<int64_t, int64_t> shapes[] = {{8192, 2048}, {37, 8}, {3, 40}, {1, 2056}};
  for (auto ti : {torch::kBFloat16, torch::kFloat16, torch::kFloat32})
    for (auto to : {torch::kBFloat16, torch::kFloat16, torch::kFloat32})
      for (auto [N, D] : shapes) {
        CAPTURE(ti);
        CAPTURE(to);
        CAPTURE(N);
        CAPTURE(D);
        auto x = (torch::randn({N, D}, torch::kCUDA) * 3).to(ti);
        auto a = torch::randn({N}, torch::kCUDA) * 1e-2;
        if (N > 4) {  // the special factors: 0, -0, inf, NaN (inf * 0 = NaN, as the host's)
          a[0] = 0.f;
          a[1] = -0.f;
          a[2] = std::numeric_limits<float>::infinity();
          a[3] = std::numeric_limits<float>::quiet_NaN();
        }
        auto out = torch::empty({N, D}, x.options().dtype(to));
        REQUIRE(kernels::scale_rows_uses_kernel(out, x, a));
        kernels::scale_rows_out(out, x, a);
        const auto want = host_scaled(x, a, to);
        const auto got = out.cpu();
        // bit for bit (signed zeros and infinities included), NaNs where the host has them
        CHECK(torch::equal(got.isnan(), want.isnan()));
        CHECK(same_bits(got, want));
        // and ATen's mixed-dtype mul on the GPU, the reference the head ran before
        auto ref = torch::empty_like(out);
        kernels::scale_rows_out_ref(ref, x, a);
        CHECK(same_bits(ref.cpu(), got));
      }
  // In place (out is x) gives the same values.
  auto x = torch::randn({64, 256}, torch::kCUDA).to(torch::kBFloat16);
  auto a = torch::randn({64}, torch::kCUDA);
  const auto want = host_scaled(x, a, torch::kBFloat16);
  kernels::scale_rows_out(x, x, a);
  CHECK(torch::equal(x.cpu(), want));
  // Layouts the kernel does not take: the reference's values.
  auto base = torch::randn({16, 72}, torch::kCUDA);
  auto a16 = torch::randn({16}, torch::kCUDA);
  auto off_grid = torch::randn({16 * 64 + 1}, torch::kCUDA).narrow(0, 1, 16 * 64).view({16, 64});  // 4 bytes in
  for (auto xv : {base.narrow(1, 0, 70), off_grid, base.narrow(1, 8, 64)}) {  // D % 8, off the grid, strided rows
    auto out = torch::empty(xv.sizes(), xv.options().dtype(torch::kBFloat16));
    CHECK_FALSE(kernels::scale_rows_uses_kernel(out, xv, a16));
    kernels::scale_rows_out(out, xv, a16);
    CHECK(torch::equal(out.cpu(), host_scaled(xv, a16, torch::kBFloat16)));
  }
  auto out = torch::empty({16, 64}, torch::kCUDA);
  CHECK_FALSE(kernels::scale_rows_uses_kernel(out, base.narrow(1, 0, 64), a16.to(torch::kFloat64)));
}

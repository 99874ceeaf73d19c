// kiln's grouped GEMM (kernels/grouped_gemm.hpp): on CPU what it refuses and that the experts
// fall back; on a Hopper GPU every compiled tile of every layout against an fp32 per-expert
// reference (experts without rows included, first and last), grouped_linear's value and
// gradients against F.linear per expert, and against at::_grouped_mm at GLM-4.7-Flash's MoE
// shapes.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include "kernels/grouped_gemm.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::rel_error;
using kiln::test::skip_unless;

namespace {
// Counts with empty experts at both ends and in the middle, summing to M.
torch::Tensor uneven_counts(int64_t E, int64_t M) {
  auto c = torch::randint(1, 64, {E}, torch::kInt64);
  c[0] = 0;
  c[E / 2] = 0;
  c[E - 1] = 0;
  c = (c.to(torch::kFloat64) * double(M) / c.sum().item<double>()).floor().to(torch::kInt64);
  c[1] += M - c.sum().item<int64_t>();
  return c;
}

bool have_grouped_gemm() {
  if (!test::have_cuda_kernels()) return false;
  auto opt = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  return kernels::grouped_linear_available(torch::empty({8, 64}, opt), torch::empty({2, 64, 64}, opt));
}
}  // namespace

TEST_CASE("grouped GEMM: refusals name the input, CPU tensors are not taken, every tile has a name") {
  auto x = torch::randn({16, 64}).to(torch::kBFloat16), w = torch::randn({4, 32, 64}).to(torch::kBFloat16);
  auto offs = torch::tensor({4, 8, 12, 16}, torch::kInt32);
  CHECK_FALSE(kernels::grouped_linear_available(x, w));
  CHECK_THROWS_WITH_AS(kernels::grouped_linear(x, w, offs), doctest::Contains("grouped_linear: needs"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::grouped_linear(x, torch::randn({4, 32, 48}), offs),
                       doctest::Contains("x must be [M, K] and w [E, N, K], got [16, 64] and [4, 32, 48]"), c10::Error);
  for (int t = 0; t < kernels::kGroupedTileCount; ++t)
    CHECK(std::string(kernels::grouped_tile_name(kernels::GroupedTile(t))).size() > 10);
  if (!kernels::built_with_cuda()) {
    CHECK_THROWS_AS(kernels::grouped_mm_ragged_m(x, w.transpose(-2, -1), offs), c10::Error);
    CHECK_THROWS_AS(kernels::grouped_mm_ragged_k(x.t(), x, offs), c10::Error);
  }
}

TEST_CASE("KILN_GROUPED_GEMM_TILES: unset, aten, cutlass, three forms with aten among them, and what it refuses") {
  using kernels::GroupedLayout;
  const auto unset = kernels::parse_grouped_tiles(nullptr);
  CHECK_FALSE(unset.chosen);
  CHECK_FALSE(unset.aten);
  CHECK(kernels::parse_grouped_tiles("").tiles == unset.tiles);
  CHECK(kernels::parse_grouped_tiles("aten").aten);
  CHECK_FALSE(kernels::parse_grouped_tiles("aten").chosen);
  const auto cutlass = kernels::parse_grouped_tiles("cutlass");
  CHECK(cutlass.chosen);
  CHECK(cutlass.tiles == unset.tiles);  // the build's
  CHECK(cutlass.form_aten == std::array<bool, 3>{false, false, false});
  // The weight gradient alone on kiln's kernel (the build's tile for it), the other two forms on
  // at::_grouped_mm: no tile needs compiling for the aten forms.
  const auto tile_dw = unset.tiles[size_t(GroupedLayout::kColRow)];
  const std::string key_dw = kernels::grouped_tile_key(tile_dw);
  if (kernels::grouped_gemm_compiled(GroupedLayout::kColRow, tile_dw)) {  // a build with CUTLASS's headers
    const auto dw_only = kernels::parse_grouped_tiles(("aten,aten," + key_dw).c_str());
    CHECK(dw_only.chosen);
    CHECK(dw_only.form_aten == std::array<bool, 3>{true, true, false});
    CHECK(dw_only.tiles[size_t(GroupedLayout::kColRow)] == tile_dw);
  } else {
    CHECK_THROWS_WITH_AS(kernels::parse_grouped_tiles(("aten,aten," + key_dw).c_str()),
                         doctest::Contains("is not compiled into this build"), c10::Error);
  }
  CHECK(kernels::parse_grouped_tiles("aten,aten,aten").form_aten == std::array<bool, 3>{true, true, true});
  CHECK_THROWS_WITH_AS(kernels::parse_grouped_tiles("aten,bogus,aten"),
                       doctest::Contains("unknown tile \"bogus\"; one of coop128x256"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::parse_grouped_tiles("aten,aten"), doctest::Contains("needs \"aten\", \"cutlass\" or three"),
                       c10::Error);
  CHECK_THROWS_WITH_AS(kernels::parse_grouped_tiles("aten,aten,aten,aten"), doctest::Contains("more than three tiles"),
                       c10::Error);
}

TEST_CASE("CUDA: grouped GEMM, every compiled tile of every layout equals an fp32 per-expert reference") {
  if (skip_unless(have_grouped_gemm(), "needs kiln's grouped GEMM (a CUTLASS build) and a Hopper GPU")) return;
  torch::manual_seed(21);
  const torch::Device dev(torch::kCUDA);
  auto opt = torch::TensorOptions().dtype(torch::kBFloat16).device(dev);
  const int64_t E = 9, M = 1000, Kd = 192, N = 136;
  auto counts = uneven_counts(E, M);
  auto offs = counts.cumsum(0).to(torch::kInt32).to(dev);
  auto x = torch::randn({M, Kd}, opt), dy = torch::randn({M, N}, opt);
  auto w = torch::randn({E, N, Kd}, opt) * 0.1;  // [E, N, K]
  auto cnt = counts.accessor<int64_t, 1>();
  // fp32 references of the three forms, expert by expert
  auto y_ref = torch::zeros({M, N}, torch::kFloat32), dx_ref = torch::zeros({M, Kd}, torch::kFloat32);
  auto dw_ref = torch::zeros({E, N, Kd}, torch::kFloat32);
  auto xf = x.cpu().to(torch::kFloat32), dyf = dy.cpu().to(torch::kFloat32), wf = w.cpu().to(torch::kFloat32);
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (cnt[e] > 0) {
      auto xe = xf.narrow(0, start, cnt[e]), dye = dyf.narrow(0, start, cnt[e]);
      y_ref.narrow(0, start, cnt[e]).copy_(xe.matmul(wf[e].t()));
      dx_ref.narrow(0, start, cnt[e]).copy_(dye.matmul(wf[e]));
      dw_ref[e].copy_(dye.t().matmul(xe));
    }
    start += cnt[e];
  }
  int tested = 0;
  for (int t = 0; t < kernels::kGroupedTileCount; ++t) {
    const auto tile = kernels::GroupedTile(t);
    INFO("tile " << kernels::grouped_tile_name(tile));
    if (kernels::grouped_gemm_compiled(kernels::GroupedLayout::kRowCol, tile)) {
      auto y = kernels::grouped_mm_ragged_m(x, w.transpose(-2, -1), offs, tile);
      CHECK(rel_error(y.cpu(), y_ref) < 4e-3);
      ++tested;
    }
    if (kernels::grouped_gemm_compiled(kernels::GroupedLayout::kRowRow, tile)) {
      auto dx = kernels::grouped_mm_ragged_m(dy, w, offs, tile);
      CHECK(rel_error(dx.cpu(), dx_ref) < 4e-3);
      ++tested;
    }
    if (kernels::grouped_gemm_compiled(kernels::GroupedLayout::kColRow, tile)) {
      auto garbage = torch::full({E, N, Kd}, 7.0, opt);  // the allocator's next block: stale values
      garbage.reset();
      auto dw = kernels::grouped_mm_ragged_k(dy.t(), x, offs, tile);
      CHECK(rel_error(dw.cpu(), dw_ref) < 4e-3);
      CHECK(dw[0].abs().max().item<float>() == 0.0f);  // experts without rows: exact zeros
      CHECK(dw[E - 1].abs().max().item<float>() == 0.0f);
      CHECK(dw[E / 2].abs().max().item<float>() == 0.0f);
      ++tested;
    }
  }
  CHECK(tested >= 3);  // each layout's chosen tile at least
}

TEST_CASE("CUDA: grouped_linear's value and gradients equal F.linear per expert, and at::_grouped_mm's at GLM-4.7-Flash's shapes") {
  if (skip_unless(have_grouped_gemm(), "needs kiln's grouped GEMM (a CUTLASS build) and a Hopper GPU")) return;
  torch::manual_seed(22);
  const torch::Device dev(torch::kCUDA);
  auto opt = torch::TensorOptions().dtype(torch::kBFloat16).device(dev);
  SUBCASE("small, experts without rows") {
    const int64_t E = 6, M = 300, Kd = 64, N = 96;
    auto counts = uneven_counts(E, M);
    auto offs = counts.cumsum(0).to(torch::kInt32).to(dev);
    auto x = torch::randn({M, Kd}, opt).requires_grad_(), w = (torch::randn({E, N, Kd}, opt) * 0.1).requires_grad_();
    auto dy = torch::randn({M, N}, opt);
    auto y = kernels::grouped_linear(x, w, offs);
    y.backward(dy);
    auto xr = x.detach().to(torch::kFloat32).requires_grad_(), wr = w.detach().to(torch::kFloat32).requires_grad_();
    std::vector<torch::Tensor> parts;
    int64_t start = 0;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t n = counts[e].item<int64_t>();
      parts.push_back(torch::nn::functional::linear(xr.narrow(0, start, n), wr[e]));
      start += n;
    }
    auto yr = torch::cat(parts);
    yr.backward(dy.to(torch::kFloat32));
    CHECK(rel_error(y, yr) < 4e-3);
    CHECK(rel_error(x.grad(), xr.grad()) < 4e-3);
    CHECK(rel_error(w.grad(), wr.grad()) < 4e-3);
    CHECK(w.grad()[0].abs().max().item<float>() == 0.0f);
  }
  SUBCASE("GLM-4.7-Flash's gate/up: E 64, D 2048, 2F 3072, 8192 tokens top-4") {
    const int64_t E = 64, M = 32768, Kd = 2048, N = 3072;
    auto top = std::get<1>(torch::rand({M / 4, E}).topk(4, 1)).flatten();
    auto offs = torch::bincount(top, {}, E).cumsum(0).to(torch::kInt32).to(dev);
    auto x = torch::randn({M, Kd}, opt).requires_grad_(), w = (torch::randn({E, N, Kd}, opt) * 0.02).requires_grad_();
    auto x2 = x.detach().clone().requires_grad_(), w2 = w.detach().clone().requires_grad_();
    auto dy = torch::randn({M, N}, opt);
    auto y = kernels::grouped_linear(x, w, offs);
    y.backward(dy);
    auto y2 = at::_grouped_mm(x2, w2.transpose(-2, -1), offs);
    y2.backward(dy);
    CHECK(rel_error(y, y2) < 2e-3);
    CHECK(rel_error(x.grad(), x2.grad()) < 2e-3);
    CHECK(rel_error(w.grad(), w2.grad()) < 2e-3);
  }
}

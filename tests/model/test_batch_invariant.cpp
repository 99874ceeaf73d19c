// The blocks' batch-invariant forms (model/blocks/batch_invariant.hpp): the elementwise
// activations give an element the same bits wherever it sits (ATen's CPU silu and sigmoid do
// not, shown here), the MoE combine in slot order equals index_add's sum, and the generic
// autograd helper returns the invariant value with the reference op's gradients.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include "kernels/batch_invariant.hpp"
#include "model/blocks/batch_invariant.hpp"
#include "model/blocks/moe.hpp"

using namespace kiln::model;

namespace {
// Elements of op(x) that differ from op of that element alone.
int64_t position_dependent(const std::function<torch::Tensor(const torch::Tensor&)>& op, const torch::Tensor& x,
                           int64_t first) {
  auto full = op(x);
  int64_t differ = 0;
  for (int64_t i = 0; i < first; ++i) differ += !torch::equal(op(x.narrow(0, i, 1))[0], full[i]);
  return differ;
}
}  // namespace

TEST_CASE("invariant silu and sigmoid: an element's bits do not depend on its position (ATen's CPU ops' do), close to them") {
  torch::manual_seed(0);
  auto x = 4 * torch::randn({20011});
  CHECK(position_dependent(invariant_silu, x, 2000) == 0);
  CHECK(position_dependent(invariant_sigmoid, x, 2000) == 0);
  const int64_t aten_silu = position_dependent([](const torch::Tensor& a) { return torch::silu(a); }, x, 2000);
  const int64_t aten_sigmoid = position_dependent([](const torch::Tensor& a) { return torch::sigmoid(a); }, x, 2000);
  MESSAGE("ATen CPU elements whose value depends on their position, of 2000: silu " << aten_silu << ", sigmoid "
                                                                                     << aten_sigmoid);
  CHECK((invariant_silu(x) - torch::silu(x)).abs().max().item<double>() <= 1e-5);
  CHECK((invariant_sigmoid(x) - torch::sigmoid(x)).abs().max().item<double>() <= 1e-6);
  auto xb = x.to(torch::kBFloat16);
  CHECK((invariant_silu(xb).to(torch::kFloat32) - torch::silu(xb).to(torch::kFloat32)).abs().max().item<double>() <= 0.07);
}

TEST_CASE("invariant_forward gives the invariant value with the reference's gradients, and invariant_linear its direct backward") {
  torch::manual_seed(1);
  auto x = torch::randn({9, 20}, torch::requires_grad()), w = torch::randn({7, 20}, torch::requires_grad());
  auto y = invariant_forward([](const std::vector<torch::Tensor>& in) { return kiln::kernels::bi_linear(in[0], in[1]).tanh(); },
                             [](const std::vector<torch::Tensor>& in) { return in[0].mm(in[1].t()).tanh(); }, {x, w});
  CHECK(torch::equal(y.detach(), kiln::kernels::bi_linear(x.detach(), w.detach()).tanh()));
  auto g = torch::randn({9, 7});
  auto got = torch::autograd::grad({y}, {x, w}, {g});
  auto want = torch::autograd::grad({x.mm(w.t()).tanh()}, {x, w}, {g});
  CHECK(torch::allclose(got[0], want[0], 1e-5, 1e-6));
  CHECK(torch::allclose(got[1], want[1], 1e-5, 1e-6));
  auto yl = invariant_linear(x.view({3, 3, 20}), w);  // [3, 3, 7]
  CHECK(yl.sizes() == torch::IntArrayRef({3, 3, 7}));
  auto gl = torch::autograd::grad({yl}, {x, w}, {g.view({3, 3, 7})});
  auto wl = torch::autograd::grad({x.mm(w.t())}, {x, w}, {g});
  CHECK(torch::allclose(gl[0], wl[0], 1e-5, 1e-6));
  CHECK(torch::allclose(gl[1], wl[1], 1e-5, 1e-6));
}

TEST_CASE("MoE combine in slot order equals index_add's sum") {
  torch::manual_seed(2);
  const int64_t T = 11, E = 6, K = 3, D = 5;
  auto scores = torch::rand({T, E});
  RouterOptions o{D, E, K, 1, 1, true, 1.8};
  auto r = route_from_scores(scores, torch::zeros({E}), o);
  auto r_inv = route_from_scores(scores, torch::zeros({E}), o, std::nullopt, true, /*batch_invariant=*/true);
  CHECK(torch::equal(r.expert_ids, r_inv.expert_ids));
  CHECK(torch::allclose(r.weights, r_inv.weights, 1e-6, 1e-7));
  auto x = torch::randn({T, D});
  auto d = dispatch(x, r, E);
  auto rows = torch::randn({T * K, D});
  CHECK(torch::allclose(combine(rows, d, T, /*batch_invariant=*/true), combine(rows, d, T), 1e-6, 1e-6));
  // Token t's sum is its slots' rows in slot order, whatever the dispatch order.
  auto y = combine(rows, d, T, true);
  for (int64_t t : {int64_t(0), T - 1}) {
    auto want = torch::zeros({D});
    for (int64_t k = 0; k < K; ++k) {
      const int64_t row = (d.pair_index == t * K + k).nonzero().item<int64_t>();
      want = k == 0 ? rows[row] * d.weight[row] : want + rows[row] * d.weight[row];
    }
    CHECK(torch::equal(y[t], want));
  }
}

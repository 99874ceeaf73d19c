// The blocks' batch-invariant forms (model/blocks/batch_invariant.hpp): the elementwise
// activations give an element the same bits wherever it sits (ATen's CPU silu and sigmoid do
// not, shown here), the MoE dispatch and combine by gathers equal index_select/index_add (the mode's slot-order sum exact), and the generic
// autograd helper returns the invariant value with the reference op's gradients.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include "kernels/batch_invariant.hpp"
#include "kernels/moe.hpp"
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

TEST_CASE("MoE dispatch and combine by gathers equal index_select and index_add in values and gradients, routing weights are summed in slot order as the engine's, and the mode's slot-order combine is exact") {
  torch::manual_seed(2);
  const int64_t T = 11, E = 6, K = 3, D = 5;
  auto scores = torch::rand({T, E});
  RouterOptions o{D, E, K, 1, 1, true, 1.8};
  auto r = route_from_scores(scores, torch::zeros({E}), o);
  // The routing weights: the K scores summed in slot order, the same bits as the engine's
  // kernels::router_topk_weights (whose reference is that formula) from the same logits.
  for (int64_t t : {int64_t(0), T - 1}) {
    auto sum = scores[t][r.expert_ids[t][0]];
    for (int64_t k = 1; k < K; ++k) sum = sum + scores[t][r.expert_ids[t][k]];
    for (int64_t k = 0; k < K; ++k)
      CHECK(torch::equal(r.weights[t][k], scores[t][r.expert_ids[t][k]] / (sum + 1e-20) * 1.8));
  }
  auto logits = torch::logit(scores);
  auto [ids_engine, w_engine] = kiln::kernels::router_topk_weights_ref(logits, torch::zeros({E}), K, true, 1.8);
  auto r_replay = route_from_scores(logits.sigmoid(), torch::zeros({E}), o, ids_engine);
  CHECK(torch::equal(r_replay.weights, w_engine));
  auto x = torch::randn({T, D}, torch::requires_grad());
  auto rows = torch::randn({T * K, D}, torch::requires_grad());
  auto d = dispatch(x, r, E);
  auto w_rows = d.weight_TK.reshape({-1}).index_select(0, d.slot);  // [T*K] in row order
  // The index_select / index_add formulation, with autograd's own backward of both.
  auto ref_x = x.index_select(0, d.token_index);
  auto ref_y = torch::zeros({T, D}).index_add(0, d.token_index, rows * w_rows.unsqueeze(-1));
  CHECK(torch::equal(d.x, ref_x));
  auto y = combine(rows, d, T);
  CHECK(torch::allclose(y, ref_y, 1e-6, 1e-6));
  auto g_x = torch::randn({T * K, D}), g_y = torch::randn({T, D});
  auto grads = torch::autograd::grad({(d.x * g_x).sum() + (y * g_y).sum()}, {x, rows});
  auto ref_grads = torch::autograd::grad({(ref_x * g_x).sum() + (ref_y * g_y).sum()}, {x, rows});
  CHECK(torch::allclose(grads[0], ref_grads[0], 1e-6, 1e-6));
  CHECK(torch::allclose(grads[1], ref_grads[1], 1e-6, 1e-6));
  // The mode: token t's sum is its slots' products added in slot order, whatever the dispatch order.
  auto y_inv = combine(rows, d, T, /*batch_invariant=*/true);
  CHECK(torch::allclose(y_inv, ref_y, 1e-6, 1e-6));
  for (int64_t t : {int64_t(0), T - 1}) {
    auto want = torch::zeros({D});
    for (int64_t k = 0; k < K; ++k) {
      const int64_t row = (d.slot == t * K + k).nonzero().item<int64_t>();
      auto p = rows[row] * d.weight_TK[t][k];
      want = k == 0 ? p : want + p;
    }
    CHECK(torch::equal(y_inv[t], want));
  }
}

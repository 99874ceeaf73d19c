// Hand-checked cases for the blocks, the config and the flavors.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "kernels/lm_head.hpp"
#include "kernels/mla_rope.hpp"
#include "model/blocks/activation_checkpoint.hpp"
#include "model/blocks/fusions.hpp"
#include "model/blocks/logprobs.hpp"
#include "model/blocks/moe.hpp"
#include "model/blocks/recompute.hpp"
#include "model/glm4_moe_lite/model.hpp"
#include "tests/test_util.hpp"

using namespace kiln::model;
using glm4_moe_lite::Glm4MoeLiteConfig;

TEST_CASE("router: the correction bias chooses in fp32, the unbiased scores weigh") {
  auto scores = torch::tensor({{0.50f, 0.49f, 0.48f, 0.47f}});
  auto bias = torch::tensor({7.000f, 7.015f, 7.030f, 7.045f});
  RouterOptions top1{0, 4, 1, 1, 1, true, 1.8};
  CHECK(route_from_scores(scores, bias, top1).expert_ids.item<int64_t>() == 3);
  RouterOptions top2{0, 4, 2, 1, 1, true, 1.8};
  auto r = route_from_scores(scores, bias, top2);
  CHECK(r.expert_ids[0][0].item<int64_t>() == 3);
  CHECK(r.expert_ids[0][1].item<int64_t>() == 2);
  CHECK(r.weights[0][0].item<float>() == doctest::Approx(0.8905).epsilon(1e-4));  // 0.47 / 0.95 * 1.8
  CHECK(r.weights[0][1].item<float>() == doctest::Approx(0.9095).epsilon(1e-4));  // 0.48 / 0.95 * 1.8
  // The hazard: the same bias rounded to bf16 picks expert 2.
  auto bf16_bias = bias.to(torch::kBFloat16).to(torch::kFloat32);
  CHECK(route_from_scores(scores, bf16_bias, top1).expert_ids.item<int64_t>() == 2);
  // A bf16 model keeps its correction bias in fp32.
  {
    glm4_moe_lite::Glm4MoeLiteModel m(glm4_moe_lite::flavors::debug());
    m.to_dtype(torch::kBFloat16);
    auto& router = m.layers[1]->moe->router;
    CHECK((router->weight.scalar_type() == torch::kBFloat16));
    CHECK((router->e_score_correction_bias.scalar_type() == torch::kFloat32));
  }
}

TEST_CASE("CUDA bf16: the router's logits are the fp32 GEMM's bits, its backward bf16 GEMMs within bf16 rounding of the fp32 one") {
  if (kiln::test::skip_without_gpu()) return;
  torch::manual_seed(31);
  const int64_t T = 300, D = 256, E = 64;
  const RouterOptions o{D, E, 4, 1, 1, true, 2.5};
  TopKRouter router(o);
  router->to(torch::kCUDA, torch::kBFloat16);
  {
    torch::NoGradGuard no_grad;
    router->weight.copy_(torch::randn({E, D}) * 0.05);
  }
  auto x = torch::randn({T, D}, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16)).requires_grad_();
  const auto g = torch::randn({T, 4}, torch::TensorOptions().device(torch::kCUDA));
  auto r = router(x);
  (r.weights * g).sum().backward();
  // The same route through the fp32 path (x and the weight cast to fp32 outside the router).
  TopKRouter ref(o);
  ref->to(torch::kCUDA);
  {
    torch::NoGradGuard no_grad;
    ref->weight.copy_(router->weight.to(torch::kFloat32));
  }
  auto x32 = x.detach().to(torch::kFloat32).requires_grad_();
  auto r32 = ref(x32);
  (r32.weights * g).sum().backward();
  CHECK(torch::equal(r.expert_ids, r32.expert_ids));
  CHECK(torch::equal(r.weights, r32.weights));  // the forward's bits: the same fp32 GEMM
  CHECK((x.grad().scalar_type() == torch::kBFloat16));
  const double ex = kiln::test::rel_error(x.grad().to(torch::kFloat32), x32.grad());
  const double ew = kiln::test::rel_error(router->weight.grad().to(torch::kFloat32), ref->weight.grad());
  MESSAGE("router backward in bf16 against fp32: x grad " << ex << ", weight grad " << ew << " relative");
  CHECK(ex <= 1e-2);
  CHECK(ew <= 1e-2);
}

TEST_CASE("router: group-limited selection keeps experts of the best group only") {
  // 4 experts in 2 groups, keep 1 group: group {0,1} scores 0.9+0.1, group {2,3} 0.6+0.6.
  auto scores = torch::tensor({{0.9f, 0.1f, 0.6f, 0.6f}});
  RouterOptions o{0, 4, 2, 2, 1, false, 1.0};
  auto r = route_from_scores(scores, torch::zeros({4}), o);
  auto ids = std::get<0>(r.expert_ids.sort(-1));
  CHECK(ids[0][0].item<int64_t>() == 2);  // 1.2 > 1.0: the second group wins although expert 0 scores highest
  CHECK(ids[0][1].item<int64_t>() == 3);
}

TEST_CASE("router: a group scores the sum of its top-2 biased scores, not all of them and not the unbiased ones") {
  // 6 experts in 2 groups of 3, keep 1 group, top-2 experts.
  auto ids_of = [](const torch::Tensor& scores, const torch::Tensor& bias) {
    RouterOptions o{0, 6, 2, 2, 1, true, 1.0};
    auto ids = std::get<0>(route_from_scores(scores, bias, o).expert_ids.sort(-1));
    return std::vector<int64_t>{ids[0][0].item<int64_t>(), ids[0][1].item<int64_t>()};
  };
  // Top-2 sums: {0,1,2} 1.4, {3,4,5} 1.15 -> group 0. All three: 1.4 vs 1.65 -> group 1.
  auto scores = torch::tensor({{0.7f, 0.7f, 0.0f, 0.65f, 0.5f, 0.5f}});
  CHECK(ids_of(scores, torch::zeros({6})) == std::vector<int64_t>{0, 1});
  // The bias chooses the group too: unbiased {0,1,2} 1.2 wins, biased {3,4,5} 0.7 + 0.7 = 1.4 does.
  auto close = torch::tensor({{0.6f, 0.6f, 0.0f, 0.5f, 0.5f, 0.0f}});
  auto bias = torch::tensor({0.0f, 0.0f, 0.0f, 0.2f, 0.2f, 0.2f});
  CHECK(ids_of(close, bias) == std::vector<int64_t>{3, 4});
}

TEST_CASE("router: without norm_topk_prob the weights are the raw scores times the scaling factor") {
  auto scores = torch::tensor({{0.50f, 0.20f, 0.40f, 0.10f}});
  RouterOptions o{0, 4, 2, 1, 1, false, 2.5};
  auto r = route_from_scores(scores, torch::zeros({4}), o);
  CHECK(r.expert_ids[0][0].item<int64_t>() == 0);
  CHECK(r.expert_ids[0][1].item<int64_t>() == 2);
  CHECK(r.weights[0][0].item<float>() == doctest::Approx(1.25));  // normalised: 0.5 / 0.9 * 2.5 = 1.389
  CHECK(r.weights[0][1].item<float>() == doctest::Approx(1.0));
  o.norm_topk_prob = true;
  CHECK(route_from_scores(scores, torch::zeros({4}), o).weights[0][0].item<float>() == doctest::Approx(0.5 / 0.9 * 2.5));
}

TEST_CASE("interleaved RoPE rotates adjacent pairs") {
  auto x = torch::tensor({1.0f, 0.0f, 0.0f, 0.0f}).view({1, 1, 4});  // [T, H, R]
  auto y = apply_rope(x, torch::tensor({int64_t(1)}), 10000.0, /*interleaved=*/true);
  // pair 0 has inv_freq theta^0 = 1: angle 1 at position 1
  CHECK(y[0][0][0].item<float>() == doctest::Approx(0.5403).epsilon(1e-4));
  CHECK(y[0][0][1].item<float>() == doctest::Approx(0.8415).epsilon(1e-4));
  CHECK(y[0][0][2].item<float>() == 0.0f);
  CHECK(y[0][0][3].item<float>() == 0.0f);
  // Non-interleaved pairs (x0, x2) instead.
  auto z = apply_rope(x, torch::tensor({int64_t(1)}), 10000.0, /*interleaved=*/false);
  CHECK(z[0][0][2].item<float>() == doctest::Approx(0.8415).epsilon(1e-4));
}

TEST_CASE("with rope_type default the attention scale is exactly 1/sqrt(qk_head_dim)") {
  auto c = glm4_moe_lite::flavors::glm47_flash();
  CHECK(c.attention.softmax_scale() == 1.0 / 16.0);  // qk_head_dim 192 + 64 = 256
  auto d = glm4_moe_lite::flavors::debug();
  CHECK(d.attention.softmax_scale() == 1.0 / std::sqrt(24.0));
  auto j = c.to_hf_json();
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 1e6}, {"factor", 4.0}};
  CHECK_THROWS_WITH_AS(Glm4MoeLiteConfig::from_hf_json(j, "test"), doctest::Contains("'yarn' is not supported"),
                       std::invalid_argument);
}

TEST_CASE("log-prob of token t+1 is read from the logits at t, never across a document boundary") {
  // docs [10 11 12 | 20 21]
  auto ids = torch::tensor(std::vector<int64_t>{10, 11, 12, 20, 21});
  auto cu = torch::tensor(std::vector<int64_t>{0, 3, 5});
  auto targets = next_token_targets(ids, cu);
  CHECK(targets.equal(torch::tensor(std::vector<int64_t>{11, 12, -1, 21, -1})));
  torch::manual_seed(0);
  auto hidden = torch::randn({5, 8});
  auto weight = torch::randn({32, 8});
  auto lp = token_logprobs(hidden, weight, targets, 2);
  auto ref = torch::log_softmax(hidden.mm(weight.t()), -1);
  CHECK(lp[0].item<float>() == doctest::Approx(ref[0][11].item<float>()).epsilon(1e-6));
  CHECK(lp[3].item<float>() == doctest::Approx(ref[3][21].item<float>()).epsilon(1e-6));
  CHECK(lp[2].item<float>() == 0.0f);  // last token of document 0 predicts nothing
  CHECK(lp[4].item<float>() == 0.0f);
}

TEST_CASE("chunked log-probs equal the full log-softmax, values and gradients, for any chunk size") {
  torch::manual_seed(1);
  auto hidden = torch::randn({13, 16}, torch::requires_grad());
  auto weight = torch::randn({50, 16}, torch::requires_grad());
  auto targets = torch::randint(0, 50, {13}, torch::kInt64);
  targets[4] = -1;
  auto g = torch::randn({13});
  auto ref = torch::log_softmax(hidden.mm(weight.t()), -1).gather(1, targets.clamp_min(0).unsqueeze(1)).squeeze(1) *
             (targets >= 0);
  auto ref_grads = torch::autograd::grad({(ref * g).sum()}, {hidden, weight});
  for (int64_t chunk : {1, 4, 13, 1000}) {
    CAPTURE(chunk);
    auto lp = token_logprobs(hidden, weight, targets, chunk);
    CHECK((lp - ref).abs().max().item<double>() <= 1e-5);
    auto grads = torch::autograd::grad({(lp * g).sum()}, {hidden, weight});
    CHECK((grads[0] - ref_grads[0]).abs().max().item<double>() <= 1e-5);
    CHECK((grads[1] - ref_grads[1]).abs().max().item<double>() <= 1e-5);
  }
}

namespace {
// A bf16 log-prob head: hidden [T, D] and weight [V, D] (0.5 x normal, rounded to bf16), targets
// in [0, V) with -1 at the rows `no_target`, upstream gradients g [T], and the fp32 reference
// (log_softmax of the same bf16 values in fp32) with its gradients; `run(keep_bytes)` gives
// token_logprobs' (log-probs, hidden gradient, weight gradient) at that budget.
struct Bf16LogprobHead {
  int64_t chunk;
  torch::Tensor hidden, weight, targets, g, ref;
  std::vector<torch::Tensor> ref_grads;
  Bf16LogprobHead(int64_t T, int64_t D, int64_t V, int64_t chunk_, std::vector<int64_t> no_target,
                  torch::Device dev, uint64_t seed)
      : chunk(chunk_) {
    torch::manual_seed(int64_t(seed));
    hidden = (torch::randn({T, D}, dev) * 0.5).to(torch::kBFloat16).requires_grad_();
    weight = (torch::randn({V, D}, dev) * 0.5).to(torch::kBFloat16).requires_grad_();
    targets = torch::randint(0, V, {T}, torch::TensorOptions().device(dev).dtype(torch::kInt64));
    for (int64_t t : no_target) targets[t] = -1;
    g = torch::randn({T}, dev);
    auto hr = hidden.detach().to(torch::kFloat32).requires_grad_();
    auto wr = weight.detach().to(torch::kFloat32).requires_grad_();
    ref = torch::log_softmax(hr.mm(wr.t()), -1).gather(1, targets.clamp_min(0).unsqueeze(1)).squeeze(1) *
          (targets >= 0);
    ref_grads = torch::autograd::grad({(ref * g).sum()}, {hr, wr});
  }
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> run(int64_t keep_bytes, bool retain_graph = false) const {
    auto lp = token_logprobs(hidden, weight, targets, chunk, keep_bytes);
    auto grads = torch::autograd::grad({(lp * g).sum()}, {hidden, weight}, {}, retain_graph);
    return {lp, grads[0], grads[1]};
  }
};
}  // namespace

TEST_CASE("bf16 log-probs with part of the logits kept equal the all-kept and the recomputed forms on CPU") {
  // On CPU the recomputed bf16 logits are the kept ones (linear rounds to bf16), so the three
  // forms must agree bit for bit: a kept chunk read for the wrong rows would not.
  const int64_t T = 13, V = 50, row_bytes = V * 2;
  const Bf16LogprobHead head(T, 16, V, /*chunk=*/4, {2, 9}, torch::kCPU, 3);
  auto [lp_none, gh_none, gw_none] = head.run(0);
  auto [lp_all, gh_all, gw_all] = head.run(T * row_bytes);
  // Room for 9 rows: the first two whole chunks (8 rows) kept, the last 5 rows recomputed.
  auto [lp_part, gh_part, gw_part] = head.run(9 * row_bytes);
  CHECK(torch::equal(lp_part, lp_all));
  CHECK(torch::equal(lp_part, lp_none));
  CHECK(torch::equal(gh_part, gh_all));
  CHECK(torch::equal(gh_part, gh_none));
  CHECK(torch::equal(gw_part, gw_all));
  CHECK(torch::equal(gw_part, gw_none));
  CHECK((lp_part - head.ref).abs().max().item<double>() <= 0.05);
  CHECK(kiln::test::rel_error(gh_part, head.ref_grads[0]) <= 2e-2);
  CHECK(kiln::test::rel_error(gw_part, head.ref_grads[1]) <= 2e-2);
}

TEST_CASE("CUDA bf16: log-probs with part of the logits kept stay near the fp32 reference and near the all-kept and recomputed forms") {
  if (kiln::test::skip_without_gpu()) return;
  const int64_t T = 700, V = 1000;
  const Bf16LogprobHead head(T, 64, V, /*chunk=*/128, {300}, torch::kCUDA, 4);
  auto [lp_all, gh_all, gw_all] = head.run(T * V * 2);
  auto [lp_none, gh_none, gw_none] = head.run(0);
  auto [lp_part, gh_part, gw_part] = head.run(300 * V * 2);  // 256 rows kept, 444 recomputed
  CHECK(torch::equal(lp_part, lp_all));
  CHECK((lp_part - head.ref).abs().max().item<double>() <= 0.05);
  CHECK((gh_part.scalar_type() == torch::kBFloat16));
  CHECK((gw_part.scalar_type() == torch::kBFloat16));
  for (const auto& [gh, gw] : {std::pair{gh_part, gw_part}, std::pair{gh_all, gw_all}, std::pair{gh_none, gw_none}}) {
    CHECK(kiln::test::rel_error(gh, head.ref_grads[0]) <= 2e-2);
    CHECK(kiln::test::rel_error(gw, head.ref_grads[1]) <= 2e-2);
  }
  CHECK(kiln::test::rel_error(gh_part.narrow(0, 0, 256), gh_all.narrow(0, 0, 256)) <= 1e-2);
  CHECK(kiln::test::rel_error(gh_part.narrow(0, 256, T - 256), gh_none.narrow(0, 256, T - 256)) <= 1e-2);
  // Kept logits are overwritten by their gradient (a second backward is refused); with room for
  // less than one chunk nothing is kept and the graph runs twice.
  auto twice = [&](int64_t keep_bytes) {
    auto lp = std::get<0>(head.run(keep_bytes, /*retain_graph=*/true));
    (void)torch::autograd::grad({(lp * head.g).sum()}, {head.hidden, head.weight});
  };
  CHECK_THROWS_WITH_AS(twice(300 * V * 2), doctest::Contains("modified by an inplace operation"), c10::Error);
  CHECK_NOTHROW(twice(100 * V * 2));
}

TEST_CASE("CUDA bf16: log-probs from kept logits and their gradients from two whole GEMMs stay near the fp32 reference and a second backward is refused") {
  if (kiln::test::skip_without_gpu()) return;
  const Bf16LogprobHead head(300, 64, 1000, /*chunk=*/128, {7}, torch::kCUDA, 2);
  auto [lp, gh, gw] = head.run(kKeepLogitsMaxBytes, /*retain_graph=*/true);  // kept: 16-bit, grad enabled
  CHECK((lp - head.ref).abs().max().item<double>() <= 0.05);                 // bf16 logits kept
  CHECK((gh.scalar_type() == torch::kBFloat16));
  CHECK((gw.scalar_type() == torch::kBFloat16));
  CHECK(kiln::test::rel_error(gh, head.ref_grads[0]) <= 2e-2);
  CHECK(kiln::test::rel_error(gw, head.ref_grads[1]) <= 2e-2);
  // The backward overwrote the kept logits with their gradient: autograd refuses to run it again.
  CHECK_THROWS_WITH_AS(torch::autograd::grad({(lp * head.g).sum()}, {head.hidden, head.weight}),
                       doctest::Contains("modified by an inplace operation"), c10::Error);
}

TEST_CASE("CUDA bf16: log-probs through the fused head (probabilities and row sums in one GEMM) stay within fp32 rounding of cuBLAS's, kept, recomputed and without grad") {
  if (kiln::test::skip_without_gpu()) return;
  const int64_t T = 700, V = 1000;
  const Bf16LogprobHead head(T, 64, V, /*chunk=*/128, {300}, torch::kCUDA, 5);
  {
    const kiln::kernels::LmHeadSettingsScope on(true);
    if (kiln::test::skip_unless(kiln::kernels::lm_head_fused_available(head.hidden, head.weight),
                                "needs the fused head: a Hopper GPU and a build with CUTLASS"))
      return;
  }
  torch::Tensor first;
  for (int64_t keep : {T * V * 2, int64_t(300 * V * 2), int64_t(0)}) {  // all kept, 256 rows, none
    CAPTURE(keep);
    std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> fused;
    {
      const kiln::kernels::LmHeadSettingsScope on(true);
      fused = head.run(keep);
    }
    std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> plain;
    {
      const kiln::kernels::LmHeadSettingsScope off(false);  // cuBLAS into fp32 and kiln's pass
      plain = head.run(keep);
    }
    const auto& [lp, gh, gw] = plain;
    const auto& [flp, fgh, fgw] = fused;
    if (!first.defined()) first = flp;
    CHECK(torch::equal(flp, first));  // one forward, whatever is kept
    CHECK((flp - lp).abs().max().item<double>() <= 1e-4);
    CHECK(flp[300].item<double>() == 0.0);
    // Kept: the backward from the probabilities (two row-scaled GEMMs), whose softmax comes from
    // the fp32 accumulators, against kiln's pass over bf16 logits (a rounding of up to |z| 2^-9 in
    // each logit): both near the fp32 reference, the fused one no further from it. Recomputed:
    // the same code on both sides.
    const double eh = kiln::test::rel_error(fgh, head.ref_grads[0]), ew = kiln::test::rel_error(fgw, head.ref_grads[1]);
    MESSAGE("keep " << keep << ": |grad - fp32| / |fp32|: hidden fused " << eh << " cuBLAS+pass "
                    << kiln::test::rel_error(gh, head.ref_grads[0]) << ", weight fused " << ew << " cuBLAS+pass "
                    << kiln::test::rel_error(gw, head.ref_grads[1]));
    CHECK(kiln::test::rel_error(fgh, gh) <= 1e-2);
    CHECK(kiln::test::rel_error(fgw, gw) <= 1e-2);
    CHECK(eh <= 2e-2);
    CHECK(ew <= 2e-2);
    CHECK(eh <= 1.2 * kiln::test::rel_error(gh, head.ref_grads[0]) + 1e-3);
    CHECK(ew <= 1.2 * kiln::test::rel_error(gw, head.ref_grads[1]) + 1e-3);
  }
  const kiln::kernels::LmHeadSettingsScope on(true);
  torch::NoGradGuard no_grad;
  CHECK(torch::equal(token_logprobs(head.hidden, head.weight, head.targets, head.chunk), first));
}

TEST_CASE("CUDA bf16: a fused-head row whose target lies ~70 below its other logits is recomputed in the backward, its gradients the fp32 reference's") {
  if (kiln::test::skip_without_gpu()) return;
  const int64_t T = 300, D = 64, V = 1000;
  torch::manual_seed(8);
  const auto opts = torch::TensorOptions().device(torch::kCUDA);
  auto hidden = (torch::randn({T, D}, opts) * 0.5).to(torch::kBFloat16);
  auto weight = (torch::randn({V, D}, opts) * 0.5).to(torch::kBFloat16);
  auto targets = torch::randint(1, V, {T}, opts.dtype(torch::kInt64));
  // Row 7's target (token 0, no other row's): a logit of -70 where the others lie within ~[-8, 8]:
  // its probabilities against the target's reference (-54) pass the GEMM's clamp (2^64).
  targets[7] = 0;
  weight[0].copy_(hidden[7].to(torch::kFloat32) * (-70.0 / hidden[7].to(torch::kFloat32).square().sum().item<double>()));
  auto g = torch::randn({T}, opts);
  auto hr = hidden.to(torch::kFloat32).requires_grad_(), wr = weight.to(torch::kFloat32).requires_grad_();
  auto ref = torch::log_softmax(hr.mm(wr.t()), -1).gather(1, targets.unsqueeze(1)).squeeze(1);
  const auto ref_grads = torch::autograd::grad({(ref * g).sum()}, {hr, wr});
  CHECK(ref[7].item<double>() < -60);
  auto run = [&](bool fused, int64_t keep_bytes) {
    const kiln::kernels::LmHeadSettingsScope s(fused);
    auto h = hidden.clone().requires_grad_(), w = weight.clone().requires_grad_();
    auto lp = token_logprobs(h, w, targets, /*chunk=*/128, keep_bytes);
    auto grads = torch::autograd::grad({(lp * g).sum()}, {h, w});
    return std::make_tuple(lp, grads[0], grads[1]);
  };
  {
    const kiln::kernels::LmHeadSettingsScope on(true);
    if (kiln::test::skip_unless(kiln::kernels::lm_head_fused_available(hidden, weight),
                                "needs the fused head: a Hopper GPU and a build with CUTLASS"))
      return;
  }
  for (int64_t keep : {kKeepLogitsMaxBytes, int64_t(256 * V * 2)}) {  // all kept; 256 rows kept, 44 recomputed
    CAPTURE(keep);
    auto [flp, fgh, fgw] = run(true, keep);
    auto [lp, gh, gw] = run(false, keep);
    CHECK((flp - ref).abs().max().item<double>() <= 1e-3 * (1 + ref.abs().max().item<double>()));
    CHECK((flp - lp).abs().max().item<double>() <= 1e-4);
    CHECK(kiln::test::rel_error(fgh, ref_grads[0]) <= 2e-2);
    CHECK(kiln::test::rel_error(fgw, ref_grads[1]) <= 2e-2);
    CHECK(kiln::test::rel_error(fgh[7], ref_grads[0][7]) <= 2e-2);  // the recomputed row itself
    CHECK(kiln::test::rel_error(fgh, gh) <= 1e-2);
    CHECK(kiln::test::rel_error(fgw, gw) <= 1e-2);
  }
}

TEST_CASE("CUDA bf16: MLA's forward with the fused rope kernels gives the composite's bits, and gradients within bf16 steps") {
  if (kiln::test::skip_without_gpu()) return;
  torch::manual_seed(3);
  // GLM-4.7-Flash's attention widths, 4 documents of different lengths.
  auto c = glm4_moe_lite::flavors::glm47_flash().attention;
  MLA attn(MLAOptions{2048, c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
                      c.v_head_dim, c.rope_theta, c.rope_interleave, c.softmax_scale()});
  attn->to(torch::kCUDA, torch::kBFloat16);
  for (auto& p : attn->parameters()) p.data().normal_(0.0, 0.02).add_(p.dim() == 1 ? 1.0 : 0.0);
  const std::vector<int64_t> lens = {300, 17, 512, 171};
  std::vector<int64_t> pos, cu = {0};
  for (int64_t n : lens) {
    for (int64_t i = 0; i < n; ++i) pos.push_back(i);
    cu.push_back(cu.back() + n);
  }
  const int64_t T = cu.back();
  auto positions = torch::tensor(pos, torch::kInt64).to(torch::kCUDA);
  auto cu32 = torch::tensor(cu, torch::kInt64).to(torch::kCUDA, torch::kInt32);
  auto x = torch::randn({T, 2048}, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16));
  auto dy = torch::randn_like(x);
  auto run = [&](int64_t max_seqlen, int64_t position_bound) {  // 0, 0: the composite (per-call cos/sin, cat, narrow)
    attn->zero_grad();
    auto xi = x.clone().requires_grad_();
    auto y = attn(xi, positions, cu32, max_seqlen, position_bound);
    y.backward(dy);
    std::vector<torch::Tensor> grads{xi.grad()};
    for (auto& p : attn->parameters()) grads.push_back(p.grad().clone());
    return std::make_pair(y.detach(), grads);
  };
  REQUIRE(kiln::kernels::mla_rope_q_uses_kernel(
      torch::empty({T, c.num_heads, c.qk_head_dim()}, x.options()), c.qk_nope_head_dim));
  auto [y_fused, g_fused] = run(512, 0);
  auto [y_comp, g_comp] = run(0, 0);
  CHECK(torch::equal(y_fused, y_comp));
  {  // with the training fusions: q_b and kv_b inside the rope's functions (model/blocks/fusions.hpp)
    const bool before = set_training_fusions(true);
    auto [y_proj, g_proj] = run(512, 0);
    set_training_fusions(before);
    CHECK(torch::equal(y_proj, y_comp));
    REQUIRE(g_proj.size() == g_comp.size());
    for (std::size_t i = 0; i < g_proj.size(); ++i) {
      INFO("gradient " << i << " with the fusions");
      CHECK(kiln::test::rel_error(g_proj[i], g_comp[i]) <= 1e-2);
    }
  }
  // A continued sequence: positions past its length, the table sized by position_bound.
  positions = positions + 3000;
  CHECK(torch::equal(run(512, 3512).first, run(0, 0).first));
  REQUIRE(g_fused.size() == g_comp.size());
  for (std::size_t i = 0; i < g_fused.size(); ++i) {
    INFO("gradient " << i);
    CHECK(kiln::test::rel_error(g_fused[i], g_comp[i]) <= 1e-2);
  }
}

TEST_CASE("a packed batch's positions: a negative one or one past max_position_embeddings is refused by name, one past its document still runs") {
  glm4_moe_lite::Glm4MoeLiteModel model(glm4_moe_lite::flavors::debug());
  auto batch = PackedBatch::from_documents({{1, 2, 3}, {4, 5}});
  batch.position_ids = torch::tensor({0, 1, 2, 0, -1}, torch::kInt64);
  CHECK_THROWS_WITH_AS(model.forward(batch), doctest::Contains("position_ids must be >= 0, got -1"),
                       std::invalid_argument);
  const int64_t max_pos = glm4_moe_lite::flavors::debug().max_position_embeddings;
  batch.position_ids = torch::tensor(std::vector<int64_t>{0, 1, max_pos, 0, 1}, torch::kInt64);
  CHECK_THROWS_WITH_AS(model.forward(batch), doctest::Contains("position_ids must be < max_position_embeddings"),
                       std::invalid_argument);
  // Numbered past the longest document (a continued sequence; on CUDA the rope's table is sized
  // by the largest position, the CUDA MLA case below compares it with the composite).
  batch.position_ids = torch::tensor({7, 8, 9, 0, 1}, torch::kInt64);
  auto out = model.forward(batch);
  CHECK(out.hidden.sizes() == torch::IntArrayRef({5, glm4_moe_lite::flavors::debug().hidden_size}));
  CHECK(torch::isfinite(out.hidden).all().item<bool>());
}

TEST_CASE("CUDA bf16: the dispatch's backward (the combine kernel with unit weights) sums a token's K row gradients") {
  if (kiln::test::skip_without_gpu()) return;
  torch::manual_seed(4);
  const int64_t T = 333, D = 2048, E = 64, K = 4;
  auto opt = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  auto x = torch::randn({T, D}, opt).requires_grad_();
  RouteResult r{torch::randint(0, E, {T, K}, opt.dtype(torch::kInt64)), torch::rand({T, K}, opt.dtype(torch::kFloat32))};
  auto d = dispatch(x, r, E);
  auto g = torch::randn({T * K, D}, opt);
  (d.x.to(torch::kFloat32) * g.to(torch::kFloat32)).sum().backward();
  // Reference: each row's gradient added into its token in fp32, rounded once.
  auto want = torch::zeros({T, D}, opt.dtype(torch::kFloat32)).index_add_(0, d.token_index, g.to(torch::kFloat32));
  CHECK(torch::equal(d.x.detach(), x.detach().index_select(0, d.token_index)));
  CHECK(kiln::test::rel_error(x.grad(), want) <= 4e-3);  // one bf16 rounding of each sum
}

TEST_CASE("the glm47_flash flavor has GLM-4.7-Flash's published dimensions") {
  auto c = glm4_moe_lite::flavors::glm47_flash();
  CHECK(c.attention.q_lora_rank.value() == 768);
  CHECK(c.attention.kv_lora_rank == 512);
  CHECK(c.attention.qk_nope_head_dim == 192);
  CHECK(c.attention.qk_rope_head_dim == 64);
  CHECK(c.attention.v_head_dim == 256);
  CHECK(c.attention.num_heads == 20);
  CHECK(c.hidden_size == 2048);
  CHECK(c.moe.num_experts == 64);
  CHECK(c.moe.top_k == 4);
  CHECK(c.moe.routed_scaling_factor == 1.8);
  CHECK(c.moe.n_shared_experts == 1);
  CHECK(c.moe.n_group == 1);
  CHECK(c.moe.norm_topk_prob);
  CHECK(c.intermediate_size == 10240);
  CHECK(c.moe.expert_intermediate_size == 1536);
  CHECK(c.attention.rope_theta == 1e6);
  CHECK(c.attention.rope_interleave);
  CHECK(c.num_hidden_layers == 47);
  CHECK(c.moe_layers[0] == false);
  CHECK(c.num_moe_layers() == 46);
  CHECK(c.vocab_size == 154880);
  CHECK(c.rms_norm_eps == 1e-5);
  CHECK_FALSE(c.tie_word_embeddings);
  CHECK(c.max_position_embeddings == 202752);
  // And the config.json it writes parses back to the same thing.
  auto back = Glm4MoeLiteConfig::from_hf_json(c.to_hf_json(), "round trip");
  CHECK(back.to_hf_json() == c.to_hf_json());
}

TEST_CASE("config.json: unknown fields and contradictory values are rejected by name") {
  auto j = glm4_moe_lite::flavors::debug().to_hf_json();
  SUBCASE("unknown field") {
    j["hidden_sise"] = 64;
    CHECK_THROWS_WITH_AS(Glm4MoeLiteConfig::from_hf_json(j, "c.json"), doctest::Contains("'hidden_sise'"),
                         std::invalid_argument);
  }
  SUBCASE("qk_head_dim that is not nope + rope") {
    j["qk_head_dim"] = 99;
    CHECK_THROWS_WITH_AS(Glm4MoeLiteConfig::from_hf_json(j, "c.json"), doctest::Contains("'qk_head_dim'"),
                         std::invalid_argument);
  }
  SUBCASE("key-value heads differ from attention heads") {
    j["num_key_value_heads"] = 2;
    CHECK_THROWS_WITH_AS(Glm4MoeLiteConfig::from_hf_json(j, "c.json"), doctest::Contains("'num_key_value_heads'"),
                         std::invalid_argument);
  }
  SUBCASE("mlp_layer_types of the wrong length") {
    j["mlp_layer_types"] = {"dense", "sparse"};
    CHECK_THROWS_WITH_AS(Glm4MoeLiteConfig::from_hf_json(j, "c.json"), doctest::Contains("'mlp_layer_types'"),
                         std::invalid_argument);
  }
  SUBCASE("a wrong type") {
    j["hidden_size"] = "sixty-four";
    CHECK_THROWS_WITH_AS(Glm4MoeLiteConfig::from_hf_json(j, "c.json"), doctest::Contains("'hidden_size': must be an integer"),
                         std::invalid_argument);
  }
  SUBCASE("another architecture") {
    j["architectures"] = {"LlamaForCausalLM"};
    CHECK_THROWS_WITH_AS(Glm4MoeLiteConfig::from_hf_json(j, "c.json"), doctest::Contains("'architectures'"),
                         std::invalid_argument);
  }
  SUBCASE("topk_group larger than n_group") {
    j["topk_group"] = 3;
    CHECK_THROWS_WITH_AS(Glm4MoeLiteConfig::from_hf_json(j, "c.json"), doctest::Contains("'topk_group'"),
                         std::invalid_argument);
  }
  SUBCASE("q_lora_rank null builds the direct q projection") {
    j["q_lora_rank"] = nullptr;
    auto c = Glm4MoeLiteConfig::from_hf_json(j, "c.json");
    CHECK_FALSE(c.attention.q_lora_rank.has_value());
    glm4_moe_lite::Glm4MoeLiteModel m(c);
    CHECK(m.named_parameters().contains("layers.0.attn.q.weight"));
    CHECK_FALSE(m.named_parameters().contains("layers.0.attn.q_a.weight"));
    auto out = m.forward(PackedBatch::from_documents({{1, 2, 3}}));
    CHECK((out.hidden.sizes() == torch::IntArrayRef({3, 64})));
  }
}

TEST_CASE("a tied-embeddings config built in code is refused by the model, not silently untied") {
  auto c = glm4_moe_lite::flavors::debug();
  c.tie_word_embeddings = true;
  CHECK_THROWS_WITH_AS(glm4_moe_lite::Glm4MoeLiteModel{c}, doctest::Contains("field 'tie_word_embeddings'"),
                       std::invalid_argument);
}

TEST_CASE("chunked entropy equals the full-softmax entropy, values and gradients") {
  torch::manual_seed(3);
  auto hidden = torch::randn({9, 12}, torch::requires_grad());
  auto weight = torch::randn({40, 12}, torch::requires_grad());
  auto targets = torch::randint(0, 40, {9}, torch::kInt64);
  targets[2] = -1;
  auto g1 = torch::randn({9}), g2 = torch::randn({9});
  auto logp = torch::log_softmax(hidden.mm(weight.t()), -1);
  auto ref_lp = logp.gather(1, targets.clamp_min(0).unsqueeze(1)).squeeze(1) * (targets >= 0);
  auto ref_h = -(logp.exp() * logp).sum(-1);
  auto ref_grads = torch::autograd::grad({(ref_lp * g1).sum() + (ref_h * g2).sum()}, {hidden, weight});
  for (int64_t chunk : {1, 4, 100}) {
    CAPTURE(chunk);
    auto [lp, h] = token_logprobs_and_entropy(hidden, weight, targets, chunk);
    CHECK((lp - ref_lp).abs().max().item<double>() <= 1e-5);
    CHECK((h - ref_h).abs().max().item<double>() <= 1e-5);
    auto grads = torch::autograd::grad({(lp * g1).sum() + (h * g2).sum()}, {hidden, weight});
    CHECK((grads[0] - ref_grads[0]).abs().max().item<double>() <= 1e-4);
    CHECK((grads[1] - ref_grads[1]).abs().max().item<double>() <= 1e-4);
  }
}

TEST_CASE("recompute in backward: a MoE layer (routed and shared experts) gives the same forward and gradients to rounding with it on and off, in fp32 and bf16") {
  const bool initial = recompute_in_backward();  // KILN_RECOMPUTE_IN_BACKWARD's, or on
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    CAPTURE(dtype);
    torch::manual_seed(51);
    RouterOptions ro{16, 6, 2, 1, 1, true, 1.5};
    MoE moe(ro, 8, 1);
    for (auto& p : moe->parameters()) {
      torch::NoGradGuard ng;
      p.normal_(0, 0.3);
    }
    moe->to(dtype);
    auto x = torch::randn({13, 16}).to(dtype);
    std::vector<torch::Tensor> out, grads;
    for (bool on : {true, false}) {
      const bool before = set_recompute_in_backward(on);
      auto xi = x.clone().requires_grad_();
      torch::Tensor ids;
      auto y = moe(xi, std::nullopt, &ids);
      set_recompute_in_backward(before);
      auto dy = torch::ones_like(y).mul_(0.5).add_(torch::arange(y.numel()).view(y.sizes()).remainder(7).to(dtype) * 0.1);
      std::vector<torch::Tensor> in{xi};
      for (auto& p : moe->parameters())
        if (p.requires_grad()) in.push_back(p);
      auto g = torch::autograd::grad({(y.to(torch::kFloat32) * dy.to(torch::kFloat32)).sum()}, in);
      out.push_back(y.detach());
      grads.insert(grads.end(), g.begin(), g.end());
    }
    CHECK(torch::equal(out[0], out[1]));  // the same forward, bit for bit
    const size_t n = grads.size() / 2;
    const double tol = dtype == torch::kFloat32 ? 1e-5 : 2e-2;
    for (size_t i = 0; i < n; ++i) {
      CAPTURE(i);
      const auto a = grads[i].to(torch::kFloat64), b = grads[n + i].to(torch::kFloat64);
      CHECK(((a - b).norm() / b.norm().clamp_min(1e-30)).item<double>() <= tol);
    }
  }
  CHECK(recompute_in_backward() == initial);  // restored
}

TEST_CASE("CUDA bf16: the shared-expert overlap (a second stream) gives a MoE layer's forward and parameter gradients bit for bit, its input gradient to rounding, plainly and checkpointed") {
  if (kiln::test::skip_without_gpu()) return;
  const bool initial = shared_expert_overlap();  // KILN_SHARED_EXPERT_OVERLAP's, or on
  torch::manual_seed(52);
  const int64_t T = 2048, D = 1024, E = 16, K = 4, F = 512;
  RouterOptions ro{D, E, K, 1, 1, true, 2.5};
  MoE moe(ro, F, 1);
  for (auto& p : moe->parameters()) {
    torch::NoGradGuard ng;
    p.normal_(0, 0.03);
  }
  moe->to(torch::kCUDA, torch::kBFloat16);
  auto x = torch::randn({T, D}, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16));
  auto dy = torch::randn({T, D}, x.options());
  auto run = [&](bool overlap, bool checkpoint) {
    const bool before = set_shared_expert_overlap(overlap);
    auto xi = x.clone().requires_grad_();
    torch::Tensor ids;
    auto f = [&](const torch::Tensor& in) { return moe(in, std::nullopt, &ids); };
    moe->zero_grad();
    auto y = checkpoint ? checkpointed(f, xi) : f(xi);
    // backward(), not autograd::grad: the checkpoint accumulates its parameters' gradients.
    (y.to(torch::kFloat32) * dy.to(torch::kFloat32)).sum().backward();
    set_shared_expert_overlap(before);
    std::vector<torch::Tensor> g{y.detach(), xi.grad()};
    for (auto& p : moe->parameters())
      if (p.requires_grad()) g.push_back(p.grad().clone());
    g.push_back(ids);
    return g;
  };
  for (bool checkpoint : {false, true}) {
    CAPTURE(checkpoint);
    const auto plain = run(false, checkpoint), beside = run(true, checkpoint), again = run(true, checkpoint);
    REQUIRE(plain.size() == beside.size());
    for (std::size_t i = 0; i < plain.size(); ++i) {
      CAPTURE(i);  // 0: the output; 1: x's gradient; then the parameters' gradients; last: the expert ids
      CHECK(torch::equal(again[i], beside[i]));  // the same bits on every run
      // x's gradient sums three parts (shared experts, routed experts, router) in bf16, in the
      // backward's order, which follows the forward's: with the overlap the shared experts are
      // queued first, so their part is added last. Everything else is the same bits.
      if (i == 1) CHECK(kiln::test::rel_error(beside[i], plain[i]) <= 1e-2);
      else CHECK(torch::equal(beside[i], plain[i]));
    }
  }
  CHECK(shared_expert_overlap() == initial);  // restored
}

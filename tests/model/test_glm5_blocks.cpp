// GLM-5.3-Flash's other blocks: clamped SwiGLU (dense MLP and experts), manifold-constrained
// hyper-connections with Sinkhorn normalisation, FP8 block dequantisation; hand-worked cases
// and the transformers fixture.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <cmath>
#include <vector>

#include "glm5_fixture.hpp"
#include "kernels/moe.hpp"
#include "model/blocks/moe.hpp"
#include "model/blocks/recompute.hpp"
#include "model/fp8_blocks.hpp"
#include "model/glm5_next/hyper_connection.hpp"

using namespace kiln::model;
using namespace kiln::model::glm5_next;
using kiln::test::glm5::expected;
using kiln::test::glm5::max_diff;
using kiln::test::glm5::weight;

namespace {
// |a - b| relative to the largest |b|.
double rel_diff(const torch::Tensor& a, const torch::Tensor& b) { return max_diff(a, b) / b.abs().max().item<double>(); }

void load(torch::Tensor mine, const torch::Tensor& hf) {
  REQUIRE(mine.sizes() == hf.sizes());
  torch::NoGradGuard ng;
  mine.copy_(hf);
}
}  // namespace

TEST_CASE("swiglu: the clamp at the limit (hand-worked, limit 10)") {
  auto gate = torch::tensor({20.0, 1.0, -30.0, 10.0}, torch::kDouble).requires_grad_(true);
  auto up = torch::tensor({20.0, -20.0, 0.5, -10.0}, torch::kDouble).requires_grad_(true);
  auto y = kiln::kernels::swiglu(gate, up, 10.0);
  // gate clamped to <= 10, up to [-10, 10]: silu(10)*10, silu(1)*-10, silu(-30)*0.5, silu(10)*-10,
  // with silu(x) = x / (1 + e^-x): silu(10) = 9.99954602, silu(1) = 0.73105858, silu(-30) = -2.8073e-12.
  const double silu10 = 10.0 / (1.0 + std::exp(-10.0)), silu1 = 1.0 / (1.0 + std::exp(-1.0));
  CHECK(y[0].item<double>() == doctest::Approx(99.9954602131).epsilon(1e-10));
  CHECK(y[0].item<double>() == doctest::Approx(silu10 * 10).epsilon(1e-12));
  CHECK(y[1].item<double>() == doctest::Approx(-7.3105857863).epsilon(1e-10));
  CHECK(y[1].item<double>() == doctest::Approx(silu1 * -10).epsilon(1e-12));
  CHECK(y[2].item<double>() == doctest::Approx(-1.40364e-12).epsilon(1e-4));
  CHECK(y[3].item<double>() == doctest::Approx(-99.9954602131).epsilon(1e-10));
  // No gradient through a clamped entry: gate 20 (> 10); up 20 and -20 (outside [-10, 10]).
  y.sum().backward();
  CHECK(gate.grad()[0].item<double>() == 0.0);
  CHECK(gate.grad()[1].item<double>() != 0.0);
  CHECK(up.grad()[0].item<double>() == 0.0);
  CHECK(up.grad()[1].item<double>() == 0.0);
  CHECK(up.grad()[2].item<double>() != 0.0);
  // Without a limit: plain SwiGLU, silu(20) * 20.
  CHECK(kiln::kernels::swiglu(gate, up)[0].item<double>() == doctest::Approx(20.0 / (1.0 + std::exp(-20.0)) * 20.0));
}

TEST_CASE("SwiGLU in training (its activation recomputed in the backward): autograd's values and gradients, clamped too") {
  torch::manual_seed(41);
  struct On {  // the recompute on whatever KILN_RECOMPUTE_IN_BACKWARD says, restored after
    bool before = kiln::model::set_recompute_in_backward(true);
    ~On() { kiln::model::set_recompute_in_backward(before); }
  } on;
  for (std::optional<double> limit : {std::optional<double>(), std::optional<double>(0.3)}) {
    SwiGLU mlp(16, 24, limit);
    for (auto* w : {&mlp->gate->weight, &mlp->up->weight, &mlp->down->weight}) {
      torch::NoGradGuard ng;
      w->normal_(0, 0.3);
    }
    auto x = torch::randn({9, 16}).requires_grad_();
    auto y = mlp(x);
    // the training path's function made it (y is its [T, D] output viewed)
    const auto edges = y.grad_fn()->next_edges();
    REQUIRE(!edges.empty());
    CHECK(edges[0].function->name().find("SwigluDown") != std::string::npos);
    auto ref = torch::nn::functional::linear(
        kiln::kernels::swiglu(torch::nn::functional::linear(x, mlp->gate->weight),
                              torch::nn::functional::linear(x, mlp->up->weight), limit),
        mlp->down->weight);
    INFO("limit " << (limit ? *limit : 0.0));
    CHECK(torch::allclose(y, ref, 1e-6, 1e-6));
    auto dy = torch::randn({9, 16});
    std::vector<torch::Tensor> in{x, mlp->gate->weight, mlp->up->weight, mlp->down->weight};
    auto g = torch::autograd::grad({(y * dy).sum()}, in), gr = torch::autograd::grad({(ref * dy).sum()}, in);
    for (size_t i = 0; i < in.size(); ++i) CHECK(torch::allclose(g[i], gr[i], 1e-5, 1e-6));
  }
}

TEST_CASE("swiglu: the clamped dense MLP and MoE (routed and shared experts) match transformers' on the fixture") {
  auto cfg = flavors::debug();
  torch::NoGradGuard ng;
  SwiGLU mlp(cfg.hidden_size, cfg.intermediate_size, cfg.swiglu_limit);
  load(mlp->gate->weight, weight("layers.0.mlp.gate_proj.weight"));
  load(mlp->up->weight, weight("layers.0.mlp.up_proj.weight"));
  load(mlp->down->weight, weight("layers.0.mlp.down_proj.weight"));
  const double d_mlp = rel_diff(mlp(expected("mlp.0.in")), expected("mlp.0.out"));
  MESSAGE("dense MLP: max |kiln - transformers| / max |transformers| = " << d_mlp);
  CHECK(d_mlp < 1e-5);
  // The same weights without the clamp give another answer: the clamp bites on this input.
  SwiGLU plain(cfg.hidden_size, cfg.intermediate_size);
  load(plain->gate->weight, mlp->gate->weight);
  load(plain->up->weight, mlp->up->weight);
  load(plain->down->weight, mlp->down->weight);
  CHECK(rel_diff(plain(expected("mlp.0.in")), expected("mlp.0.out")) > 1e-2);

  // MoE layers 1..3: router, 8 experts (HF stores them one by one: fused here as gate rows
  // then up rows), one shared expert; all clamped.
  RouterOptions ro{cfg.hidden_size, cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.n_group, cfg.moe.topk_group,
                   cfg.moe.norm_topk_prob, cfg.moe.routed_scaling_factor};
  auto routed = expected("routed_experts");  // [T, 3, K] sorted per token
  for (int layer : {1, 2, 3}) {
    CAPTURE(layer);
    MoE moe(ro, cfg.moe.expert_intermediate_size, cfg.moe.n_shared_experts, ExpertSlice{}, cfg.swiglu_limit);
    const std::string p = "layers." + std::to_string(layer) + ".mlp.";
    load(moe->router->weight, weight(p + "gate.weight"));
    load(moe->router->e_score_correction_bias, weight(p + "gate.e_score_correction_bias"));
    for (int64_t e = 0; e < cfg.moe.num_experts; ++e) {
      const std::string x = p + "experts." + std::to_string(e) + ".";
      load(moe->experts->w_gate_up_EFD[e], torch::cat({weight(x + "gate_proj.weight"), weight(x + "up_proj.weight")}));
      load(moe->experts->w_down_EDF[e], weight(x + "down_proj.weight"));
    }
    load(moe->shared->gate->weight, weight(p + "shared_experts.gate_proj.weight"));
    load(moe->shared->up->weight, weight(p + "shared_experts.up_proj.weight"));
    load(moe->shared->down->weight, weight(p + "shared_experts.down_proj.weight"));
    torch::Tensor ids;
    auto y = moe(expected("mlp." + std::to_string(layer) + ".in"), std::nullopt, &ids);
    const double d = rel_diff(y, expected("mlp." + std::to_string(layer) + ".out"));
    MESSAGE("MoE layer " << layer << ": max |kiln - transformers| / max |transformers| = " << d);
    CHECK(d < 1e-5);
    CHECK(torch::equal(std::get<0>(ids.sort(-1)), routed.select(1, layer - 1)));
  }
}

TEST_CASE("sinkhorn: the combination matrices' rows and columns sum to 1 and every entry is positive") {
  torch::manual_seed(4);
  // Logits of unit scale (mHC's at init are smaller); very peaked ones need more than 20 steps
  // for the rows, in transformers as here.
  auto logits = torch::randn({50, 4, 4});
  auto m = sinkhorn(logits, 20, 1e-6);
  CHECK((m > 0).all().item<bool>());
  CHECK(max_diff(m.sum(-2), torch::ones({50, 4})) < 1e-5);  // the last step normalises columns
  CHECK(max_diff(m.sum(-1), torch::ones({50, 4})) < 1e-5);  // rows: converged after 20 steps
  // One step is a column normalisation of the softmax only: rows do not sum to 1 yet.
  auto one = sinkhorn(logits, 1, 1e-6);
  CHECK(max_diff(one.sum(-2), torch::ones({50, 4})) < 1e-5);
  CHECK(max_diff(one.sum(-1), torch::ones({50, 4})) > 1e-2);
  CHECK_THROWS_AS(sinkhorn(logits, 0, 1e-6), std::invalid_argument);
}

TEST_CASE("mHC: the hyper-connections of every layer match transformers' Glm5NextTextHyperConnection on the fixture") {
  auto cfg = flavors::debug();
  torch::NoGradGuard ng;
  for (int layer = 0; layer < 4; ++layer) {
    CAPTURE(layer);
    HyperConnection hc(cfg.hidden_size, cfg.hc, cfg.rms_norm_eps);
    const std::string p = "layers." + std::to_string(layer) + ".hc_attn_";
    load(hc->fn, weight(p + "fn"));
    load(hc->base, weight(p + "base"));
    load(hc->scale, weight(p + "scale"));
    const std::string e = "attn_hc." + std::to_string(layer) + ".";
    auto w = hc(expected(e + "in"));
    const double dp = rel_diff(w.post, expected(e + "post")), dc = rel_diff(w.comb, expected(e + "comb")),
                 dx = rel_diff(w.collapsed, expected(e + "collapsed"));
    MESSAGE("layer " << layer << ": relative diffs post " << dp << ", comb " << dc << ", collapsed " << dx);
    CHECK(dp < 1e-5);
    CHECK(dc < 1e-5);
    CHECK(dx < 1e-5);
  }
  // Expansion: layer 0's attention site around its KDA block gives the streams its MLP site
  // collapses (checked through the MLP's normed input); the MLP site around the MLP gives the
  // streams layer 1 receives.
  HyperConnection attn(cfg.hidden_size, cfg.hc, cfg.rms_norm_eps), ffn(cfg.hidden_size, cfg.hc, cfg.rms_norm_eps);
  for (auto [m, site] : {std::pair{attn, std::string("attn")}, std::pair{ffn, std::string("ffn")}}) {
    load(m->fn, weight("layers.0.hc_" + site + "_fn"));
    load(m->base, weight("layers.0.hc_" + site + "_base"));
    load(m->scale, weight("layers.0.hc_" + site + "_scale"));
  }
  auto s0 = expected("attn_hc.0.in");
  auto mid = HyperConnectionImpl::expand(attn(s0), expected("kda.0.out"), s0);  // [T, S, D]
  auto w = ffn(mid);
  RMSNorm post_norm(cfg.hidden_size, cfg.rms_norm_eps);
  load(post_norm->weight, weight("layers.0.post_attention_layernorm.weight"));
  CHECK(rel_diff(post_norm(w.collapsed), expected("mlp.0.in")) < 1e-5);
  auto s1 = HyperConnectionImpl::expand(w, expected("mlp.0.out"), mid);
  const double d = rel_diff(s1, expected("attn_hc.1.in"));
  MESSAGE("streams after layer 0: relative diff " << d);
  CHECK(d < 1e-5);
  CHECK(max_diff(hc_head(hc_streams_from_embeddings(expected("mlp.0.in"), 4)), expected("mlp.0.in")) == 0);
}

TEST_CASE("mHC: gradients reach fn, base, scale and the streams (fp64 finite differences)") {
  torch::manual_seed(5);
  HyperConnection hc(6, HyperConnectionConfig{3, 1e-6, 20}, 1e-5);
  hc->to(torch::kDouble);
  {
    torch::NoGradGuard ng;
    for (auto& p : hc->parameters()) p.add_(0.3 * torch::randn_like(p));
  }
  auto streams = torch::randn({5, 3, 6}, torch::kDouble).requires_grad_(true);
  auto block = torch::randn({5, 6}, torch::kDouble);
  auto r = torch::randn({5, 3, 6}, torch::kDouble), rc = torch::randn({5, 6}, torch::kDouble);
  auto loss_of = [&] {
    auto w = hc(streams);
    return (HyperConnectionImpl::expand(w, block, streams) * r).sum() + (w.collapsed * rc).sum();
  };
  loss_of().backward();
  kiln::test::glm5::check_finite_differences(
      loss_of, {{"streams", streams}, {"fn", hc->fn}, {"base", hc->base}, {"scale", hc->scale}});
}

TEST_CASE("fp8: a 130x130 e4m3 weight with 2x2 block scales dequantises with its edge blocks cropped (hand-computed)") {
  // w[r, c] = 1.5 where r + c is even, -0.25 where odd (both exact in e4m3); block 128x128 gives
  // a 2x2 scale grid whose second row and column cover only rows / columns 128 and 129.
  auto idx = torch::arange(130);
  auto even = ((idx.view({130, 1}) + idx.view({1, 130})) % 2 == 0);
  auto w = torch::where(even, torch::full({}, 1.5), torch::full({}, -0.25)).to(torch::kFloat8_e4m3fn);
  auto scale = torch::tensor({{2.0f, 3.0f}, {5.0f, 0.5f}});
  auto d = dequantize_fp8_blocks(w, scale, 128, 128);
  CHECK((d.scalar_type() == torch::kBFloat16));
  CHECK(d.sizes() == torch::IntArrayRef({130, 130}));
  auto at = [&](int64_t r, int64_t c) { return d[r][c].item<float>(); };
  CHECK(at(0, 0) == 3.0f);        // 1.5 * 2
  CHECK(at(0, 1) == -0.5f);       // -0.25 * 2
  CHECK(at(127, 127) == 3.0f);    // last entry of block (0, 0)
  CHECK(at(127, 128) == -0.75f);  // -0.25 * 3, block (0, 1)
  CHECK(at(0, 129) == -0.75f);
  CHECK(at(128, 127) == -1.25f);  // -0.25 * 5, block (1, 0)
  CHECK(at(128, 128) == 0.75f);   // 1.5 * 0.5, block (1, 1): 2x2 of the 128x128
  CHECK(at(129, 128) == -0.125f);
  CHECK(at(129, 129) == 0.75f);
  // Sum, block by block: each full 128x128 block holds 8192 of each value; the 128x2 and 2x128
  // edge blocks 128 of each; the 2x2 corner 2 of each. (1.5 - 0.25) = 1.25 per pair.
  const double expect = 8192 * 1.25 * 2 + 128 * 1.25 * 3 + 128 * 1.25 * 5 + 2 * 1.25 * 0.5;
  CHECK(d.to(torch::kDouble).sum().item<double>() == doctest::Approx(expect).epsilon(1e-12));
  CHECK_THROWS_WITH_AS(dequantize_fp8_blocks(w, torch::ones({1, 2}), 128, 128),
                       doctest::Contains("scale_inv must be [2, 2] for this weight and block"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(dequantize_fp8_blocks(w.to(torch::kFloat), scale, 128, 128),
                       doctest::Contains("the weight must be 2-D float8_e4m3fn"), std::invalid_argument);
  // fp32 out keeps fp8 * scale exactly.
  CHECK(dequantize_fp8_blocks(w, scale, 128, 128, torch::kFloat)[129][0].item<float>() == -1.25f);
}

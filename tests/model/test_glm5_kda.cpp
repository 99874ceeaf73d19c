// Kimi Delta Attention (model/glm5_next/kda.hpp): the chunked and recurrent forms agree,
// packed documents do not leak, gradients match finite differences, and the layer matches
// transformers' Glm5NextTextLinearAttention on the fixture.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <vector>

#include "glm5_fixture.hpp"
#include "model/glm5_next/kda.hpp"

using namespace kiln::model::glm5_next;
using kiln::test::glm5::max_diff;

namespace {
struct Inputs {
  torch::Tensor q, k, v, g, beta, s0;
};

// Random inputs as the layer makes them: unit-norm q and k, g in (-5, 0), beta in (0, 1).
Inputs random_inputs(int64_t B, int64_t L, int64_t H, int64_t K, torch::Dtype dt) {
  auto o = torch::TensorOptions().dtype(dt);
  return {l2_normalize(torch::randn({B, L, H, K}, o)), l2_normalize(torch::randn({B, L, H, K}, o)),
          torch::randn({B, L, H, K}, o), -5.0 * torch::sigmoid(torch::randn({B, L, H, K}, o) - 1.0),
          torch::sigmoid(torch::randn({B, L, H}, o)), torch::randn({B, H, K, K}, o)};
}

// A small layer with every parameter moved off its init (non-zero gates, norm, A_log).
KimiDeltaAttention small_layer(int64_t D, KdaConfig c, int64_t chunk, torch::Dtype dt) {
  KimiDeltaAttention m(D, c, 1e-5, chunk);
  torch::NoGradGuard ng;
  for (auto& p : m->parameters()) p.add_(0.3 * torch::randn_like(p));
  m->to(dt);
  return m;
}

torch::Tensor cu(std::vector<int64_t> lengths) {
  std::vector<int64_t> c{0};
  for (auto n : lengths) c.push_back(c.back() + n);
  return torch::tensor(c, torch::kInt64);
}
}  // namespace

TEST_CASE("kda: the chunked form equals the recurrent form (fp32 within 1e-5) across chunk sizes and with an initial state") {
  torch::manual_seed(0);
  // 45 tokens: several chunks of 16 and 32, and 64-token chunks of 4 sub-blocks, one padded.
  auto in = random_inputs(2, 45, 3, 8, torch::kFloat);
  auto ref = kda_recurrent(in.q, in.k, in.v, in.g, in.beta, in.s0);
  for (int64_t chunk : {1, 4, 5, 13, 16, 32, 64}) {
    CAPTURE(chunk);
    auto c = kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.s0, chunk);
    CHECK((c.out.scalar_type() == torch::kFloat));
    CHECK(max_diff(c.out, ref.out) < 1e-5);
    CHECK(max_diff(c.state, ref.state) < 1e-5);
  }
  // Padding steps (g = 0, beta = 0) leave the state unchanged.
  auto pad = [](const torch::Tensor& t) { return torch::cat({t, torch::zeros_like(t.narrow(1, 0, 3))}, 1); };
  auto padded = kda_chunked(pad(in.q), pad(in.k), pad(in.v), pad(in.g), pad(in.beta), in.s0, 4);
  CHECK(max_diff(padded.state, ref.state) < 1e-5);
  // bf16 inputs: the math still runs in fp32.
  auto b = kda_chunked(in.q.to(torch::kBFloat16), in.k.to(torch::kBFloat16), in.v.to(torch::kBFloat16), in.g, in.beta,
                       std::nullopt, 4);
  CHECK((b.out.scalar_type() == torch::kFloat));
}

TEST_CASE("kda layer: prefill then token-by-token decode equals the packed forward (fp32 within 1e-5)") {
  torch::manual_seed(1);
  auto m = small_layer(16, KdaConfig{2, 8, 4, -5.0}, 4, torch::kFloat);
  torch::NoGradGuard ng;
  const std::vector<int64_t> lengths{7, 2, 11};
  auto x = torch::randn({20, 16});
  auto y = m->forward(x, cu(lengths));
  // Each sequence: prefill its first `p` tokens (p = 0: an empty state), decode the rest.
  int64_t start = 0;
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    for (int64_t p : {int64_t(0), std::min<int64_t>(3, lengths[b] - 1)}) {
      CAPTURE(b);
      CAPTURE(p);
      KdaState s = m->empty_state(1, torch::kFloat, torch::kCPU);
      std::vector<torch::Tensor> rows;
      if (p > 0) {
        auto pre = m->prefill(x.narrow(0, start, p), cu({p}));
        rows.push_back(pre.first);
        s = pre.second;
      }
      for (int64_t t = p; t < lengths[b]; ++t) rows.push_back(m->decode_step(x.narrow(0, start + t, 1), s));
      CHECK(max_diff(torch::cat(rows), y.narrow(0, start, lengths[b])) < 1e-5);
    }
    start += lengths[b];
  }
  // The prefill of all three at once hands each its own state: decoding one more token per
  // sequence from it equals the forward over the documents extended by that token.
  auto pre = m->prefill(x.narrow(0, 0, 20), cu(lengths));
  auto next = torch::randn({3, 16});
  auto stepped = m->decode_step(next, pre.second);
  std::vector<torch::Tensor> ext;
  start = 0;
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    ext.push_back(x.narrow(0, start, lengths[b]));
    ext.push_back(next.narrow(0, int64_t(b), 1));
    start += lengths[b];
  }
  auto full = m->forward(torch::cat(ext), cu({8, 3, 12}));
  CHECK(max_diff(stepped.select(0, 0), full[7]) < 1e-5);
  CHECK(max_diff(stepped.select(0, 1), full[10]) < 1e-5);
  CHECK(max_diff(stepped.select(0, 2), full[22]) < 1e-5);
}

TEST_CASE("kda layer: a 2-document pack equals each document run alone (neither conv window nor state crosses)") {
  torch::manual_seed(2);
  auto m = small_layer(16, KdaConfig{2, 8, 4, -5.0}, 4, torch::kFloat);
  torch::NoGradGuard ng;
  auto a = torch::randn({9, 16}), b = torch::randn({6, 16});
  auto packed = m->forward(torch::cat({a, b}), cu({9, 6}));
  CHECK(max_diff(packed.narrow(0, 0, 9), m->forward(a, cu({9}))) < 1e-6);
  CHECK(max_diff(packed.narrow(0, 9, 6), m->forward(b, cu({6}))) < 1e-6);
  // and the second document is not the continuation of the first
  CHECK(max_diff(packed.narrow(0, 9, 6), m->forward(torch::cat({a, b}), cu({15})).narrow(0, 9, 6)) > 1e-3);
  CHECK_THROWS_AS(m->forward(a, torch::tensor({0, 5, 5, 9}, torch::kInt64)), std::invalid_argument);
}

TEST_CASE("kda layer: gradients of parameters and input match finite differences (fp64, both gate forms)") {
  torch::manual_seed(3);
  for (bool bounded : {true, false}) {
    CAPTURE(bounded);
    // chunk 32 (two sub-blocks of 16) over documents of 5 and 37 tokens: both intra-chunk
    // forms, several chunks, padding.
    KdaConfig c{2, 4, 3, bounded ? std::optional<double>(-5.0) : std::nullopt};
    auto m = small_layer(6, c, 32, torch::kDouble);
    auto x = torch::randn({42, 6}, torch::kDouble).requires_grad_(true);
    auto lengths = cu({5, 37});
    auto r = torch::randn({42, 6}, torch::kDouble);
    auto loss_of = [&] { return (m->forward(x, lengths) * r).sum(); };
    loss_of().backward();
    kiln::test::glm5::check_finite_differences(
        loss_of, {{"x", x}, {"q_proj", m->q_proj->weight}, {"k_conv", m->k_conv}, {"v_proj", m->v_proj->weight},
                  {"A_log", m->A_log}, {"dt_bias", m->dt_bias}, {"f_b_proj", m->f_b_proj->weight},
                  {"b_proj", m->b_proj->weight}, {"g_b_proj", m->g_b_proj->weight}, {"o_norm", m->o_norm},
                  {"o_proj", m->o_proj->weight}});
  }
}

TEST_CASE("kda layer: matches transformers' Glm5NextTextLinearAttention on the fixture (fp32 within 1e-5 of the largest output)") {
  using kiln::test::glm5::expected;
  using kiln::test::glm5::weight;
  auto cfg = flavors::debug();
  for (int layer : {0, 3}) {
    CAPTURE(layer);
    KimiDeltaAttention m(cfg.hidden_size, cfg.kda, cfg.rms_norm_eps);
    const std::string p = "layers." + std::to_string(layer) + ".self_attn.";
    torch::NoGradGuard ng;
    for (auto [mine, hf] : std::vector<std::pair<torch::Tensor, std::string>>{
             {m->q_proj->weight, "q_proj.weight"}, {m->k_proj->weight, "k_proj.weight"},
             {m->v_proj->weight, "v_proj.weight"}, {m->q_conv, "q_conv1d.weight"}, {m->k_conv, "k_conv1d.weight"},
             {m->v_conv, "v_conv1d.weight"}, {m->f_a_proj->weight, "f_a_proj.weight"},
             {m->f_b_proj->weight, "f_b_proj.weight"}, {m->dt_bias, "dt_bias"}, {m->A_log, "A_log"},
             {m->b_proj->weight, "b_proj.weight"}, {m->g_a_proj->weight, "g_a_proj.weight"},
             {m->g_b_proj->weight, "g_b_proj.weight"}, {m->o_norm, "o_norm.weight"}, {m->o_proj->weight, "o_proj.weight"}}) {
      auto w = weight(p + hf);
      REQUIRE(w.sizes() == mine.sizes());
      mine.copy_(w);
    }
    auto x = expected("kda." + std::to_string(layer) + ".in");
    auto y = m->forward(x, expected("cu_seqlens"));
    auto ref = expected("kda." + std::to_string(layer) + ".out");
    // Relative to the largest output (~2e-2 here): an absolute 1e-5 would hide a 0.5% error.
    const double d = max_diff(y, ref) / ref.abs().max().item<double>();
    MESSAGE("layer " << layer << ": max |kiln - transformers| / max |transformers| = " << d);
    CHECK(d < 1e-5);
  }
}

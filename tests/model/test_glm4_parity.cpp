// Parity with transformers' Glm4MoeLiteForCausalLM on the checked-in fixture: logits, routed
// experts, log-probs, loss and gradients; packed == one by one; routing replay.
#include <doctest/doctest.h>

#include <map>

#include "experiments/bench_routing.hpp"
#include "../test_util.hpp"
#include "fixture.hpp"
#include "model/blocks/fusions.hpp"
#include "model/blocks/logprobs.hpp"
#include "model/glm4_moe_lite/model.hpp"

using namespace kiln;
using namespace kiln::model;

namespace {
std::shared_ptr<glm4_moe_lite::Glm4MoeLiteModel> load_fixture_model() {
  return glm4_moe_lite::from_hf_dir(test::fixture_dir());
}
// Rows of the fixture batch for the head's row tests: out of order, one repeated, and a
// document's last row (no target: log-prob 0), at index 3.
torch::Tensor chosen_rows(const PackedBatch& batch) {
  const int64_t T = batch.input_ids.size(0), last = batch.cu_seqlens[1].item<int64_t>() - 1;
  return torch::tensor({T - 1, int64_t(2), int64_t(3), last, int64_t(3), int64_t(0)}, torch::kInt64);
}
// The fixture model in bf16 on the GPU (call after test::skip_without_gpu()).
std::shared_ptr<glm4_moe_lite::Glm4MoeLiteModel> cuda_bf16_fixture_model() {
  auto model = load_fixture_model();
  model->to(torch::Device(torch::kCUDA));
  model->to_dtype(torch::kBFloat16);
  return model;
}
}  // namespace

TEST_CASE("logits, routed experts and log-probs match transformers on a packed batch of three documents") {
  auto model = load_fixture_model();
  auto batch = test::fixture_batch();
  ForwardOptions opts;
  opts.return_routed_experts = true;
  auto out = model->forward(batch, opts);
  auto logits = model->logits(out);
  auto want = test::expected("logits");
  REQUIRE((logits.sizes() == want.sizes()));
  double diff = (logits - want).abs().max().item<double>();
  MESSAGE("max |logits - transformers| = " << diff);
  CHECK(diff <= 1e-4);
  // Expert ids: transformers' top-k order is unspecified, so compare per-token sets (sorted).
  auto ids = std::get<0>(out.routed_experts.sort(-1));
  CHECK(torch::equal(ids, test::expected("routed_experts")));
  auto targets = next_token_targets(batch.input_ids, batch.cu_seqlens);
  auto lp = model->token_logprobs(out, targets, /*chunk=*/5);
  CHECK((lp - test::expected("token_logprobs")).abs().max().item<double>() <= 1e-5);
}

TEST_CASE("loss and gradients match transformers (relative error <= 1e-3)") {
  auto model = load_fixture_model();
  auto batch = test::fixture_batch();
  auto targets = next_token_targets(batch.input_ids, batch.cu_seqlens);
  auto out = model->forward(batch);
  auto lp = model->token_logprobs(out, targets, /*chunk=*/7);
  auto count = (targets >= 0).sum();
  auto loss = -lp.sum() / count;
  CHECK(std::abs(loss.item<double>() - test::expected("loss").item<double>()) <= 1e-5);
  loss.backward();
  // HF parameter (fixture gradient name) -> kiln parameter.
  const std::vector<std::pair<std::string, std::string>> names = {
      {"model.embed_tokens.weight", "embed.weight"},
      {"model.layers.0.self_attn.q_a_proj.weight", "layers.0.attn.q_a.weight"},
      {"model.layers.0.mlp.down_proj.weight", "layers.0.mlp.down.weight"},
      {"model.layers.1.input_layernorm.weight", "layers.1.attn_norm.weight"},
      {"model.layers.1.self_attn.kv_b_proj.weight", "layers.1.attn.kv_b.weight"},
      {"model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "layers.1.attn.kv_a.weight"},
      {"model.layers.1.mlp.gate.weight", "layers.1.moe.router.weight"},
      {"model.layers.2.mlp.experts.gate_up_proj", "layers.2.moe.experts.w_gate_up_EFD"},
      {"model.layers.2.mlp.experts.down_proj", "layers.2.moe.experts.w_down_EDF"},
      {"model.layers.2.mlp.shared_experts.down_proj.weight", "layers.2.moe.shared.down.weight"},
      {"model.norm.weight", "norm.weight"},
      {"lm_head.weight", "lm_head.weight"},
  };
  auto params = model->named_parameters();
  for (const auto& [hf, kiln_name] : names) {
    CAPTURE(hf);
    auto want = test::expected("grad." + hf);
    auto got = params[kiln_name].grad();
    REQUIRE(got.defined());
    REQUIRE((got.sizes() == want.sizes()));
    double err = test::rel_error(got, want);
    MESSAGE(hf << ": relative gradient error " << err);
    CHECK(err <= 1e-3);
  }
}

TEST_CASE("a packed batch gives the same logits as its documents run one by one") {
  auto model = load_fixture_model();
  torch::NoGradGuard no_grad;
  auto batch = test::fixture_batch();
  auto packed = model->logits(model->forward(batch));
  auto cu = batch.cu_seqlens;
  for (int64_t b = 0; b + 1 < cu.size(0); ++b) {
    int64_t s = cu[b].item<int64_t>(), n = cu[b + 1].item<int64_t>() - s;
    auto one = PackedBatch{batch.input_ids.narrow(0, s, n).clone(), torch::arange(n, torch::kInt64),
                           torch::tensor({int64_t(0), n}, torch::kInt64)};
    auto alone = model->logits(model->forward(one));
    CHECK((alone - packed.narrow(0, s, n)).abs().max().item<double>() <= 1e-5);
  }
}

TEST_CASE("log-probs of chosen rows (an RL batch's completion tokens) are the whole batch's at those rows, values and gradients") {
  auto model = load_fixture_model();
  auto batch = test::fixture_batch();
  auto targets = next_token_targets(batch.input_ids, batch.cu_seqlens);
  const auto rows = chosen_rows(batch);
  auto grads = [&](const torch::Tensor& loss) {
    model->zero_grad();
    loss.backward();
    std::map<std::string, torch::Tensor> g;
    for (const auto& p : model->named_parameters()) g[p.key()] = p.value().grad().clone();
    return g;
  };
  for (double temperature : {1.0, 0.7}) {
    CAPTURE(temperature);
    auto all = model->token_logprobs(model->forward(batch), targets, /*chunk=*/4, temperature);  // [T]
    auto want = all.index_select(0, rows);
    const auto gw = grads(-(want * torch::arange(1, rows.size(0) + 1)).sum());
    auto got = model->token_logprobs(model->forward(batch), targets, 4, temperature, rows);  // [R]
    REQUIRE((got.sizes() == want.sizes()));
    CHECK((got - want).abs().max().item<double>() <= 1e-6);
    CHECK(got[3].item<double>() == 0.0);
    const auto gg = grads(-(got * torch::arange(1, rows.size(0) + 1)).sum());
    for (const auto& [name, g] : gw) {
      CAPTURE(name);
      if (g.abs().max().item<double>() == 0)
        CHECK(gg.at(name).abs().max().item<double>() == 0);
      else
        CHECK(test::rel_error(gg.at(name), g) <= 1e-5);
    }
    // With the entropy (one pass of the head): the same log-probs, and the whole batch's entropy
    // at those rows.
    {
      torch::NoGradGuard no_grad;
      auto out = model->forward(batch);
      auto [lp, ent] = model->token_logprobs_and_entropy(out, targets, 4, temperature, rows);
      auto [all_lp, all_ent] = token_logprobs_and_entropy(out.hidden / temperature, model->lm_head_weight(), targets, 4);
      CHECK((lp - want).abs().max().item<double>() <= 1e-6);
      CHECK((ent - all_ent.index_select(0, rows)).abs().max().item<double>() <= 1e-6);
      CHECK(ent.min().item<double>() > 0);
    }
  }
  // The batch-invariant mode gives a row the same bits whatever else is computed beside it.
  model->set_batch_invariant(true);
  {
    torch::NoGradGuard no_grad;
    auto out = model->forward(batch);
    auto all = model->token_logprobs(out, targets, 4, 0.7);
    CHECK(torch::equal(model->token_logprobs(out, targets, 4, 0.7, rows), all.index_select(0, rows)));
  }
  model->set_batch_invariant(false);
  CHECK_THROWS_WITH_AS(model->token_logprobs(model->forward(batch), targets, 4, 1.0, rows.reshape({2, 3})),
                       doctest::Contains("rows must be [R]"), c10::Error);
}

TEST_CASE("CUDA bf16: log-probs of chosen rows are the whole batch's at those rows, with kept and recomputed logits") {
  // On the GPU the head keeps its 16-bit logits for the backward (or, with no budget, recomputes
  // them): both paths with a row subset against the whole batch. Bounds: the same bf16 hidden rows
  // meet cuBLAS GEMMs of a different M (another tiling, fp32 sums in another order), so values
  // agree to fp32 rounding (<= 1e-4) and gradients to a bf16 step through the layers (rel <= 3e-2).
  if (test::skip_without_gpu()) return;
  auto model = cuda_bf16_fixture_model();
  auto batch = test::fixture_batch();
  auto targets = next_token_targets(batch.input_ids, batch.cu_seqlens);
  const auto rows = chosen_rows(batch);
  ForwardOptions replay;  // the same experts in every forward (bf16 scores may tie)
  replay.replay_routed_experts = test::expected("routed_experts");
  auto grads = [&](const torch::Tensor& loss) {
    model->zero_grad();
    loss.backward();
    std::map<std::string, torch::Tensor> g;
    for (const auto& p : model->named_parameters()) g[p.key()] = p.value().grad().to(torch::kCPU, torch::kFloat32);
    return g;
  };
  const auto weights = torch::arange(1, rows.size(0) + 1, torch::TensorOptions().device(torch::kCUDA));
  const int64_t default_keep = model->kept_logits_bytes();
  for (int64_t keep_bytes : {default_keep, int64_t(0)}) {
    CAPTURE(keep_bytes);
    model->set_kept_logits_bytes(keep_bytes);
    for (double temperature : {1.0, 0.7}) {
      CAPTURE(temperature);
      auto all = model->token_logprobs(model->forward(batch, replay), targets, 4, temperature);
      auto want = all.index_select(0, rows.to(torch::kCUDA));
      const auto gw = grads(-(want * weights).sum());
      auto got = model->token_logprobs(model->forward(batch, replay), targets, 4, temperature, rows);
      REQUIRE((got.sizes() == want.sizes()));
      CHECK((got - want).abs().max().item<double>() <= 1e-4);
      CHECK(got[3].item<double>() == 0.0);
      const auto gg = grads(-(got * weights).sum());
      double worst = 0;
      for (const auto& [name, g] : gw) {
        CAPTURE(name);
        if (g.abs().max().item<double>() == 0) {
          CHECK(gg.at(name).abs().max().item<double>() == 0);
          continue;
        }
        const double r = test::rel_error(gg.at(name), g);
        worst = std::max(worst, r);
        CHECK(r <= 3e-2);
      }
      MESSAGE("keep " << keep_bytes << " B, temperature " << temperature << ": values max diff "
                      << (got - want).abs().max().item<double>() << ", gradients worst rel " << worst);
    }
  }
  model->set_kept_logits_bytes(default_keep);
  // Batch-invariant kernels: the chosen rows' bits are the whole batch's.
  model->set_batch_invariant(true);
  {
    torch::NoGradGuard no_grad;
    auto out = model->forward(batch, replay);
    auto all = model->token_logprobs(out, targets, 4, 0.7);
    CHECK(torch::equal(model->token_logprobs(out, targets, 4, 0.7, rows), all.index_select(0, rows.to(torch::kCUDA))));
  }
  model->set_batch_invariant(false);
}

TEST_CASE("routing replay uses the given experts and still trains the router") {
  auto model = load_fixture_model();
  auto batch = test::fixture_batch();
  ForwardOptions record;
  record.return_routed_experts = true;
  auto first = model->forward(batch, record);
  ForwardOptions replay;
  replay.replay_routed_experts = first.routed_experts;
  auto again = model->forward(batch, replay);
  CHECK(torch::equal(again.routed_experts, first.routed_experts));
  CHECK((model->logits(again) - model->logits(first)).abs().max().item<double>() == 0.0);
  // Other experts (shifted by one, same group size) change the output...
  auto other = (first.routed_experts + 1) % 8;
  replay.replay_routed_experts = other;
  auto moved = model->forward(batch, replay);
  CHECK((model->logits(moved) - model->logits(first)).abs().max().item<double>() > 1e-3);
  // ...and gradients reach the router through the replayed experts' weights.
  model->logits(moved).sum().backward();
  auto g = model->named_parameters()["layers.1.moe.router.weight"].grad();
  REQUIRE(g.defined());
  CHECK(g.abs().sum().item<double>() > 0);
  // A replay tensor of the wrong shape is refused by name.
  replay.replay_routed_experts = torch::zeros({3, 2, 2}, torch::kInt64);
  CHECK_THROWS_WITH_AS(model->forward(batch, replay), doctest::Contains("replay_routed_experts must be [T, L, K]"),
                       std::invalid_argument);
  // ...and ids outside [0, E) too, before any layer runs.
  auto out_of_range = first.routed_experts.clone();
  out_of_range[0][0][0] = 8;
  replay.replay_routed_experts = out_of_range;
  CHECK_THROWS_WITH_AS(model->forward(batch, replay), doctest::Contains("must lie in [0, 8)"), std::invalid_argument);
}

TEST_CASE("CUDA bf16: logits, log-probs and loss gradients stay within bf16 tolerances of transformers (fp32)") {
  // The fixture holds transformers' fp32 outputs; kiln runs bf16 on the GPU (FlashAttention
  // varlen, grouped-GEMM experts, fused RMSNorm). Tolerances are bf16's: 8 mantissa bits give
  // ~4e-3 relative rounding per op, compounded over 3 layers: logits rel <= 3e-2, log-probs
  // mean abs <= 2e-2, gradients rel <= 8e-2. Routed experts: the fixture's tiny model scores
  // experts that differ by less than bf16 resolution, so the choice is compared via replay.
  if (test::skip_without_gpu()) return;
  auto model = cuda_bf16_fixture_model();
  auto batch = test::fixture_batch();
  ForwardOptions opts;
  auto want_ids = test::expected("routed_experts");
  opts.replay_routed_experts = want_ids;  // transformers' choice (as a set: order does not matter)
  auto out = model->forward(batch, opts);
  auto logits = model->logits(out).to(torch::kCPU).to(torch::kFloat32);
  auto want = test::expected("logits");
  const double lrel = test::rel_error(logits, want);
  auto targets = next_token_targets(batch.input_ids, batch.cu_seqlens);
  auto lp = model->token_logprobs(out, targets, 5).to(torch::kCPU);
  const double lp_diff = (lp - test::expected("token_logprobs")).abs().mean().item<double>();
  auto loss = -lp.sum() / (targets >= 0).sum();
  loss.backward();
  auto g = model->named_parameters()["layers.2.moe.experts.w_gate_up_EFD"].grad().to(torch::kCPU).to(torch::kFloat32);
  const double grel = test::rel_error(g, test::expected("grad.model.layers.2.mlp.experts.gate_up_proj"));
  auto ga = model->named_parameters()["layers.1.attn.kv_b.weight"].grad().to(torch::kCPU).to(torch::kFloat32);
  const double garel = test::rel_error(ga, test::expected("grad.model.layers.1.self_attn.kv_b_proj.weight"));
  MESSAGE("bf16 CUDA vs transformers fp32: logits rel " << lrel << ", log-prob mean abs " << lp_diff
                                                        << ", grad rel experts " << grel << " kv_b " << garel);
  CHECK(lrel <= 3e-2);
  CHECK(lp_diff <= 2e-2);
  CHECK(grel <= 8e-2);
  CHECK(garel <= 8e-2);
}

TEST_CASE("training fusions on and off: the same log-probs bit for bit and the same gradients (CPU fp32 exactly, CUDA bf16 to rounding)") {
  const bool initial = training_fusions();  // KILN_TRAINING_FUSIONS's, or on
  std::vector<bool> cuda_too{false};
  if (test::have_gpu()) cuda_too.push_back(true);
  else MESSAGE("no CUDA device: the CPU paths only (the embedding's and SwiGLU's switch)");
  for (bool cuda : cuda_too) {
    CAPTURE(cuda);
    auto model = cuda ? cuda_bf16_fixture_model() : load_fixture_model();
    auto batch = test::fixture_batch();
    auto targets = next_token_targets(batch.input_ids, batch.cu_seqlens);
    ForwardOptions opts;
    opts.replay_routed_experts = test::expected("routed_experts");  // one routing for both runs
    std::vector<torch::Tensor> lps;
    std::vector<std::vector<torch::Tensor>> grads;
    for (bool on : {false, true}) {
      const bool before = set_training_fusions(on);
      model->zero_grad();
      auto lp = model->token_logprobs(model->forward(batch, opts), targets, 5);
      (-lp.sum() / (targets >= 0).sum()).backward();
      set_training_fusions(before);
      lps.push_back(lp.detach().to(torch::kCPU));
      std::vector<torch::Tensor> g;
      for (auto& p : model->parameters())
        g.push_back(p.grad().defined() ? p.grad().to(torch::kCPU, torch::kFloat32) : torch::Tensor());
      grads.push_back(g);
    }
    CHECK(torch::equal(lps[0], lps[1]));
    for (std::size_t i = 0; i < grads[0].size(); ++i) {
      CAPTURE(i);
      REQUIRE(grads[1][i].defined() == grads[0][i].defined());
      if (!grads[0][i].defined()) continue;
      if (cuda) CHECK(test::rel_error(grads[1][i], grads[0][i]) <= 1e-2);
      else CHECK(torch::equal(grads[1][i], grads[0][i]));
    }
  }
  CHECK(training_fusions() == initial);  // restored
}

// kiln bench gpu --balance-routing's update (experiments/bench_routing.hpp) on the fixture model:
// the loads count every token's K experts in every MoE layer, and the rounds even them out.
TEST_CASE("bench routing: the router-bias balancing rounds even out the experts' loads on a pack") {
  auto model = load_fixture_model();
  auto batch = test::fixture_batch();
  const auto before = experiments::expert_loads(*model, batch);  // [L, E]
  const int64_t T = batch.input_ids.size(0), K = model->config().moe.top_k;
  REQUIRE(before.size(1) == model->config().moe.num_experts);
  CHECK((before.sum(1) == double(T * K)).all().item<bool>());
  const auto returned = experiments::balance_routing(*model, batch, 200, 1e-2);
  CHECK(torch::equal(returned, before));
  const auto after = experiments::expert_loads(*model, batch);
  MESSAGE("expert load max/mean per layer " << experiments::per_layer_max_over_mean(before) << " -> "
                                            << experiments::per_layer_max_over_mean(after));
  CHECK(experiments::per_layer_max_over_mean(after) < experiments::per_layer_max_over_mean(before));
}

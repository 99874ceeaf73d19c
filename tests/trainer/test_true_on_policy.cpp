// The true on-policy mode (algorithm.true_on_policy) on the CPU with the debug model in fp32:
// the rollout engine's log-prob of every sampled token (continuous batching, prefills split
// over steps, decode steps of several sequences) equals the trainer's packed forward (routing
// replayed), with and without gradients, exactly; the default mode's does not. Shared prompts
// give the unshared run's tokens and log-probs. Models without the mode, and engine settings
// that contradict it, are refused by name.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>

#include "actors/rollout/engine.hpp"
#include "actors/trainer/trainer.hpp"
#include "model/blocks/logprobs.hpp"
#include "model/glm5_next/model.hpp"
#include "model/registry.hpp"
#include "trainer_fixture.hpp"

using namespace kiln;

namespace {
constexpr double kTemperature = 0.7;

// The seeded debug model with sharper routing and logits than the 0.02 init (as the engine's
// tests), so that expert choices and samples are not near ties.
std::shared_ptr<model::glm4_moe_lite::Glm4MoeLiteModel> sharp_model(uint64_t seed) {
  auto m = test::debug_model(seed);
  torch::NoGradGuard g;
  for (auto& p : m->named_parameters())
    if (p.key().find("router.weight") != std::string::npos || p.key() == "lm_head.weight") p.value().mul_(25.0);
  return m;
}

// Ten prompts of different lengths (1 .. 37 tokens) and 3 .. 11 new tokens each.
std::vector<rollout::GenerationRequest> mixed_requests() {
  std::vector<rollout::GenerationRequest> out;
  const std::vector<int64_t> lengths = {5, 1, 37, 12, 3, 20, 8, 29, 2, 16};
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    rollout::GenerationRequest r;
    r.id = uint64_t(i);
    for (int64_t j = 0; j < lengths[i]; ++j) r.prompt.push_back(2 + (int64_t(i) * 7 + j * 5) % 60);
    r.sampling.max_new_tokens = 3 + int64_t(i) % 9;
    r.sampling.temperature = kTemperature;
    r.sampling.seed = 500 + i;
    out.push_back(r);
  }
  return out;
}

// Pages of 4 tokens, 4 sequences at once (the others wait and join as earlier ones finish),
// at most 40 prompt tokens prefilled per step.
rollout::EngineOptions engine_options(bool true_on_policy) {
  rollout::EngineOptions o;
  o.cache_blocks = 128;
  o.block_size = 4;
  o.max_batch = 4;
  o.max_prefill_tokens = 40;
  o.true_on_policy = true_on_policy;
  return o;
}

trainer::TrainerConfig trainer_config(bool true_on_policy) {
  trainer::TrainerConfig c;
  c.logprobs.temperature = kTemperature;
  c.logprobs.max_tokens_per_microbatch = 96;  // several packs of several samples
  c.logprobs.true_on_policy = true_on_policy;
  return c;
}
}  // namespace

TEST_CASE("true on-policy: the trainer's log-probs equal the engine's exactly (fp32 debug model), the default's do not") {
  for (bool mode : {true, false}) {
    CAPTURE(mode);
    auto engine_model = sharp_model(21);
    auto samples = test::generate_samples(engine_model, mixed_requests(), 1.0f, -0.5f, engine_options(mode));
    REQUIRE(samples.size() == 10);
    // The trainer holds its own copy of the same weights.
    auto policy = sharp_model(21);
    trainer::Trainer trainer(policy, trainer_config(mode));
    CHECK(policy->batch_invariant() == mode);

    // No-grad packed forward (what the reference and recompute_old_logprobs run).
    const auto gap = test::train_rollout_gap(*policy, samples, trainer_config(mode).logprobs);
    const double max_diff = gap.max;
    const int64_t n = gap.n;
    // The training forward, with gradients (the mode's autograd functions): its mean
    // |policy - behaviour| over the trained tokens.
    auto metrics = trainer.train_step(samples);
    MESSAGE("mode " << std::string(mode ? "true_on_policy" : "default") << ": " << n << " tokens, no-grad max |trainer - engine| = "
                    << max_diff << ", mean " << gap.mean
                    << "; training forward mean = " << metrics.train_rollout_logprob_abs_diff);
    CHECK(n >= 60);
    if (mode) {
      CHECK(max_diff == 0.0);
      CHECK(metrics.train_rollout_logprob_abs_diff == 0.0);
    } else {  // the engine's latent-space decode and ATen's kernels round otherwise: the test can fail
      CHECK(max_diff > 0.0);
      CHECK(metrics.train_rollout_logprob_abs_diff > 0.0);
    }
    CHECK(std::isfinite(metrics.loss));
    CHECK(metrics.grad_norm > 0);
  }
}

TEST_CASE("true on-policy: the mode's gradients are the default mode's up to rounding (activation checkpointing too)") {
  auto batch = model::PackedBatch::from_documents({{5, 9, 13, 2, 40, 41, 7}, {8, 9}, {10, 11, 12, 13, 14, 3, 3, 60, 2}});
  auto targets = model::next_token_targets(batch.input_ids, batch.cu_seqlens);
  torch::Tensor replay;
  {
    torch::NoGradGuard g;
    model::ForwardOptions ask;
    ask.return_routed_experts = true;
    replay = sharp_model(22)->forward(batch, ask).routed_experts;  // the same experts in both modes
  }
  auto weights = torch::linspace(-1, 1, batch.input_ids.size(0));
  std::vector<std::vector<torch::Tensor>> grads;
  for (auto [mode, checkpointing] : {std::pair{false, false}, std::pair{true, false}, std::pair{true, true}}) {
    auto policy = sharp_model(22);
    policy->set_batch_invariant(mode);
    policy->set_activation_checkpointing(checkpointing);
    model::ForwardOptions opts;
    opts.replay_routed_experts = replay;
    auto lp = policy->token_logprobs(policy->forward(batch, opts), targets, 1024, kTemperature);  // [T]
    (lp * weights).sum().backward();
    std::vector<torch::Tensor> g;
    for (const auto& p : policy->parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
    grads.push_back(std::move(g));
  }
  for (std::size_t k = 1; k < grads.size(); ++k)
    for (std::size_t i = 0; i < grads[0].size(); ++i) {
      CAPTURE(k);
      CAPTURE(i);
      const double scale = grads[0][i].abs().max().item<double>() + 1e-12;
      CHECK((grads[k][i] - grads[0][i]).abs().max().item<double>() <= 1e-4 * scale);
    }
}

TEST_CASE("true on-policy: shared prompts give the unshared run's tokens and log-probs exactly") {
  std::vector<rollout::GenerationRequest> reqs;
  for (int g = 0; g < 3; ++g)
    for (int s = 0; s < 4; ++s) {  // groups of 4 samples of one prompt, each its own seed
      rollout::GenerationRequest r;
      r.id = uint64_t(g * 4 + s);
      for (int64_t j = 0; j < 6 + 7 * g; ++j) r.prompt.push_back(3 + (g * 11 + j * 3) % 50);
      r.sampling.max_new_tokens = 6;
      r.sampling.temperature = kTemperature;
      r.sampling.seed = uint64_t(900 + g * 4 + s);
      reqs.push_back(r);
    }
  std::map<uint64_t, rollout::Completion> runs[2];
  int64_t shared = 0;
  for (bool share : {false, true}) {
    auto o = engine_options(true);
    o.max_batch = 8;
    o.share_prompts = share;
    rollout::Engine engine(sharp_model(23), o);
    for (auto& c : engine.generate(reqs)) runs[share][c.id] = std::move(c);
    if (share) shared = engine.shared_prompts();
  }
  CHECK(shared >= 6);  // the groups' later samples took their prompt from the first
  REQUIRE(runs[0].size() == reqs.size());
  REQUIRE(runs[1].size() == reqs.size());
  for (const auto& [id, c] : runs[0]) {
    CAPTURE(id);
    const auto& d = runs[1].at(id);
    CHECK(c.tokens == d.tokens);
    CHECK(c.logprobs == d.logprobs);  // bit for bit
    CHECK(torch::equal(c.routed_experts, d.routed_experts));
  }
}

TEST_CASE("true on-policy: refused by name for a model without the mode and for contradicting engine settings") {
  torch::manual_seed(1);
  auto glm5 = model::Registry::with_builtins().build(model::ModelSpec{"glm5_next", "debug", "", "cpu", "fp32"});
  CHECK_FALSE(glm5->supports_batch_invariant());
  CHECK_THROWS_WITH_AS(trainer::Trainer(glm5, trainer_config(true)),
                       doctest::Contains("algorithm.true_on_policy) needs a policy with a batch-invariant forward"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(rollout::Engine(glm5, engine_options(true)),
                       doctest::Contains("true_on_policy (algorithm.true_on_policy) needs a model with a batch-invariant"),
                       std::invalid_argument);
  CHECK_THROWS_AS(glm5->set_batch_invariant(true), std::invalid_argument);
  CHECK_NOTHROW(glm5->set_batch_invariant(false));
  auto m = test::debug_model(1);
  auto absorbed = engine_options(true);
  absorbed.absorbed_decode = true;
  CHECK_THROWS_WITH_AS(rollout::Engine(m, absorbed), doctest::Contains("contradicts rollout.absorbed_decode = true"),
                       std::invalid_argument);
  auto graphs = engine_options(true);
  graphs.cuda_graphs = true;
  graphs.absorbed_decode = false;
  CHECK_THROWS_WITH_AS(rollout::Engine(m, graphs), doctest::Contains("contradicts rollout.cuda_graphs = true"),
                       std::invalid_argument);
  // The engine turns the model's switch both ways.
  { rollout::Engine on(m, engine_options(true)); }
  CHECK(m->batch_invariant());
  CHECK(m->layers[0]->attn->batch_invariant());
  { rollout::Engine off(m, engine_options(false)); }
  CHECK_FALSE(m->batch_invariant());
  CHECK_FALSE(m->norm->batch_invariant());
}

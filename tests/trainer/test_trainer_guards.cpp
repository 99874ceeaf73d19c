// What Trainer::train_step refuses and what it skips: samples it cannot train on (or that would
// poison it) are refused by name before anything changes; a step whose loss or gradient norm
// comes out non-finite from finite inputs changes no parameter, no AdamW state, no lr and no
// version, and says why in StepMetrics.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "model/blocks/basic.hpp"
#include "trainer_fixture.hpp"

using namespace kiln;
using namespace kiln::trainer;
using test::debug_model;
using test::differences;
using test::rollout_samples;
using test::snapshot;

namespace {
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// The issue's sample: debug model, prompt {5, 9, 13, 2}, completion {7, 8}.
Sample issue_sample(std::vector<float> behavior_logprobs) {
  Sample s;
  s.prompt = {5, 9, 13, 2};
  s.completion = {7, 8};
  s.behavior_logprobs = std::move(behavior_logprobs);
  s.advantage = 1.0f;
  return s;
}

void check_refused(Trainer& t, const std::vector<Sample>& samples, const std::string& message) {
  CAPTURE(message);
  auto before = snapshot(t);
  CHECK_THROWS_WITH_AS(t.train_step(samples), doctest::Contains(message.c_str()), std::invalid_argument);
  CHECK(differences(before, snapshot(t)).empty());
}
}  // namespace

TEST_CASE("samples that would poison the step, or that it cannot train on, are refused by name first") {
  auto m = debug_model(3);
  TrainerConfig c;
  c.loss.kl_coef = 0.1;
  Trainer t(m, c);
  auto good = issue_sample({-4.0f, -4.5f});
  good.ref_logprobs = {-4.0f, -4.5f};
  t.train_step({good});  // AdamW holds state from here on: a refused step must keep it too
  auto nan_lp = good;
  nan_lp.behavior_logprobs = {-4.0f, kNaN};  // the issue's case: made all 126,080 parameters NaN
  check_refused(t, {good, nan_lp}, "sample 1 has a non-finite value in behaviour log-probs at token 1: nan");
  auto inf_adv = good;
  inf_adv.advantage = kInf;
  check_refused(t, {inf_adv}, "sample 0 has a non-finite advantage: inf");
  auto nan_ref = good;
  nan_ref.ref_logprobs = {kNaN, -1.0f};
  check_refused(t, {nan_ref}, "sample 0 has a non-finite value in reference log-probs at token 0");
  auto no_ref = good;
  no_ref.ref_logprobs.clear();
  check_refused(t, {good, no_ref}, "sample 1 has 0 reference log-probs for 2 completion tokens (kl_coef != 0");
  auto with_old = good;
  with_old.old_logprobs = {-4.0f, -kInf};
  check_refused(t, {with_old}, "sample 0 has a non-finite value in old log-probs at token 1: -inf");
  with_old.old_logprobs = {-4.0f, -4.5f};
  check_refused(t, {with_old, good}, "sample 1 has no old_logprobs, sample 0 has: old_logprobs must be given");
  auto outside = good;
  outside.completion = {7, 96};
  check_refused(t, {outside}, "sample 0 has token id 96 outside the vocabulary [0, 96)");
  // Routed experts (routing replay) of another model's shape, or an id past the experts: named
  // here, not inside the forward ("replay_routed_experts must lie in [0, E)", no sample).
  const int64_t L = m->num_moe_layers(), K = m->experts_per_token(), E = m->num_experts();
  auto replayed = good;
  replayed.routed_experts = torch::zeros({5, L, K}, torch::kInt64);  // P + n - 1 rows
  replayed.routed_experts[3][L - 1][K - 1] = E;
  check_refused(t, {good, replayed},
                "sample 1 has routed expert id " + std::to_string(E) + " outside [0, " + std::to_string(E) + ")");
  replayed.routed_experts[3][L - 1][K - 1] = -1;
  check_refused(t, {replayed}, "sample 0 has routed expert id -1 outside [0, " + std::to_string(E) + ")");
  const auto want = "], not [5, " + std::to_string(L) + ", " + std::to_string(K) + "]";
  replayed.routed_experts = torch::zeros({5, L, K + 1}, torch::kInt64);
  check_refused(t, {replayed}, "sample 0 has routed experts of shape [5, " + std::to_string(L) + ", " +
                                   std::to_string(K + 1) + want);
  replayed.routed_experts = torch::zeros({4, L, K}, torch::kInt64);  // one row short: replay would be dropped
  check_refused(t, {replayed}, "sample 0 has routed experts of shape [4, " + std::to_string(L) + ", " +
                                   std::to_string(K) + want);
  replayed.routed_experts = torch::zeros({5, L, K}, torch::kInt64);
  t.train_step({replayed});  // in range: trained (every token on expert 0)
  auto no_prompt = good;
  no_prompt.prompt.clear();
  check_refused(t, {no_prompt}, "sample 0 has an empty prompt");
  check_refused(t, {}, "train_step: no samples");
  CHECK(t.version() == 2);
  // A log-prob pass that replays them (the reference's, the old log-probs') refuses them too,
  // by sample, before its forward.
  replayed.routed_experts = torch::zeros({5, L, K}, torch::kInt64);
  replayed.routed_experts[0][0][0] = E;
  const auto refused = "log-probs: sample 1 has routed expert id " + std::to_string(E);
  CHECK_THROWS_WITH_AS(completion_logprobs(*m, {good, replayed}, 4096, true, 1.0), doctest::Contains(refused.c_str()),
                       std::invalid_argument);
  CHECK(completion_logprobs(*m, {good, replayed}, 4096, false, 1.0).size() == 2);  // not replayed: not read
  // Without routing replay the routed experts are not read, so not refused either.
  TrainerConfig off = c;
  off.logprobs.routing_replay = false;
  auto m2 = debug_model(3);
  Trainer no_replay(m2, off);
  replayed.routed_experts = torch::full({5, L, K + 1}, E, torch::kInt64);
  no_replay.train_step({replayed});
  CHECK(no_replay.version() == 1);
}

TEST_CASE("a 1-token prompt with no response is refused by name, not by a raw 'start out of range'") {
  auto m = debug_model(3);
  Trainer t(m, TrainerConfig{});
  auto good = issue_sample({-4.0f, -4.5f});
  Sample empty;
  empty.prompt = {5};
  // What the engine reports for it: P + n - 1 = 0 rows of routed experts [0, L, K].
  empty.routed_experts = torch::zeros({0, 2, 2}, torch::kInt64);
  check_refused(t, {good, empty}, "sample 1 has an empty completion (no token to train on)");
  check_refused(t, {empty}, "sample 0 has an empty completion");
  CHECK(t.version() == 0);
}

TEST_CASE("a step whose loss or gradient norm is not finite changes nothing, and training goes on as if it never ran") {
  // Warmup makes the lr depend on the version, so a skipped step that advanced anything would show.
  TrainerConfig c;
  c.lr = 1e-2;
  c.warmup_steps = 4;
  c.grad_clip = 0;
  auto m = debug_model(5), twin_model = debug_model(5);
  Trainer t(m, c), twin(twin_model, c);
  auto samples = rollout_samples(m, 4);
  auto first = t.train_step(samples);
  twin.train_step(samples);
  CHECK_FALSE(first.skipped_nonfinite);
  CHECK(first.skip_reason.empty());
  // Finite inputs, non-finite step: advantages near FLT_MAX.
  auto huge = samples;
  for (auto& x : huge) x.advantage = 3e38f;  // the token sum of -A * ratio overflows: loss -inf
  auto two_tokens = issue_sample({-4.0f, -4.5f});
  two_tokens.advantage = 1e38f;  // loss -1e38 stays finite; the gradients overflow (inf - inf: nan)
  const std::vector<std::pair<std::vector<Sample>, std::string>> cases{{huge, "loss is -inf"},
                                                                      {{two_tokens}, "gradient norm is nan"}};
  for (const auto& [bad, reason] : cases) {
    CAPTURE(reason);
    auto before = snapshot(t);
    auto skipped = t.train_step(bad);
    CHECK(skipped.skipped_nonfinite);
    CHECK(skipped.skip_reason == reason);
    CHECK(differences(before, snapshot(t)).empty());
  }
  // The next step is the twin's second step, bit for bit.
  auto second = t.train_step(samples), twin_second = twin.train_step(samples);
  CHECK_FALSE(second.skipped_nonfinite);
  CHECK(second.lr == twin_second.lr);
  CHECK(differences(snapshot(t), snapshot(twin)).empty());
  CHECK(t.version() == 2);
}

TEST_CASE("the issue's overflow (policy log-prob ~-736 vs reference -19.4, k3, coef 0.1) now trains finitely") {
  // A sharp lm_head makes the completion very unlikely: its log-probs are hundreds below 0, so
  // r = ref - logprob is far past ln(FLT_MAX) = 88.7 and an unclamped k3 is inf.
  auto m = debug_model(5);
  {
    torch::NoGradGuard g;
    m->named_parameters()["lm_head.weight"].mul_(300.0);
  }
  // Each completion token is the least likely one after the tokens before it.
  Sample s = issue_sample({});
  s.completion.clear();
  for (int k = 0; k < 2; ++k) {
    std::vector<int64_t> doc = s.prompt;
    doc.insert(doc.end(), s.completion.begin(), s.completion.end());
    torch::NoGradGuard g;
    auto out = m->forward(model::PackedBatch::from_documents({doc}), {});
    s.completion.push_back(m->logits(out)[int64_t(doc.size()) - 1].argmin().item<int64_t>());
  }
  auto lp = completion_logprobs(*m, {s}, 4096, true)[0];
  MESSAGE("policy log-probs of the completion: " << lp[0] << ", " << lp[1]);
  REQUIRE(lp[0] < -19.4f - 89);
  s.behavior_logprobs = lp;
  s.ref_logprobs = {-19.4f, -19.4f};
  s.advantage = 0;
  TrainerConfig c;
  c.loss.kl_coef = 0.1;
  c.loss.kl_estimator = "k3";
  Trainer t(m, c);
  auto metrics = t.train_step({s});
  CHECK_FALSE(metrics.skipped_nonfinite);
  CHECK(std::isfinite(metrics.loss));
  CHECK(std::isfinite(metrics.grad_norm));
  CHECK(t.version() == 1);
  for (const auto& p : m->parameters()) CHECK(torch::isfinite(p).all().item<bool>());
}

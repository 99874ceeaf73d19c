// RL losses against hand-computed values and gradients.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "actors/trainer/losses.hpp"

using namespace kiln::trainer;

namespace {
// Tokens with logprob == old == behavior (ratio 1, TIS weight 1): per-token loss is -A.
PolicyTokens tokens_with_advantages(const torch::Tensor& logprob, const torch::Tensor& adv) {
  PolicyTokens t;
  t.logprob = logprob;
  t.old_logprob = logprob.detach();
  t.behavior_logprob = logprob.detach();
  t.ref_logprob = logprob.detach();
  t.advantage = adv;
  t.loss_mask = torch::ones_like(adv);
  t.sample_index = torch::arange(adv.size(0), torch::kInt64);
  return t;
}
}  // namespace

TEST_CASE("a token's weight does not depend on how samples fall into micro-batches") {
  // Token losses [4, 0, 0, 0]: micro-batch A holds the first, B the other three.
  auto adv = torch::tensor({-4.0f, 0.0f, 0.0f, 0.0f});
  auto lp = torch::full({4}, -1.0f, torch::requires_grad());
  PolicyLossConfig c;
  c.tis_cap = 0;
  const double step_tokens = 4;  // global normaliser
  auto a = policy_loss(tokens_with_advantages(lp.narrow(0, 0, 1), adv.narrow(0, 0, 1)), c, step_tokens);
  auto b = policy_loss(tokens_with_advantages(lp.narrow(0, 1, 3), adv.narrow(0, 1, 3)), c, step_tokens);
  CHECK((a.loss + b.loss).item<double>() == doctest::Approx(1.0));  // not (4 + 0) / 2 = 2.0
  // 1, 2 and 4 micro-batches: same loss and same gradients.
  auto adv2 = torch::tensor({-4.0f, 1.0f, 0.5f, -2.0f});
  std::vector<torch::Tensor> grads;
  std::vector<double> losses;
  for (int64_t parts : {1, 2, 4}) {
    auto x = torch::tensor({-1.0f, -0.5f, -2.0f, -0.1f}, torch::requires_grad());
    double total = 0;
    for (int64_t p = 0; p < parts; ++p) {
      int64_t n = 4 / parts;
      auto r = policy_loss(tokens_with_advantages(x.narrow(0, p * n, n), adv2.narrow(0, p * n, n)), c, step_tokens);
      r.loss.backward();
      total += r.loss.item<double>();
    }
    losses.push_back(total);
    grads.push_back(x.grad().clone());
  }
  CHECK(losses[1] == doctest::Approx(losses[0]));
  CHECK(losses[2] == doctest::Approx(losses[0]));
  CHECK(torch::allclose(grads[1], grads[0]));
  CHECK(torch::allclose(grads[2], grads[0]));
  // d loss / d logprob_i = -A_i / 4 at ratio 1
  CHECK(grads[0][0].item<float>() == doctest::Approx(1.0));
}

TEST_CASE("sequence-mean aggregation averages each sample over its own tokens first") {
  // Sample 0: 1 token of loss 4; sample 1: 3 tokens of loss 0 -> (4 + 0) / 2 samples = 2.0.
  auto lp = torch::full({4}, -1.0f, torch::requires_grad());
  auto t = tokens_with_advantages(lp, torch::tensor({-4.0f, 0.0f, 0.0f, 0.0f}));
  t.sample_index = torch::tensor(std::vector<int64_t>{0, 1, 1, 1});
  PolicyLossConfig c;
  c.tis_cap = 0;
  c.aggregation = "sequence_mean";
  auto r = policy_loss(t, c, /*samples=*/2, torch::tensor({1.0f, 3.0f}));
  CHECK(r.loss.item<double>() == doctest::Approx(2.0));
}

TEST_CASE("the KL term pulls toward the reference: k1, k2, k3 values and derivatives") {
  struct Case {
    KLEstimator e;
    double value, derivative;
  };
  for (auto [e, value, derivative] : {Case{KLEstimator::k3, 0.3679, 0.6321}, Case{KLEstimator::k1, 1.0, 1.0},
                                      Case{KLEstimator::k2, 0.5, 1.0}}) {
    auto lp = torch::tensor({-1.0f}, torch::requires_grad());
    auto ref = torch::tensor({-2.0f});
    auto kl = kl_estimate(lp, ref, e);
    CHECK(kl.item<double>() == doctest::Approx(value).epsilon(1e-3));
    kl.sum().backward();
    CHECK(lp.grad().item<double>() == doctest::Approx(derivative).epsilon(1e-3));
    // One SGD step on the KL lowers it.
    auto stepped = (lp.detach() - 0.1 * lp.grad()).requires_grad_();
    CHECK(kl_estimate(stepped, ref, e).item<double>() < kl.item<double>());
  }
  CHECK_THROWS_AS(kl_estimator_from_string("k4"), std::invalid_argument);
}

TEST_CASE("GRPO advantages are group-relative, optionally std-normalised") {
  auto r = torch::tensor({1.0f, 0.0f, 0.0f, 0.0f, 1.0f, 1.0f, 0.0f, 0.0f});
  auto a = grpo_advantages(r, 4, false);
  CHECK(a[0].item<float>() == doctest::Approx(0.75));
  CHECK(a[1].item<float>() == doctest::Approx(-0.25));
  CHECK(a[4].item<float>() == doctest::Approx(0.5));
  auto n = grpo_advantages(r, 4, true);
  CHECK(n[0].item<float>() == doctest::Approx(0.75 / std::sqrt(0.1875)).epsilon(1e-4));
  CHECK(n[6].item<float>() == doctest::Approx(-1.0).epsilon(1e-4));
  CHECK(grpo_advantages(torch::ones({4}), 4, true).abs().sum().item<float>() == 0.0f);  // no variance, no signal
}

TEST_CASE("PPO clipping with separate low and high bounds, and truncated importance weights") {
  PolicyLossConfig c;  // clip 0.8 .. 1.28
  c.tis_cap = 0;
  auto old = torch::zeros({3});
  // ratios 1.5 (A>0: clipped to 1.28), 0.5 (A>0: unclipped), 0.5 (A<0: clipped to 0.8)
  auto lp = torch::log(torch::tensor({1.5f, 0.5f, 0.5f})).requires_grad_();
  PolicyTokens t;
  t.logprob = lp;
  t.old_logprob = old;
  t.behavior_logprob = old;
  t.ref_logprob = old;
  t.advantage = torch::tensor({1.0f, 1.0f, -1.0f});
  t.loss_mask = torch::ones({3});
  t.sample_index = torch::arange(3, torch::kInt64);
  auto r = policy_loss(t, c, 1.0);
  CHECK(r.loss.item<double>() == doctest::Approx(-1.28 - 0.5 + 0.8).epsilon(1e-5));
  CHECK(r.clipped_tokens == 2);
  {  // Unread (the trainer's form): the doubles stay 0, the device tensor holds what they read.
    torch::NoGradGuard ng;
    auto u = policy_loss(t, c, 1.0, {}, /*read_sums=*/false);
    CHECK(u.clipped_tokens == 0);
    CHECK((u.sums.scalar_type() == torch::kFloat64));
    REQUIRE(u.sums.numel() == PolicyLossResult::kSums);
    const std::vector<double> want{r.pg_sum, r.kl_sum, r.entropy_sum, r.clipped_tokens, r.tokens};
    for (int64_t i = 0; i < PolicyLossResult::kSums; ++i) CHECK(u.sums[i].item<double>() == want[std::size_t(i)]);
    CHECK(r.tokens == 3);
  }
  r.loss.backward();
  CHECK(lp.grad()[0].item<float>() == 0.0f);  // clipped: no gradient
  CHECK(lp.grad()[2].item<float>() == 0.0f);
  CHECK(lp.grad()[1].item<float>() == doctest::Approx(-0.5));  // -A * ratio
  // TIS: old - behavior = log 3 -> weight min(3, 2) = 2
  c.tis_cap = 2.0;
  auto lp2 = torch::zeros({1}, torch::requires_grad());
  PolicyTokens s = tokens_with_advantages(lp2, torch::tensor({1.0f}));
  s.behavior_logprob = torch::full({1}, -std::log(3.0f));
  CHECK(policy_loss(s, c, 1.0).loss.item<double>() == doctest::Approx(-2.0));
}

TEST_CASE("k3 clamps the log-ratio at 20: log-prob -100 vs reference -5 gives e^20 - 21, gradient 1 - e^20") {
  // Unclamped, r = 95 is past ln(FLT_MAX) = 88.7: value inf, gradient -inf.
  auto lp = torch::tensor({-100.0f, -5.0f, 3.0f}, torch::requires_grad());
  auto ref = torch::tensor({-5.0f, -100.0f, -30.0f});
  auto kl = kl_estimate(lp, ref, KLEstimator::k3);
  kl.sum().backward();
  const double e20 = std::exp(20.0);
  CHECK(kl[0].item<double>() == doctest::Approx(e20 - 21).epsilon(1e-6));  // 4.852e8
  CHECK(lp.grad()[0].item<double>() == doctest::Approx(1 - e20).epsilon(1e-6));  // -4.852e8: still pulls back
  // r = -95 clamps to -20: e^-20 - 1 + 20; d/dlogprob = 1 - e^-20.
  CHECK(kl[1].item<double>() == doctest::Approx(std::exp(-20.0) + 19).epsilon(1e-6));
  CHECK(lp.grad()[1].item<double>() == doctest::Approx(1 - std::exp(-20.0)).epsilon(1e-6));
  // Inside the bound nothing changes: r = -33 clamps, r = 15 does not.
  auto inside = kl_estimate(torch::tensor({-1.0f}), torch::tensor({14.0f}), KLEstimator::k3);
  CHECK(inside.item<double>() == doctest::Approx(std::exp(15.0) - 16).epsilon(1e-6));
  CHECK(std::isfinite(kl[2].item<double>()));
  CHECK(clamp_log_ratio(torch::tensor({std::numeric_limits<float>::infinity()})).item<float>() == 20.0f);
}

TEST_CASE("the per-token loss adds kl_coef * KL, and minimising it lowers the KL") {
  // logprob -1, reference -2: k3 = e^-1 - 1 + 1 = 0.3679, d k3 / d logprob = 1 - e^-1 = 0.6321.
  PolicyLossConfig c;
  c.tis_cap = 0;
  c.kl_coef = 0.5;
  auto lp = torch::tensor({-1.0f, -1.0f}, torch::requires_grad());
  auto t = tokens_with_advantages(lp, torch::tensor({0.0f, 1.0f}));
  t.ref_logprob = torch::full({2}, -2.0f);
  auto r = policy_loss(t, c, /*normalizer=*/2);
  // Token 0: 0 + 0.5 * 0.3679; token 1: -1 + 0.5 * 0.3679 (subtracting the KL gives -0.6840).
  CHECK(r.loss.item<double>() == doctest::Approx((0.5 * 0.367879 + (-1 + 0.5 * 0.367879)) / 2).epsilon(1e-5));
  CHECK(r.kl_sum == doctest::Approx(2 * 0.367879).epsilon(1e-5));
  r.loss.backward();
  CHECK(lp.grad()[0].item<double>() == doctest::Approx(0.5 * 0.632121 / 2).epsilon(1e-5));
  // Gradient descent on the loss (advantage 0: the KL term alone) moves toward the reference.
  auto stepped = lp.detach() - 0.5 * lp.grad();
  CHECK(kl_estimate(stepped, t.ref_logprob, KLEstimator::k3)[0].item<double>() < 0.367879);
  CHECK(stepped[0].item<float>() < -1.0f);
}

TEST_CASE("PPO objective min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A), token by token") {
  PolicyLossConfig c;  // clip_low 0.2, clip_high 0.28: ratio in [0.8, 1.28]
  c.tis_cap = 0;
  REQUIRE(c.clip_low == 0.2);
  REQUIRE(c.clip_high == 0.28);
  struct Case {
    float ratio, advantage;
    double objective;  // the right value; the wrong ones it rules out in the comment
  };
  for (auto [ratio, advantage, objective] : {
           Case{1.25f, 1.0f, 1.25},    // bounds swapped (0.72 .. 1.2): 1.2
           Case{0.75f, -1.0f, -0.8},   // bounds swapped: -0.75
           Case{1.5f, 1.0f, 1.28},     // max instead of min: 1.5; swapped: 1.2
           Case{0.5f, -1.0f, -0.8},    // swapped: -0.72; no clipping: -0.5
           Case{0.5f, 1.0f, 0.5},      // max instead of min: 0.8
           Case{1.5f, -1.0f, -1.5},    // max: -1.28
           Case{1.25f, 2.0f, 2.5},     // ratio inverted (exp(old - new)): 1.6
       }) {
    CAPTURE(ratio);
    CAPTURE(advantage);
    auto lp = torch::log(torch::tensor({ratio}));
    PolicyTokens t = tokens_with_advantages(lp, torch::tensor({advantage}));
    t.old_logprob = torch::zeros({1});
    auto r = policy_loss(t, c, 1.0);
    CHECK(r.loss.item<double>() == doctest::Approx(-objective).epsilon(1e-5));  // the loss is its negative
  }
}

TEST_CASE("a policy far from pi_old: the ratio's log is clamped at 20, so loss and gradient stay finite") {
  PolicyLossConfig c;
  c.tis_cap = 0;
  // log-ratio 100 with A < 0: the unclipped term -e^100 * A would be inf; clamped: e^20.
  auto lp = torch::tensor({100.0f}, torch::requires_grad());
  PolicyTokens t = tokens_with_advantages(lp, torch::tensor({-1.0f}));
  t.old_logprob = torch::zeros({1});
  auto r = policy_loss(t, c, 1.0);
  r.loss.backward();
  CHECK(r.loss.item<double>() == doctest::Approx(std::exp(20.0)).epsilon(1e-6));
  CHECK(lp.grad().item<double>() == doctest::Approx(std::exp(20.0)).epsilon(1e-6));  // -A * ratio, still pushing down
  // log-ratio 100 with A > 0: clipped at 1.28, no gradient and no NaN (0 * inf).
  auto lp2 = torch::tensor({100.0f}, torch::requires_grad());
  PolicyTokens u = tokens_with_advantages(lp2, torch::tensor({1.0f}));
  u.old_logprob = torch::zeros({1});
  auto r2 = policy_loss(u, c, 1.0);
  r2.loss.backward();
  CHECK(r2.loss.item<double>() == doctest::Approx(-1.28).epsilon(1e-6));
  CHECK(lp2.grad().item<float>() == 0.0f);
}

TEST_CASE("GRPO: eps is added to the std, not inside a square root, and non-finite rewards are refused by name") {
  // Rewards {0, 1e-6}: mean 5e-7, std 5e-7 -> A = +-5e-7 / (5e-7 + 1e-6) = +-1/3
  // (sqrt(var + eps) would give +-5e-4; no normalisation +-5e-7).
  auto a = grpo_advantages(torch::tensor({0.0f, 1e-6f}), 2, true);
  CHECK(a[0].item<double>() == doctest::Approx(-1.0 / 3).epsilon(1e-3));
  CHECK(a[1].item<double>() == doctest::Approx(1.0 / 3).epsilon(1e-3));
  auto nan = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH_AS(grpo_advantages(torch::tensor({1.0f, 0.0f, nan, 1.0f}), 2, true),
                       doctest::Contains("reward 2 is nan"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(grpo_advantages(torch::tensor({std::numeric_limits<float>::infinity(), 0.0f}), 2, false),
                       doctest::Contains("reward 0 is inf"), std::invalid_argument);
}

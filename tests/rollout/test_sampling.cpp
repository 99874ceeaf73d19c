// Batched sampling (actors/rollout/sampling.hpp): inverse-CDF draws follow the distribution,
// top-k / top-p never leave their set, log-probs and entropy are of the untruncated tempered
// distribution, a request's seed picks the same token on the CPU and on a GPU, and its draws
// depend on its seed and token index alone.
#include <doctest/doctest.h>

#include <cmath>
#include <set>

#include "../test_util.hpp"
#include "actors/rollout/sampling.hpp"

using namespace kiln::rollout;

namespace {
// n draws of one request (seed seed0) at token indices 0 .. n-1.
std::vector<int64_t> draw(const torch::Tensor& logits, const SamplingParams& params, int n, uint64_t seed0) {
  std::vector<int64_t> out;
  SamplingParams p = params;
  p.seed = seed0;
  std::vector<const SamplingParams*> ps(std::size_t(n), &p);
  std::vector<int64_t> steps;
  for (int i = 0; i < n; ++i) steps.push_back(i);
  for (auto& s : sample_tokens(logits.unsqueeze(0).expand({n, logits.size(0)}), ps, steps)) out.push_back(s.token);
  return out;
}

// |frequency - p| within 5 standard deviations of a frequency over n draws. (doctest::Approx
// is no substitute: its epsilon scales with 1 + |value|, so epsilon(0.1) passes 0.338 for 0.475.)
bool within_5_sigma(double frequency, double p, int n) {
  return std::abs(frequency - p) <= 5 * std::sqrt(p * (1 - p) / n);
}

// How many of n draws are not `token`.
int draws_other_than(int64_t token, const torch::Tensor& logits, const SamplingParams& p, int n, uint64_t seed0) {
  int others = 0;
  for (auto t : draw(logits, p, n, seed0)) others += t != token;
  return others;
}
}  // namespace

TEST_CASE("inverse-CDF sampling follows the tempered distribution") {
  auto logits = torch::tensor({2.0f, 0.0f, 1.0f, -1.0f, 0.5f});
  SamplingParams p;
  p.temperature = 0.8;
  auto probs = torch::softmax(logits / 0.8, -1);
  const int n = 40000;
  auto tokens = draw(logits, p, n, 7);
  std::vector<double> freq(5, 0);
  for (auto t : tokens) freq[std::size_t(t)] += 1.0 / n;
  for (int v = 0; v < 5; ++v) {
    CAPTURE(v);
    CAPTURE(freq[std::size_t(v)]);
    CHECK(within_5_sigma(freq[std::size_t(v)], probs[v].item<double>(), n));
  }
  auto s = sample_token(logits, p, 0);
  CHECK(s.logprob == doctest::Approx(std::log(probs[s.token].item<double>())).epsilon(1e-5));
  CHECK(s.entropy == doctest::Approx(-(probs * probs.log()).sum().item<double>()).epsilon(1e-5));
}

TEST_CASE("top-k and top-p draw only from their sets, and greedy takes the arg-max") {
  auto logits = torch::tensor({3.0f, 2.9f, 0.0f, -1.0f, 2.8f, -5.0f});
  SamplingParams k2;
  k2.top_k = 2;
  for (auto t : draw(logits, k2, 2000, 100)) CHECK((t == 0 || t == 1));
  SamplingParams p;  // softmax: 0.36, 0.33, 0.018, 0.0066, 0.30, 0.0002 -> top_p 0.5 keeps {0, 1}
  p.top_p = 0.5;
  for (auto t : draw(logits, p, 2000, 200)) CHECK((t == 0 || t == 1));
  SamplingParams greedy;
  greedy.temperature = 0;
  for (auto t : draw(logits, greedy, 10, 300)) CHECK(t == 0);
}

TEST_CASE("a top_p below fp32's range keeps the top token (it kept nothing and failed the step), beside a normal row") {
  auto logits = torch::tensor({3.0f, 2.9f, 0.0f, -1.0f, 2.8f, -5.0f});
  SamplingParams tiny, plain;
  tiny.top_p = 1e-300;  // 0 in fp32
  tiny.seed = 5;
  plain.seed = 5;
  for (int64_t step = 0; step < 50; ++step) {
    auto two = sample_tokens(torch::stack({logits, logits}), {&tiny, &plain}, {step, step});
    CHECK(two[0].token == 0);
    CHECK(two[1].token == sample_token(logits, plain, step).token);  // its neighbour draws as alone
  }
  // A temperature that overflows logits / temperature is refused, 0 (greedy) is not.
  SamplingParams cold;
  cold.temperature = 1e-300;
  CHECK_THROWS_WITH_AS(cold.validate(), doctest::Contains("temperature must be 0 (greedy) or >= 1e-5"),
                       std::invalid_argument);
  cold.temperature = 0;
  CHECK_NOTHROW(cold.validate());
}

TEST_CASE("top-k and top-p draw every token of their set in proportion to its probability") {
  // A set one too small ({0}: k - 1, or top-p keeping tokens while the mass *including* them is
  // < p) or one too large ({0, 1, 4}) changes these frequencies.
  auto logits = torch::tensor({3.0f, 2.9f, 0.0f, -1.0f, 2.8f, -5.0f});
  auto probs = torch::softmax(logits, 0);
  const double p0 = probs[0].item<double>(), p1 = probs[1].item<double>();
  const int n = 4000;
  auto frequency_of_1 = [&](const SamplingParams& params, uint64_t seed) {
    double f = 0;
    for (auto t : draw(logits, params, n, seed)) f += (t == 1) / double(n);
    return f;
  };
  SamplingParams k2;
  k2.top_k = 2;
  const double want = p1 / (p0 + p1);  // 0.475; {0, 1, 4} would give 0.332, {0} 0
  const double f_k = frequency_of_1(k2, 400);
  CAPTURE(f_k);
  CHECK(within_5_sigma(f_k, want, n));
  SamplingParams p;
  p.top_p = 0.5;
  const double f_p = frequency_of_1(p, 500);
  CAPTURE(f_p);
  CHECK(within_5_sigma(f_p, want, n));
}

TEST_CASE("top-p is taken over the tempered distribution: logits [3, 2, 1], T 0.5, top_p 0.8 draw only token 0") {
  // Tempered: softmax([6, 4, 2]) = 0.867, 0.117, 0.016 -> the nucleus is {0}. Untempered:
  // 0.665, 0.245, 0.090 -> {0, 1}, and token 1 would be drawn ~12% of the time.
  auto logits = torch::tensor({3.0f, 2.0f, 1.0f});
  SamplingParams p;
  p.temperature = 0.5;
  p.top_p = 0.8;
  CHECK(draws_other_than(0, logits, p, 2000, 600) == 0);
}

TEST_CASE("top-p after top-k renormalises over the top-k set") {
  // top_k 2 keeps 0.358 and 0.324, renormalised 0.525 and 0.475: top_p 0.5 keeps token 0 only.
  // Against the untruncated mass (token 1 starts at 0.358 < 0.5) it would keep both.
  auto logits = torch::tensor({3.0f, 2.9f, 0.0f, -1.0f, 2.8f, -5.0f});
  SamplingParams p;
  p.top_k = 2;
  p.top_p = 0.5;
  CHECK(draws_other_than(0, logits, p, 2000, 700) == 0);
}

TEST_CASE("CUDA: a seed samples the same token on the GPU as on the CPU") {
  if (kiln::test::skip_without_gpu()) return;
  torch::manual_seed(3);
  auto logits = 2 * torch::randn({16, 1000});
  SamplingParams p;
  p.top_p = 0.9;
  std::vector<SamplingParams> rows(16, p);
  std::vector<const SamplingParams*> ps;
  std::vector<int64_t> steps;
  for (int i = 0; i < 16; ++i) {
    rows[std::size_t(i)].seed = uint64_t(i);
    ps.push_back(&rows[std::size_t(i)]);
    steps.push_back(i % 3);
  }
  for (bool kernel : {true, false}) {  // the CUDA kernel, and the LibTorch reference on the GPU
    CAPTURE(kernel);
    auto cpu = sample_tokens(logits, ps, steps), gpu = sample_tokens(logits.to(torch::kCUDA), ps, steps, kernel);
    int same = 0;
    for (int i = 0; i < 16; ++i) {
      same += cpu[std::size_t(i)].token == gpu[std::size_t(i)].token;
      CHECK(gpu[std::size_t(i)].entropy == doctest::Approx(cpu[std::size_t(i)].entropy).epsilon(1e-4));
    }
    CHECK(same >= 15);  // a token may differ only where cumulative sums round differently at a boundary
  }
}

TEST_CASE("a request's draw depends on its seed and token index only, not on its row or neighbours") {
  torch::manual_seed(5);
  auto logits = torch::randn({1, 50});
  SamplingParams a, b;
  a.seed = 42;
  b.seed = 43;
  auto alone = sample_tokens(logits, {&a}, {7})[0];
  auto in_batch = sample_tokens(torch::cat({torch::randn({1, 50}), logits, torch::randn({1, 50})}), {&b, &a, &b}, {0, 7, 3})[1];
  CHECK(alone.token == in_batch.token);
  CHECK(alone.logprob == in_batch.logprob);
  // Another token index or seed draws another uniform: over 200 indices the tokens are not all one.
  std::set<int64_t> seen;
  for (int64_t n = 0; n < 200; ++n) seen.insert(sample_tokens(logits, {&a}, {n})[0].token);
  CHECK(seen.size() > 5);
  CHECK_THROWS_AS(sample_tokens(logits, {&a}, {}), std::invalid_argument);
}

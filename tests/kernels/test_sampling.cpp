// Batched sampling (kernels/sampling.hpp) and its counter-based generator (kernels/philox.hpp):
// Philox against Random123's known answers; the LibTorch reference's draws against the
// distribution (CPU); the CUDA kernel against the reference on fresh random logits of the
// vocabulary's size (tokens, log-probs, entropies), at ties and peaks, run to run, and inside a
// CUDA graph; past the kernel's vocabulary, the reference.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <cmath>
#include <vector>

#include "kernels/cuda_graph.hpp"
#include "kernels/philox.hpp"
#include "kernels/sampling.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::skip_without_cuda_kernels;

namespace {

struct Rows {
  torch::Tensor temperature, top_k, top_p, seed, step;
  Rows to(const torch::Device& d) const {
    return Rows{temperature.to(d), top_k.to(d), top_p.to(d), seed.to(d), step.to(d)};
  }
};

// B rows of the same parameters, seeds seed0 + b, token index `step`.
Rows same_rows(int64_t B, double t, int64_t k, double p, int64_t seed0, int64_t step = 0) {
  return Rows{torch::full({B}, t, torch::kFloat64), torch::full({B}, k, torch::kInt64),
              torch::full({B}, p, torch::kFloat64), torch::arange(seed0, seed0 + B, torch::kInt64),
              torch::full({B}, step, torch::kInt64)};
}

torch::Tensor sample(const torch::Tensor& logits, const Rows& r, bool ref) {
  return ref ? kernels::sample_rows_ref(logits, r.temperature, r.top_k, r.top_p, r.seed, r.step)
             : kernels::sample_rows(logits, r.temperature, r.top_k, r.top_p, r.seed, r.step);
}

bool within_5_sigma(double frequency, double p, int n) { return std::abs(frequency - p) <= 5 * std::sqrt(p * (1 - p) / n); }

// Frequencies of tokens 0 and 1 over n rows of one logits vector.
std::pair<double, double> frequencies(const torch::Tensor& logits_V, const Rows& r, bool ref) {
  const int64_t n = r.seed.size(0);
  auto out = sample(logits_V.unsqueeze(0).expand({n, logits_V.size(0)}).contiguous(), r, ref).cpu();
  auto tok = out.select(1, 0);
  return {(tok == 0).sum().item<double>() / double(n), (tok == 1).sum().item<double>() / double(n)};
}

}  // namespace

TEST_CASE("Philox4x32-10 gives Random123's known answers, and uniforms from 0 to below 1 of mean 1/2") {
  auto a = kernels::philox4x32_10(0, 0, 0, 0, 0, 0);
  CHECK(a.v[0] == 0x6627e8d5u);
  CHECK(a.v[1] == 0xe169c58du);
  CHECK(a.v[2] == 0xbc57ac4cu);
  CHECK(a.v[3] == 0x9b00dbd8u);
  auto b = kernels::philox4x32_10(~0u, ~0u, ~0u, ~0u, ~0u, ~0u);
  CHECK(b.v[0] == 0x408f276du);
  CHECK(b.v[1] == 0x41c83b0eu);
  CHECK(b.v[2] == 0xa20bc7c6u);
  CHECK(b.v[3] == 0x6d5451fdu);
  auto c = kernels::philox4x32_10(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u);
  CHECK(c.v[0] == 0xd16cfe09u);
  CHECK(c.v[3] == 0x24126ea1u);
  double sum = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    const float u = kernels::philox_uniform(12345, uint64_t(i));
    REQUIRE(u >= 0.f);
    REQUIRE(u < 1.f);
    sum += u;
  }
  CHECK(std::abs(sum / n - 0.5) < 5 * std::sqrt(1.0 / 12 / n));
  CHECK(kernels::philox_uniform(1, 0) != kernels::philox_uniform(2, 0));
  CHECK(kernels::philox_uniform(1, 0) != kernels::philox_uniform(1, 1));
  CHECK(kernels::philox_uniform(uint64_t(1) << 32, 0) != kernels::philox_uniform(0, 0));  // the seed's high word counts
}

TEST_CASE("sampling reference: frequencies follow the tempered, filtered distribution (CPU)") {
  auto logits = torch::tensor({3.0f, 2.9f, 0.0f, -1.0f, 2.8f, -5.0f});
  const int n = 4000;
  auto probs = torch::softmax(logits / 0.8, 0);
  auto [f0, f1] = frequencies(logits, same_rows(n, 0.8, 0, 1.0, 11), /*ref=*/true);
  CHECK(within_5_sigma(f0, probs[0].item<double>(), n));
  CHECK(within_5_sigma(f1, probs[1].item<double>(), n));
  auto p = torch::softmax(logits, 0);
  const double want1 = p[1].item<double>() / (p[0].item<double>() + p[1].item<double>());
  for (auto [k, top_p] : {std::pair<int64_t, double>{2, 1.0}, {0, 0.5}}) {
    CAPTURE(k);
    CAPTURE(top_p);
    auto [g0, g1] = frequencies(logits, same_rows(n, 1.0, k, top_p, 1000 + k), true);
    CHECK(g0 + g1 == doctest::Approx(1.0));  // nothing outside {0, 1}
    CHECK(within_5_sigma(g1, want1, n));
  }
  // Greedy: the arg-max with the T = 1 log-prob.
  auto out = sample(logits.unsqueeze(0), same_rows(1, 0.0, 0, 1.0, 5), true);
  CHECK(out[0][0].item<double>() == 0);
  CHECK(out[0][1].item<double>() == doctest::Approx(torch::log_softmax(logits, 0)[0].item<double>()).epsilon(1e-6));
}

TEST_CASE("CUDA: the sampling kernel draws the reference's tokens, log-probs and entropies") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(17);
  const torch::Device dev(torch::kCUDA);
  for (int64_t V : {7, 1000, 154880}) {
    CAPTURE(V);
    const int64_t B = 96;
    auto logits = (3 * torch::randn({B, V})).to(dev);
    // Every kind of row: greedy, plain temperatures, top-k (1, 50, V - 1), top-p, both.
    std::vector<double> t, p;
    std::vector<int64_t> k, seed, step;
    for (int64_t b = 0; b < B; ++b) {
      const int kind = int(b % 8);
      t.push_back(kind == 0 ? 0.0 : kind == 1 ? 1.0 : kind == 2 ? 0.7 : 1.3);
      k.push_back(kind == 3 ? 1 : kind == 4 ? std::min<int64_t>(50, V - 1) : kind == 7 ? V - 1 : kind == 6 ? 20 : 0);
      p.push_back(kind == 5 ? 0.9 : kind == 6 ? 0.5 : 1.0);
      seed.push_back(1000 + b);
      step.push_back(b * 3);
    }
    Rows rows{torch::tensor(t, torch::kFloat64), torch::tensor(k, torch::kInt64), torch::tensor(p, torch::kFloat64),
              torch::tensor(seed, torch::kInt64), torch::tensor(step, torch::kInt64)};
    if (V == 1000) logits.index_put_({torch::indexing::Slice(), torch::indexing::Slice(0, 100)}, -INFINITY);  // masked
    auto ref = sample(logits.cpu(), rows, /*ref=*/true);
    auto got = sample(logits, rows.to(dev), /*ref=*/false);
    auto again = sample(logits, rows.to(dev), false);
    CHECK(torch::equal(got, again));  // fixed reduction orders: the same bits every run
    got = got.cpu();
    REQUIRE(got.sizes() == ref.sizes());
    REQUIRE(torch::isfinite(got).all().item<bool>());
    int same = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t tok = int64_t(got[b][0].item<double>());
      REQUIRE(tok >= 0);
      REQUIRE(tok < V);
      same += tok == int64_t(ref[b][0].item<double>());
      // The log-prob of whichever token was drawn, from the tempered untruncated distribution.
      const double T = t[std::size_t(b)] > 0 ? t[std::size_t(b)] : 1.0;
      auto logp = torch::log_softmax(logits[b].cpu().to(torch::kFloat64) / T, 0);
      CHECK(got[b][1].item<double>() == doctest::Approx(logp[tok].item<double>()).epsilon(1e-4));
      CHECK(got[b][2].item<double>() == doctest::Approx(ref[b][2].item<double>()).epsilon(1e-4));
      if (k[std::size_t(b)] > 0 && k[std::size_t(b)] < V && t[std::size_t(b)] > 0) {  // inside the top-k set
        auto kth = std::get<0>(logits[b].cpu().topk(k[std::size_t(b)])).min().item<float>();
        CHECK(logits[b][tok].item<float>() >= kth);
      }
    }
    CAPTURE(same);
    CHECK(same >= B - 2);  // a token may differ only where cumulative sums round differently at a boundary
  }
}

TEST_CASE("CUDA: the sampling kernel at ties and peaks draws the reference's tokens, and a row past its vocabulary falls back") {
  if (skip_without_cuda_kernels()) return;
  const torch::Device dev(torch::kCUDA);
  const int64_t V = 154880, B = 40;
  auto logits = torch::zeros({B, V});
  std::vector<double> t, p;
  std::vector<int64_t> k, only;  // only: the one token a row can draw (-1: any)
  for (int64_t b = 0; b < B; ++b) {
    const int kind = int(b % 8);
    auto row = logits[b];
    int64_t one = -1;
    if (kind == 2 || kind == 3) {  // one finite logit: the rest masked
      one = (b * 7919) % V;
      row.fill_(-INFINITY);
      row[one] = 1.5f;
    } else if (kind == 4 || kind == 5) {  // ten large logits over noise: the nucleus is theirs
      row.copy_(torch::randn({V}));
      row.index_put_({torch::arange(b, V, V / 10)}, 25.0f);
    } else if (kind == 6 || kind == 7) {  // three tied maxima: top-k 2 keeps all three
      row.copy_(torch::randn({V}) - 10);
      row.index_put_({torch::tensor({int64_t(5), b * 100, V - 1})}, 4.0f);
    }  // kinds 0, 1: every logit equal (all tied: top-k and top-p keep the whole row)
    t.push_back(kind % 2 ? 1.0 : 0.8);
    k.push_back(kind == 0 ? 50 : kind == 3 ? 5 : kind == 6 || kind == 7 ? 2 : 0);
    p.push_back(kind == 1 ? 0.3 : kind == 2 || kind == 4 ? 0.9 : kind == 5 ? 0.2 : kind == 7 ? 0.5 : 1.0);
    only.push_back(one);
  }
  Rows rows{torch::tensor(t, torch::kFloat64), torch::tensor(k, torch::kInt64), torch::tensor(p, torch::kFloat64),
            torch::arange(500, 500 + B, torch::kInt64), torch::arange(0, B, torch::kInt64)};
  REQUIRE(kernels::sample_rows_uses_kernel(logits.to(dev)));
  auto ref = sample(logits, rows, /*ref=*/true);
  auto got = sample(logits.to(dev), rows.to(dev), /*ref=*/false).cpu();
  int same = 0;
  for (int64_t b = 0; b < B; ++b) {
    CAPTURE(b);
    const int64_t tok = int64_t(got[b][0].item<double>()), want = int64_t(ref[b][0].item<double>());
    if (b % 8 < 2)  // a flat row: the reference's fp32 cumsum of 154880 equal terms drifts a few tokens
      CHECK(std::abs(tok - want) <= V / 1000);
    else
      same += tok == want;
    if (only[std::size_t(b)] >= 0) CHECK(tok == only[std::size_t(b)]);
    if (b % 8 == 4 || b % 8 == 5) CHECK(logits[b][tok].item<float>() == 25.0f);
    if (b % 8 == 6 || b % 8 == 7) CHECK(logits[b][tok].item<float>() == 4.0f);
    CHECK(got[b][1].item<double>() == doctest::Approx(ref[b][1].item<double>()).epsilon(1e-4));
  }
  CAPTURE(same);
  CHECK(same >= B - B / 4 - 1);  // the 30 rows past the flat ones
  // Past the kernel's vocabulary (each CTA's slice in shared memory), sample_rows is the reference.
  auto wide = torch::randn({2, 400000});
  Rows two = same_rows(2, 1.0, 0, 0.9, 3);
  CHECK_FALSE(kernels::sample_rows_uses_kernel(wide.to(dev)));
  CHECK(torch::equal(sample(wide.to(dev), two.to(dev), false), sample(wide.to(dev), two.to(dev), true)));
}

TEST_CASE("CUDA: the sampling kernel's frequencies follow the distribution, top-k and top-p sets included") {
  if (skip_without_cuda_kernels()) return;
  const torch::Device dev(torch::kCUDA);
  auto logits = torch::tensor({3.0f, 2.9f, 0.0f, -1.0f, 2.8f, -5.0f}).to(dev);
  const int n = 8000;
  auto probs = torch::softmax(logits.cpu() / 1.3, 0);
  auto [f0, f1] = frequencies(logits, same_rows(n, 1.3, 0, 1.0, 3).to(dev), /*ref=*/false);
  CHECK(within_5_sigma(f0, probs[0].item<double>(), n));
  CHECK(within_5_sigma(f1, probs[1].item<double>(), n));
  auto p = torch::softmax(logits.cpu(), 0);
  const double want1 = p[1].item<double>() / (p[0].item<double>() + p[1].item<double>());
  for (auto [k, top_p] : {std::pair<int64_t, double>{2, 1.0}, {0, 0.5}, {3, 0.6}}) {
    CAPTURE(k);
    CAPTURE(top_p);
    // One seed, n token indices: the counter draws independent uniforms too.
    Rows r = same_rows(n, 1.0, k, top_p, 77);
    r.seed.fill_(77);
    r.step = torch::arange(n, torch::kInt64);
    auto [g0, g1] = frequencies(logits, r.to(dev), false);
    CHECK(g0 + g1 == doctest::Approx(1.0));  // nothing outside {0, 1}
    CHECK(within_5_sigma(g1, want1, n));
  }
}

TEST_CASE("CUDA: the sampling kernel captured in a CUDA graph draws as it does eagerly, inputs rewritten between replays") {
  if (skip_without_cuda_kernels()) return;
  const torch::Device dev(torch::kCUDA);
  const int64_t B = 16, V = 32000;
  auto logits = torch::empty({B, V}, torch::TensorOptions().device(dev));
  Rows rows = same_rows(B, 1.0, 40, 0.95, 9).to(dev);
  torch::Tensor out;
  kernels::CapturedGraph graph(dev, kernels::GraphPool::make(), [&] { out = sample(logits, rows, false); });
  for (int i = 0; i < 3; ++i) {
    logits.copy_(2 * torch::randn({B, V}));
    rows.step.fill_(i * 5);
    rows.temperature.fill_(0.5 + i * 0.4);
    graph.replay();
    auto eager = sample(logits, rows, false);
    CHECK(torch::equal(out, eager));
  }
}

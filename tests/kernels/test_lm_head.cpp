// The log-prob head's GEMM with the row statistics in its epilogue (kernels/lm_head.hpp, running
// both schedules of kernels/lm_head_sm90.cuh, kernels/lm_head_sm90.cu with the row merge and
// kernels/lm_head_sm90_pingpong.cu, through kernels/lm_head_cuda.hpp with scratch from
// kernels/stream_scratch.hpp, on a Hopper GPU): against
// the LibTorch reference (cuBLAS fp32 logits, logsumexp) and an fp64 logsumexp, at a small head
// with ragged tiles and at GLM-4.7-Flash's; its refusals; the reference on CPU. The backward from
// the kept probabilities (lm_head_probs_backward) against fp64 autograd on CPU, and its refusal of
// a clamped row. The targets' log-probs (kernels/lm_head_targets.cu, any CUDA GPU) against fp64
// and their composite.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels/lm_head.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;

namespace {
torch::TensorOptions bf16_on(torch::Device d) { return torch::TensorOptions().device(d).dtype(torch::kBFloat16); }
}  // namespace

TEST_CASE("lm head reference: bf16 probabilities against each row's reference, the fp32 logits' logsumexp and the stored values' (CPU)") {
  torch::manual_seed(21);
  auto h = torch::randn({5, 16}, bf16_on(torch::kCPU)), w = torch::randn({40, 16}, bf16_on(torch::kCPU));
  auto probs = torch::empty({5, 40}, bf16_on(torch::kCPU));
  auto reference = torch::tensor({0.f, 3.f, -2.f, 10.f, -60.f});  // the last row's values all past 2^64
  auto [lse, kept_lse] = kernels::lm_head_probs_lse_ref(h, w, reference, probs);
  auto z = torch::mm(h.to(torch::kFloat64), w.to(torch::kFloat64).t());
  CHECK((lse.to(torch::kFloat64) - z.logsumexp(1)).abs().max().item<double>() <= 1e-4);
  const auto want = (z - reference.to(torch::kFloat64).unsqueeze(1)).exp().clamp_max(std::pow(2.0, 64));
  CHECK(torch::equal(probs, want.to(torch::kFloat32).to(torch::kBFloat16)));
  CHECK(probs[4].to(torch::kFloat64).eq(std::pow(2.0, 64)).all().item<bool>());
  const auto sum = probs.to(torch::kFloat64).sum(1).log() + reference.to(torch::kFloat64);
  CHECK((kept_lse.to(torch::kFloat64) - sum).abs().max().item<double>() <= 1e-4);
  // The targets' log-probs: the target's logit minus the lse, 0 for a target outside [0, V).
  auto targets = torch::tensor({3, -1, 39, 40, 7});
  auto lp = kernels::lm_head_target_logprobs(h, w, targets, lse).to(torch::kFloat64);
  auto want_lp = z.gather(1, targets.clamp(0, 39).unsqueeze(1)).squeeze(1) - lse.to(torch::kFloat64);
  const auto valid = torch::tensor({true, false, true, false, true});
  CHECK((lp - want_lp).masked_fill(valid.logical_not(), 0).abs().max().item<double>() <= 1e-4);
  CHECK(lp[1].item<double>() == 0);
  CHECK(lp[3].item<double>() == 0);
  CHECK_THROWS_WITH_AS(kernels::lm_head_target_logprobs(h, w, targets.narrow(0, 0, 4), lse),
                       doctest::Contains("targets [5] int64 and lse [5] fp32 expected, got [4]"), c10::Error);
  CHECK_FALSE(kernels::lm_head_fused_available(h, w));  // CPU tensors: never the fused kernel
  CHECK_THROWS_WITH_AS(kernels::lm_head_probs_lse(h, w, reference, probs),
                       doctest::Contains("no fused kernel for hidden [5, 16]"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::lm_head_probs_lse(h, w, reference.narrow(0, 0, 4), probs),
                       doctest::Contains("reference must be [5] fp32"), c10::Error);
}

namespace {
// log p = log_softmax(h w^T)[target] in fp64 with its gradients against g (0 for a target
// outside [0, V)).
std::vector<torch::Tensor> fp64_logprob_grads(const torch::Tensor& h, const torch::Tensor& w,
                                              const torch::Tensor& targets, const torch::Tensor& g) {
  const int64_t V = w.size(0);
  auto hd = h.to(torch::kFloat64).requires_grad_(), wd = w.to(torch::kFloat64).requires_grad_();
  const auto valid = targets.ge(0).logical_and(targets.lt(V));
  auto lp = torch::log_softmax(hd.mm(wd.t()), 1).gather(1, targets.clamp(0, V - 1).unsqueeze(1)).squeeze(1) * valid;
  return torch::autograd::grad({(lp * g.to(torch::kFloat64)).sum()}, {hd, wd});
}
}  // namespace

TEST_CASE("lm head backward from the kept probabilities: row-scaled GEMMs give log_softmax's gradients, a clamped row recomputed on its own (CPU)") {
  torch::manual_seed(24);
  const int64_t N = 9, D = 16, V = 50;
  auto h = (torch::randn({N, D}) * 0.7).to(torch::kBFloat16), w = (torch::randn({V, D}) * 0.7).to(torch::kBFloat16);
  // Rows without a target (-1, V), one with g = 0, the rest with targets and gradients.
  auto targets = torch::randint(0, V, {N}, torch::kInt64);
  targets[1] = -1;
  targets[4] = V;
  auto g = torch::randn({N});
  g[6] = 0;
  auto run = [&](const torch::Tensor& tg, const torch::Tensor& gg, torch::ScalarType wdt) {
    auto probs = torch::empty({N, V}, torch::kBFloat16);
    const auto c = kernels::lm_head_target_logits(h, w, tg) + kernels::kProbsReferenceMargin;  // the training head's
    auto [lse, kept_lse] = kernels::lm_head_probs_lse_ref(h, w, c, probs);
    auto before = probs.clone();
    auto r = kernels::lm_head_probs_backward(probs, h, w, tg, c, lse, kept_lse, gg, wdt);
    return std::make_tuple(r, probs, before, (lse - c).to(torch::kFloat64));
  };
  for (auto wdt : {torch::kBFloat16, torch::kFloat32}) {
    CAPTURE(wdt);
    auto [r, probs, before, above] = run(targets, g, wdt);
    CHECK(above.max().item<double>() <= kernels::kProbsMaxLseAboveReference);  // every row from its probabilities
    const auto want = fp64_logprob_grads(h, w, targets, g);
    CHECK((r.first.scalar_type() == torch::kBFloat16));
    CHECK((r.second.scalar_type() == wdt));
    CHECK(kiln::test::rel_error(r.first.to(torch::kFloat64), want[0]) <= 1e-2);
    CHECK(kiln::test::rel_error(r.second.to(torch::kFloat64), want[1]) <= 1e-2);
    // Rows without a gradient contribute nothing; the probabilities changed only at the targets.
    CHECK(r.first[1].eq(0).all().item<bool>());
    CHECK(r.first[4].eq(0).all().item<bool>());
    CHECK(r.first[6].eq(0).all().item<bool>());
    const auto changed = probs.ne(before);
    CHECK(changed.sum().item<int64_t>() <= N - 2);
    CHECK(changed.logical_and(torch::arange(V).unsqueeze(0).ne(targets.unsqueeze(1))).any().item<bool>() == false);
  }
  // A row with a gradient whose target is ~70 below the others (log-prob < -56): its values
  // pass 2^64 against the target's reference (clamped there), so its kept probabilities are not
  // read; it is recomputed from its fp32 logits, and every row's gradients are still fp64's.
  auto wl = w.clone();
  wl[targets[0].item<int64_t>()].copy_((h[0].to(torch::kFloat32) * (-70.0 / h[0].to(torch::kFloat32).square().sum())));
  std::swap(w, wl);
  for (auto wdt : {torch::kBFloat16, torch::kFloat32}) {
    CAPTURE(wdt);
    auto [r, probs, before, above] = run(targets, g, wdt);
    CHECK(above[0].item<double>() > kernels::kProbsMaxLseAboveReference);
    CHECK(before[0].to(torch::kFloat64).max().item<double>() == std::pow(2.0, 64));
    const auto want = fp64_logprob_grads(h, w, targets, g);
    CHECK((r.second.scalar_type() == wdt));
    CHECK(kiln::test::rel_error(r.first.to(torch::kFloat64), want[0]) <= 1e-2);
    CHECK(kiln::test::rel_error(r.second.to(torch::kFloat64), want[1]) <= 1e-2);
    CHECK(kiln::test::rel_error(r.first[0].to(torch::kFloat64), want[0][0]) <= 1e-2);  // the recomputed row
  }
  {
    // A chunked caller's running sum (grad_weight_into): rows [0, 5) (the recomputed row among
    // them) then [5, N) added in place into one fp32 [V, D] give the whole batch's fp32 weight
    // gradient, each call's hidden rows the whole batch's.
    auto [whole, p0, b0, a0] = run(targets, g, torch::kFloat32);
    auto acc = torch::zeros({V, D});
    const auto before_ptr = acc.data_ptr();
    for (auto [s, n] : {std::pair<int64_t, int64_t>{0, 5}, {5, N - 5}}) {
      const auto hs = h.narrow(0, s, n), tg = targets.narrow(0, s, n);
      auto probs = torch::empty({n, V}, torch::kBFloat16);
      const auto c = kernels::lm_head_target_logits(hs, w, tg) + kernels::kProbsReferenceMargin;
      auto [lse, kept_lse] = kernels::lm_head_probs_lse_ref(hs, w, c, probs);
      auto r = kernels::lm_head_probs_backward(probs, hs, w, tg, c, lse, kept_lse, g.narrow(0, s, n), torch::kFloat32,
                                               acc);
      CHECK(r.second.data_ptr() == before_ptr);  // the sum itself, not a copy
      CHECK(torch::allclose(r.first.to(torch::kFloat32), whole.first.narrow(0, s, n).to(torch::kFloat32), 1e-2, 1e-3));
    }
    CHECK(kiln::test::rel_error(acc.to(torch::kFloat64), whole.second.to(torch::kFloat64)) <= 1e-6);
    CHECK_THROWS_WITH_AS(kernels::lm_head_probs_backward(p0, h, w, targets, torch::zeros({N}), torch::zeros({N}),
                                                         torch::zeros({N}), g, torch::kFloat32,
                                                         torch::zeros({V, D}, torch::kBFloat16)),
                         doctest::Contains("grad_weight_into must be fp32 [50, 16]"), c10::Error);
  }
  std::swap(w, wl);
  CHECK_THROWS_WITH_AS(kernels::lm_head_probs_backward(torch::zeros({N, V}, torch::kBFloat16), h, w, targets,
                                                       torch::zeros({N}), torch::zeros({N}), torch::zeros({N - 1}), g,
                                                       torch::kFloat32),
                       doctest::Contains("must be [9], got [8]"), c10::Error);
}

TEST_CASE("CUDA: the lm head's fused GEMM writes the reference's probabilities and both row sums") {
  if (test::skip_without_cuda_kernels()) return;
  torch::manual_seed(22);
  const torch::Device cuda(torch::kCUDA);
  std::optional<kernels::LmHeadSettingsScope> on(std::in_place, true);  // off again however it ends
  const auto probe = torch::empty({8, 8}, bf16_on(cuda));
  if (test::skip_unless(kernels::lm_head_fused_available(probe, probe),
                        "needs the fused head: a Hopper GPU and a build with CUTLASS"))
    return;
  // Both kernel schedules (cooperative 128x256 tiles, pingpong 128x128); ragged tiles on both
  // sides (700 = 5 x 128 + 60 rows, 1000 = 3 x 256 + 232 = 7 x 128 + 104 columns), then
  // GLM-4.7-Flash's head (V = 154880 = 605 x 256, D = 2048) at 520 rows, and a single row.
  struct Case {
    kernels::LmHeadSchedule schedule;
    int64_t N, D, V;
  };
  constexpr auto coop = kernels::LmHeadSchedule::cooperative, pong = kernels::LmHeadSchedule::pingpong;
  for (auto [schedule, N, D, V] : {Case{coop, 700, 64, 1000}, Case{coop, 520, 2048, 154880}, Case{coop, 1, 8, 8},
                                   Case{pong, 700, 64, 1000}, Case{pong, 520, 2048, 154880}, Case{pong, 1, 8, 8}}) {
    kernels::set_lm_head_schedule(schedule);
    CAPTURE(int(schedule));
    CAPTURE(N);
    CAPTURE(V);
    // |logit| up to ~15, as a trained head's: the exp of each term spans many octaves.
    auto h = torch::randn({N, D}, bf16_on(cuda)), w = (torch::randn({V, D}, bf16_on(cuda)) * (4.0 / std::sqrt(D)));
    // One row's logit at a late column ~70 above the rest (101 log2 units): the epilogue's per-row
    // references, set by a row's first values, must move up (the rescale path), and that row's
    // probabilities against the training head's reference reach the clamp (2^64).
    const int64_t r0 = N / 2, v0 = V - 3;
    w[v0].copy_(h[r0].to(torch::kFloat32).mul(70.0 / h[r0].to(torch::kFloat32).square().sum().item<double>()));
    auto targets = torch::randint(0, V, {N}, torch::TensorOptions().dtype(torch::kInt64).device(cuda));
    if (V > 8) targets[r0] = 0;
    auto z = torch::mm(h.to(torch::kFloat64), w.to(torch::kFloat64).t());
    const auto reference = (z.gather(1, targets.unsqueeze(1)).squeeze(1) + kernels::kProbsReferenceMargin).to(torch::kFloat32);
    auto probs = torch::empty({N, V}, bf16_on(cuda)), want = torch::empty({N, V}, bf16_on(cuda));
    auto [lse, kept_lse] = kernels::lm_head_probs_lse(h, w, reference, probs);
    auto [rlse, rkept] = kernels::lm_head_probs_lse_ref(h, w, reference, want);
    const double e = (lse.to(torch::kFloat64) - z.logsumexp(1)).abs().max().item<double>();
    const auto stored = probs.to(torch::kFloat64);
    const auto stored_lse = stored.sum(1).log() + reference.to(torch::kFloat64);
    const double ek = (kept_lse.to(torch::kFloat64) - stored_lse).abs().max().item<double>();
    MESSAGE("N " << N << " V " << V << ": |lse - fp64| max " << e << ", kept " << ek << " (spiked row's lse "
                  << lse[r0].item<double>() << ")");
    CHECK(lse[r0].item<double>() > 65);
    CHECK(e <= 1e-5 * (1 + rlse.abs().max().item<double>()));
    CHECK(ek <= 1e-5 * (1 + stored_lse.abs().max().item<double>()));
    // Each probability within one bf16 step (2^-7 of its size) of exp(z - c) in fp64, clamped at 2^64.
    const auto exact = (z - reference.to(torch::kFloat64).unsqueeze(1)).exp().clamp_max(std::pow(2.0, 64));
    CHECK((stored - exact).abs().le(exact * (1.0 / 128) + 1e-37).all().item<bool>());
    if (V > 8) CHECK(stored[r0][v0].item<double>() == std::pow(2.0, 64));
    CHECK(probs.ne(want).to(torch::kFloat64).mean().item<double>() <= 1e-2);  // rounding the other way, now and then
    // Run again: the same bits (fresh partial buffers, merged in the same order).
    auto probs2 = torch::empty_like(probs);
    auto [lse2, kept_lse2] = kernels::lm_head_probs_lse(h, w, reference, probs2);
    CHECK(torch::equal(lse2, lse));
    CHECK(torch::equal(kept_lse2, kept_lse));
    CHECK(torch::equal(probs2, probs));
  }
  // Refused by what does not fit.
  auto h = torch::randn({4, 16}, bf16_on(cuda)), w = torch::randn({24, 16}, bf16_on(cuda));
  const auto c = torch::zeros({4}, torch::TensorOptions().device(cuda));
  CHECK_THROWS_WITH_AS(kernels::lm_head_probs_lse(h, w, c, torch::empty({4, 23}, bf16_on(cuda))),
                       doctest::Contains("probs must be [N, V] = [4, 24], got [4, 23]"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::lm_head_probs_lse(h, w, c, torch::empty({4, 24}, torch::TensorOptions().device(cuda))),
                       doctest::Contains("probs must be bf16, contiguous"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::lm_head_probs_lse(h, w, c.cpu(), torch::empty({4, 24}, bf16_on(cuda))),
                       doctest::Contains("reference must be [4] fp32 on cuda"), c10::Error);
  auto w20 = torch::randn({20, 16}, bf16_on(cuda));  // V = 20: not a multiple of 8
  CHECK_THROWS_WITH_AS(kernels::lm_head_probs_lse(h, w20, c, torch::empty({4, 20}, bf16_on(cuda))),
                       doctest::Contains("no fused kernel"), c10::Error);
  on.reset();
  const kernels::LmHeadSettingsScope off(false);  // switched off (KILN_LM_HEAD_FUSED=0): not taken
  CHECK_FALSE(kernels::lm_head_fused_available(h, w));
}

TEST_CASE("CUDA: the backward from the fused GEMM's own probabilities gives log_softmax's gradients") {
  if (test::skip_without_cuda_kernels()) return;
  torch::manual_seed(25);
  const torch::Device cuda(torch::kCUDA);
  const kernels::LmHeadSettingsScope on(true);
  const auto probe = torch::empty({8, 8}, bf16_on(cuda));
  if (test::skip_unless(kernels::lm_head_fused_available(probe, probe),
                        "needs the fused head: a Hopper GPU and a build with CUTLASS"))
    return;
  for (auto schedule : {kernels::LmHeadSchedule::cooperative, kernels::LmHeadSchedule::pingpong}) {
    kernels::set_lm_head_schedule(schedule);
    CAPTURE(int(schedule));
    const int64_t N = 700, D = 64, V = 1000;
    auto h = torch::randn({N, D}, bf16_on(cuda)), w = torch::randn({V, D}, bf16_on(cuda)) * (4.0 / std::sqrt(D));
    auto targets = torch::randint(0, V, {N}, torch::TensorOptions().dtype(torch::kInt64).device(cuda));
    targets[3] = -1;
    auto g = torch::randn({N}, torch::TensorOptions().device(cuda));
    const auto c = kernels::lm_head_target_logits(h, w, targets) + kernels::kProbsReferenceMargin;
    auto probs = torch::empty({N, V}, bf16_on(cuda));
    auto [lse, kept_lse] = kernels::lm_head_probs_lse(h, w, c, probs);
    for (auto wdt : {torch::kBFloat16, torch::kFloat32}) {
      CAPTURE(wdt);
      auto p = probs.clone();
      REQUIRE((lse - c).max().item<double>() <= kernels::kProbsMaxLseAboveReference);  // every row from its probabilities
      auto r = kernels::lm_head_probs_backward(p, h, w, targets, c, lse, kept_lse, g, wdt);
      const auto want = fp64_logprob_grads(h, w, targets, g);
      const double eh = kiln::test::rel_error(r.first, want[0]), ew = kiln::test::rel_error(r.second, want[1]);
      MESSAGE("|grad - fp64| / |fp64|: hidden " << eh << ", weight " << ew);
      CHECK(eh <= 1e-2);
      CHECK(ew <= 1e-2);
      CHECK(r.first[3].eq(0).all().item<bool>());
    }
  }
  kernels::set_lm_head_schedule(kernels::LmHeadSchedule::cooperative);
}

TEST_CASE("CUDA: the targets' log-probs (kernels/lm_head_targets.cu, any CUDA GPU) against fp64 and the composite, from aligned and unaligned rows") {
  if (test::skip_without_cuda_kernels()) return;
  torch::manual_seed(23);
  const torch::Device cuda(torch::kCUDA);
  struct Case {
    int64_t N, D, V;
  };
  for (auto [N, D, V] : {Case{700, 64, 1000}, Case{520, 2048, 154880}, Case{1, 8, 8}}) {
    CAPTURE(N);
    CAPTURE(V);
    auto h = torch::randn({N, D}, bf16_on(cuda)), w = torch::randn({V, D}, bf16_on(cuda)) * (4.0 / std::sqrt(D));
    auto probs = torch::empty({N, V}, bf16_on(cuda));
    const auto lse = kernels::lm_head_probs_lse_ref(h, w, torch::zeros({N}, torch::TensorOptions().device(cuda)), probs)
                         .first;  // [N] fp32
    // A target of -1 and one of V among them: 0 there.
    auto targets = torch::randint(0, V, {N}, torch::TensorOptions().dtype(torch::kInt64).device(cuda));
    targets[0] = -1;
    if (N > 2) targets[N - 1] = V;
    const auto valid = targets.ge(0).logical_and(targets.lt(V));
    const auto z = torch::mm(h.to(torch::kFloat64), w.to(torch::kFloat64).t());
    const auto want = (z.gather(1, targets.clamp(0, V - 1).unsqueeze(1)).squeeze(1) - lse.to(torch::kFloat64))
                          .masked_fill(valid.logical_not(), 0);
    const double tol = 1e-5 * (1 + z.abs().max().item<double>());
    const auto lp = kernels::lm_head_target_logprobs(h, w, targets, lse);
    const double e = (lp.to(torch::kFloat64) - want).abs().max().item<double>();
    MESSAGE("target log-probs: |kernel - fp64| max " << e);
    CHECK(e <= tol);
    CHECK(lp.masked_select(valid.logical_not()).eq(0).all().item<bool>());
    CHECK((lp - kernels::lm_head_target_logprobs_ref(h, w, targets, lse)).abs().max().item<double>() <= tol);
    // Rows that do not start on a 16-byte boundary: copied to aligned memory first, the same bits.
    auto buf = torch::empty({N * D + 1}, bf16_on(cuda));
    auto unaligned = buf.narrow(0, 1, N * D).view({N, D});
    unaligned.copy_(h);
    CHECK(torch::equal(kernels::lm_head_target_logprobs(unaligned, w, targets, lse), lp));
  }
}

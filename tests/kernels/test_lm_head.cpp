// The log-prob head's GEMM with the row statistics in its epilogue (kernels/lm_head.hpp, running
// both schedules of kernels/lm_head_sm90.cuh, kernels/lm_head_sm90.cu with the row merge and
// kernels/lm_head_sm90_pingpong.cu, through kernels/lm_head_cuda.hpp with scratch from
// kernels/stream_scratch.hpp, on a Hopper GPU): against
// the LibTorch reference (cuBLAS fp32 logits, logsumexp) and an fp64 logsumexp, at a small head
// with ragged tiles and at GLM-4.7-Flash's; its refusals; the reference on CPU. The targets'
// log-probs (kernels/lm_head_targets.cu, any CUDA GPU) against fp64 and their composite.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <limits>
#include <optional>

#include "kernels/lm_head.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;

namespace {
torch::TensorOptions bf16_on(torch::Device d) { return torch::TensorOptions().device(d).dtype(torch::kBFloat16); }
}  // namespace

TEST_CASE("lm head reference: bf16 logits and the logsumexps of the fp32 and of the rounded logits (CPU)") {
  torch::manual_seed(21);
  auto h = torch::randn({5, 16}, bf16_on(torch::kCPU)), w = torch::randn({40, 16}, bf16_on(torch::kCPU));
  auto logits = torch::empty({5, 40}, bf16_on(torch::kCPU));
  auto [lse, kept_lse] = kernels::lm_head_logits_lse_ref(h, w, logits);
  auto z = torch::mm(h.to(torch::kFloat64), w.to(torch::kFloat64).t());
  CHECK((lse.to(torch::kFloat64) - z.logsumexp(1)).abs().max().item<double>() <= 1e-4);
  CHECK(torch::equal(logits, z.to(torch::kFloat32).to(torch::kBFloat16)));
  CHECK((kept_lse.to(torch::kFloat64) - logits.to(torch::kFloat64).logsumexp(1)).abs().max().item<double>() <= 1e-4);
  // The targets' log-probs: the target's logit minus the lse, 0 for a target outside [0, V).
  auto targets = torch::tensor({3, -1, 39, 40, 7});
  auto lp = kernels::lm_head_target_logprobs(h, w, targets, lse).to(torch::kFloat64);
  auto want = z.gather(1, targets.clamp(0, 39).unsqueeze(1)).squeeze(1) - lse.to(torch::kFloat64);
  const auto valid = torch::tensor({true, false, true, false, true});
  CHECK((lp - want).masked_fill(valid.logical_not(), 0).abs().max().item<double>() <= 1e-4);
  CHECK(lp[1].item<double>() == 0);
  CHECK(lp[3].item<double>() == 0);
  CHECK_THROWS_WITH_AS(kernels::lm_head_target_logprobs(h, w, targets.narrow(0, 0, 4), lse),
                       doctest::Contains("targets [5] int64 and lse [5] fp32 expected, got [4]"), c10::Error);
  CHECK_FALSE(kernels::lm_head_fused_available(h, w));  // CPU tensors: never the fused kernel
  CHECK_THROWS_WITH_AS(kernels::lm_head_logits_lse(h, w, logits), doctest::Contains("no fused kernel for hidden [5, 16]"),
                       c10::Error);
}

TEST_CASE("CUDA: the lm head's fused GEMM writes the reference's logits and both row logsumexps") {
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
    // One row's logit at a late column ~60 above the rest (86 log2 units): the epilogue's per-row
    // references, set by a row's first values, must move up (the rescale path).
    const int64_t r0 = N / 2, v0 = V - 3;
    w[v0].copy_(h[r0].to(torch::kFloat32).mul(60.0 / h[r0].to(torch::kFloat32).square().sum().item<double>()));
    auto logits = torch::empty({N, V}, bf16_on(cuda)), want = torch::empty({N, V}, bf16_on(cuda));
    auto [lse, kept_lse] = kernels::lm_head_logits_lse(h, w, logits);
    auto [rlse, rkept] = kernels::lm_head_logits_lse_ref(h, w, want);
    auto z = torch::mm(h.to(torch::kFloat64), w.to(torch::kFloat64).t());
    const double e = (lse.to(torch::kFloat64) - z.logsumexp(1)).abs().max().item<double>();
    const double ek = (kept_lse.to(torch::kFloat64) - logits.to(torch::kFloat64).logsumexp(1)).abs().max().item<double>();
    MESSAGE("N " << N << " V " << V << ": |lse - fp64| max " << e << ", kept " << ek << " (spiked row's lse "
                  << lse[r0].item<double>() << ")");
    CHECK(lse[r0].item<double>() > 55);
    CHECK(e <= 1e-5 * (1 + rlse.abs().max().item<double>()));
    CHECK(ek <= 1e-5 * (1 + rkept.abs().max().item<double>()));
    // The same fp32 sums in another order: a bf16 logit may round the other way, by one bf16
    // step at its own size (2^-7 of its magnitude at most), and only now and then.
    const auto got32 = logits.to(torch::kFloat32), want32 = want.to(torch::kFloat32);
    const auto step = want32.abs().clamp_min(1e-30) * (1.0 / 128);
    CHECK((got32 - want32).abs().le(step).all().item<bool>());
    CHECK(logits.ne(want).to(torch::kFloat64).mean().item<double>() <= 1e-2);
    // Run again: the same bits (fresh partial buffers, merged in the same order).
    auto logits2 = torch::empty_like(logits);
    auto [lse2, kept_lse2] = kernels::lm_head_logits_lse(h, w, logits2);
    CHECK(torch::equal(lse2, lse));
    CHECK(torch::equal(kept_lse2, kept_lse));
    CHECK(torch::equal(logits2, logits));
  }
  // Refused by what does not fit.
  auto h = torch::randn({4, 16}, bf16_on(cuda)), w = torch::randn({24, 16}, bf16_on(cuda));
  CHECK_THROWS_WITH_AS(kernels::lm_head_logits_lse(h, w, torch::empty({4, 23}, bf16_on(cuda))),
                       doctest::Contains("logits must be [N, V] = [4, 24], got [4, 23]"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::lm_head_logits_lse(h, w, torch::empty({4, 24}, torch::TensorOptions().device(cuda))),
                       doctest::Contains("logits must be bf16, contiguous"), c10::Error);
  auto w20 = torch::randn({20, 16}, bf16_on(cuda));  // V = 20: not a multiple of 8
  CHECK_THROWS_WITH_AS(kernels::lm_head_logits_lse(h, w20, torch::empty({4, 20}, bf16_on(cuda))),
                       doctest::Contains("no fused kernel"), c10::Error);
  on.reset();
  const kernels::LmHeadSettingsScope off(false);  // switched off (KILN_LM_HEAD_FUSED=0): not taken
  CHECK_FALSE(kernels::lm_head_fused_available(h, w));
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
    auto logits = torch::empty({N, V}, bf16_on(cuda));
    const auto lse = kernels::lm_head_logits_lse_ref(h, w, logits).first;  // [N] fp32
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

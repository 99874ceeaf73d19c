// The log-prob head's forward at GLM-4.7-Flash's head (D = 2048, V = 154880) on a Hopper GPU, the
// two ways kiln can run it, in the same run:
//   cuBLAS + pass: at::mm into fp32 [T, V] (model::lm_logits), then kernels::logprob_chunk_forward
//                  reading it once, keeping bf16 logits for the backward (the default path)
//   fused:         the targets' logits by a dot-product kernel (each row's reference: that logit +
//                  16), then kernels::lm_head_probs_lse (one CUTLASS GEMM writing the bf16
//                  probabilities against the reference and both row sums in its epilogue); in
//                  both kernel schedules (cooperative 128x256 tiles, pingpong 128x128)
// with the GEMM alone (cuBLAS into fp32, into bf16) for scale, and how far the fused results are
// from the default path's: log-probs, lse (fp32 logits), and the kept probabilities' sum against
// the fp32 softmax's (1); and the backward's row scalings (kernels/scale_rows.hpp) against ATen's
// mixed-dtype mul. Prints one table per T.
// Run: build/tests/kernels/kiln_bench_lm_head [T ...]   (default 4096 8192)
#include <ATen/cuda/CUDAContext.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "tests/bench/gpu_seconds.hpp"
#include "kernels/lm_head.hpp"
#include "kernels/logprobs.hpp"
#include "kernels/rms_norm.hpp"
#include "kernels/scale_rows.hpp"

namespace {
template <class F>
double seconds(F&& f, int iters = 20) {
  return kiln::bench::gpu_seconds(f, iters, 3);
}
}  // namespace

int main(int argc, char** argv) {
  using namespace kiln;
  kernels::set_lm_head_fused(true);
  if (!torch::cuda::is_available() || !kernels::built_with_cuda()) {
    std::printf("bench_lm_head: needs a CUDA build and a GPU\n");
    return 2;
  }
  const int64_t D = 2048, V = 154880;
  const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  if (!kernels::lm_head_fused_available(torch::empty({8, D}, bf16), torch::empty({V, D}, bf16))) {
    std::printf("bench_lm_head: no fused head here (needs a Hopper GPU and a build with CUTLASS)\n");
    return 2;
  }
  std::vector<int64_t> Ts;
  for (int i = 1; i < argc; ++i) Ts.push_back(std::atoll(argv[i]));
  if (Ts.empty()) Ts = {4096, 8192};
  std::printf("bench_lm_head: %s, D %lld, V %lld, bf16\n", at::cuda::getCurrentDeviceProperties()->name, (long long)D,
              (long long)V);
  torch::manual_seed(0);
  // A normed hidden state (|h| ~ 1 per element) and a head whose logits span ~[-15, 15].
  auto w = torch::randn({V, D}, bf16) * (4.0 / std::sqrt(double(D)));
  for (int64_t T : Ts) {
    auto h = torch::randn({T, D}, bf16);
    auto targets = torch::randint(0, V, {T}, torch::TensorOptions().dtype(torch::kInt64).device(torch::kCUDA));
    auto kept = torch::empty({T, V}, bf16), kept_fused = torch::empty({T, V}, bf16);
    kernels::KeptStats ks;
    at::Tensor lp, lse, lp_f, lse_f, kept_lse_f;
    const double t_mm32 = seconds([&] { (void)at::mm(h, w.t(), torch::kFloat32); });
    const double t_mm16 = seconds([&] { at::mm_out(kept, h, w.t()); });
    const double t_default = seconds([&] {
      auto z = at::mm(h, w.t(), torch::kFloat32);
      std::tie(lp, lse, std::ignore, std::ignore) = kernels::logprob_chunk_forward(z, targets, false, kept, &ks);
    });
    at::Tensor reference;
    auto fused = [&] {
      const auto z = kernels::lm_head_target_logits(h, w, targets);
      reference = z + kernels::kProbsReferenceMargin;
      std::tie(lse_f, kept_lse_f) = kernels::lm_head_probs_lse(h, w, reference, kept_fused);
      lp_f = z - lse_f;
    };
    kernels::set_lm_head_schedule(kernels::LmHeadSchedule::pingpong);
    const double t_pingpong = seconds(fused);
    const auto lse_pingpong = lse_f.clone();
    kernels::set_lm_head_schedule(kernels::LmHeadSchedule::cooperative);
    const double t_fused = seconds(fused);
    const double t_targets = seconds([&] { (void)kernels::lm_head_target_logprobs(h, w, targets, lse_f); });
    const double t_targets_ref = seconds([&] { (void)kernels::lm_head_target_logprobs_ref(h, w, targets, lse_f); });
    const double flop = 2.0 * double(T) * D * V;
    std::printf("\nT %lld                                  ms    TFLOP/s\n", (long long)T);
    auto row = [&](const char* n, double s) { std::printf("  %-34s %8.3f %8.0f\n", n, s * 1e3, flop / s / 1e12); };
    row("cuBLAS GEMM -> fp32", t_mm32);
    row("cuBLAS GEMM -> bf16", t_mm16);
    row("default: cuBLAS fp32 + log-prob pass", t_default);
    row("fused (cooperative 128x256) + dot", t_fused);
    row("fused (pingpong 128x128) + dot", t_pingpong);
    std::printf("  fused / default: cooperative %.3fx the time (%.3f ms saved), pingpong %.3fx (%.3f ms saved)\n",
                t_fused / t_default, (t_default - t_fused) * 1e3, t_pingpong / t_default, (t_default - t_pingpong) * 1e3);
    std::printf("  target log-probs: kernel %.3f ms, LibTorch composite %.3f ms\n", t_targets * 1e3,
                t_targets_ref * 1e3);
    std::printf("  |lse pingpong - cooperative| max %.2e\n", (lse_pingpong - lse_f).abs().max().item<double>());
    std::printf("  |fused - default|: log-prob max %.2e, lse max %.2e; |kept probabilities' lse - lse| max %.2e\n",
                (lp_f - lp).abs().max().item<double>(), (lse_f - lse).abs().max().item<double>(),
                (kept_lse_f - lse_f).abs().max().item<double>());
    // The backward's two row scalings of [T, D] (kernels::lm_head_probs_backward): the hidden rows
    // (bf16 -> bf16) and the input gradient's fp32 GEMM result (fp32 -> bf16), kernels::scale_rows_out
    // against ATen's mixed-dtype mul (what ran before) and a device copy of the bf16 rows.
    auto a = torch::randn({T}, torch::kCUDA), out16 = torch::empty({T, D}, bf16), g32 = torch::randn({T, D}, torch::kCUDA);
    const double t_s16 = seconds([&] { kernels::scale_rows_out(out16, h, a); });
    const double t_s16_ref = seconds([&] { kernels::scale_rows_out_ref(out16, h, a); });
    const double t_s32 = seconds([&] { kernels::scale_rows_out(out16, g32, a); });
    const double t_s32_ref = seconds([&] { kernels::scale_rows_out_ref(out16, g32, a); });
    const double t_copy = seconds([&] { out16.copy_(h); });
    const double b16 = 2.0 * double(T) * D * 2, b32 = double(T) * D * 6;
    std::printf("  backward row scaling, us (GB/s): bf16 -> bf16 kernel %.1f (%.0f), ATen mul %.1f (%.0f); fp32 -> bf16 "
                "kernel %.1f (%.0f), ATen mul %.1f (%.0f); bf16 copy %.1f (%.0f)\n",
                t_s16 * 1e6, b16 / t_s16 / 1e9, t_s16_ref * 1e6, b16 / t_s16_ref / 1e9, t_s32 * 1e6, b32 / t_s32 / 1e9,
                t_s32_ref * 1e6, b32 / t_s32_ref / 1e9, t_copy * 1e6, b16 / t_copy / 1e9);
  }
  return 0;
}

// Fused RMSNorm on the GPU: time and effective bandwidth of the kernel against the LibTorch
// composite (what the model runs without the kernel) and against a device-to-device copy of
// the same bytes (the memory-bound ceiling), measured in the same run. Prints one table.
#include <ATen/cuda/CUDAContext.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>

#include "tests/bench/gpu_seconds.hpp"
#include "kernels/rms_norm.hpp"

namespace {
template <class F>
double seconds(F&& f, int iters = 50) {
  return kiln::bench::gpu_seconds(f, iters, 5);
}
}  // namespace

int main() {
  if (!torch::cuda::is_available() || !kiln::kernels::built_with_cuda()) {
    std::printf("bench_rms_norm: needs a CUDA build and a GPU\n");
    return 2;
  }
  const int64_t R = 16384, D = 2048;
  auto opt = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  auto x = torch::randn({R, D}, opt), w = torch::randn({D}, opt), dy = torch::randn({R, D}, opt);
  auto y = torch::empty_like(x);
  const double row_bytes = double(R) * D * 2;
  at::Tensor rstd;
  double copy = seconds([&] { y.copy_(x); });
  double fwd = seconds([&] { rstd = std::get<1>(kiln::kernels::rms_norm_forward(x, w, 1e-5)); });
  double fwd_ref = seconds([&] { kiln::kernels::rms_norm_forward_ref(x, w, 1e-5); });
  double bwd = seconds([&] { kiln::kernels::rms_norm_backward(dy, x, w, rstd); });
  double bwd_ref = seconds([&] { kiln::kernels::rms_norm_backward_ref(dy, x, w, rstd); });
  std::printf("RMSNorm bf16 [%lld, %lld] on %s\n", (long long)R, (long long)D, at::cuda::getCurrentDeviceProperties()->name);
  std::printf("%-28s %10s %12s\n", "", "us", "GB/s");
  auto row = [&](const char* n, double s, double bytes) { std::printf("%-28s %10.1f %12.0f\n", n, s * 1e6, bytes / s / 1e9); };
  row("device copy (ceiling)", copy, 2 * row_bytes);
  row("forward kiln kernel", fwd, 2 * row_bytes);
  row("forward LibTorch composite", fwd_ref, 2 * row_bytes);
  row("backward kiln kernel", bwd, 3 * row_bytes);
  row("backward LibTorch composite", bwd_ref, 3 * row_bytes);
  std::printf("forward: %.2fx faster than the composite, %.0f%% of copy bandwidth\n", fwd_ref / fwd,
              100 * (2 * row_bytes / fwd) / (2 * row_bytes / copy));
  std::printf("backward: %.2fx faster than the composite\n", bwd_ref / bwd);

  // The training step's rows (8192 tokens, D 2048): the final norm's backward (the kernel, the
  // sum of its blocks' dw partials, dw's cast). The decoder layers' residual form (rms_norm_pass,
  // which also reads the stream's gradient) has no entry outside autograd; a traced step
  // (`kiln bench gpu --trace`) times it.
  const int64_t R8 = 8192;
  auto x8 = x.narrow(0, 0, R8), dy8 = dy.narrow(0, 0, R8), y8 = y.narrow(0, 0, R8);
  auto rstd8 = rstd.narrow(0, 0, R8);
  const double bytes8 = double(R8) * D * 2;
  double copy8 = seconds([&] { y8.copy_(x8); });
  double bwd8 = seconds([&] { kiln::kernels::rms_norm_backward(dy8, x8, w, rstd8); });
  std::printf("\nRMSNorm bf16 [%lld, %lld] backward\n", (long long)R8, (long long)D);
  std::printf("%-28s %10s %12s\n", "", "us", "GB/s");
  row("device copy (ceiling)", copy8, 2 * bytes8);
  row("backward kiln kernel", bwd8, 3 * bytes8);
  return 0;
}

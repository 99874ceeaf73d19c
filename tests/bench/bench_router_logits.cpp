// The MoE router's fp32 logits at GLM-4.7-Flash's router (N 64 experts, K 2048) on a GPU, per
// row count M (decode steps to the trainer's micro-batch), in the same run:
//   tile 0 / 1 / 2   kernels/router_logits.cu in each of its block shapes (64x64, 32x32, 16x16),
//                    and which one kernels::router_logits picks for that M ("auto")
//   cuBLASLt fp32    the path it replaced: x and w cast to fp32, then kernels::linear_unsplit
//                    (cuBLASLt's fp32 GEMM without split-K, on the CUDA cores)
//   cuBLAS bf16      at::mm of the bf16 operands into fp32 on the tensor cores: not the same sums
//                    (another order and the tensor cores' accumulation), the speed of a GEMM
//                    that needs no CUDA-core FMA
// Prints us per call (tests/bench/gpu_seconds.hpp), the CUDA-core rate (2 M N K / time), and
// whether each block shape's outputs are the bits of tile 0 (they must be) and the replaced
// path's (they need not be).
// Run: build/tests/kernels/kiln_bench_router_logits [M ...]   (default 1 32 256 1024 4096 8192)
#include <ATen/cuda/CUDAContext.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/linear_unsplit.hpp"
#include "kernels/router_logits.hpp"
#include "kernels/router_logits_cuda.hpp"
#include "kernels/rms_norm.hpp"
#include "tests/bench/gpu_seconds.hpp"

int main(int argc, char** argv) {
  using namespace kiln;
  if (!torch::cuda::is_available() || !kernels::built_with_cuda()) {
    std::printf("bench_router_logits: needs a CUDA build and a GPU\n");
    return 2;
  }
  const int64_t N = 64, K = 2048;
  std::vector<int64_t> Ms;
  for (int i = 1; i < argc; ++i) Ms.push_back(std::atoll(argv[i]));
  if (Ms.empty()) Ms = {1, 32, 256, 1024, 4096, 8192};
  std::printf("bench_router_logits: %s, N %lld, K %lld, bf16 operands, fp32 logits\n",
              at::cuda::getCurrentDeviceProperties()->name, (long long)N, (long long)K);
  std::printf("%6s  %-14s %10s %9s  %s\n", "M", "path", "us", "TFLOP/s", "bits");
  torch::manual_seed(0);
  const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  const auto w = (torch::randn({N, K}, bf16) * 0.02).to(torch::kBFloat16);
  const auto same = [](const at::Tensor& a, const at::Tensor& b) { return torch::equal(a, b) ? "same" : "differ"; };
  for (const int64_t M : Ms) {
    const auto x = torch::randn({M, K}, bf16);
    const double flop = 2.0 * double(M) * double(N) * double(K);
    auto row = [&](const char* name, double s, const char* bits) {
      std::printf("%6lld  %-14s %10.1f %9.2f  %s\n", (long long)M, name, s * 1e6, flop / s / 1e12, bits);
    };
    auto y0 = torch::empty({M, N}, bf16.dtype(torch::kFloat32));
    kernels::cuda::router_logits(x, w, y0, 0);
    for (int tile = 0; tile < 3; ++tile) {
      auto y = torch::empty_like(y0);
      const double s = bench::gpu_seconds([&] { kernels::cuda::router_logits(x, w, y, tile); }, 50, 5);
      const char* names[] = {"tile 0 (64x64)", "tile 1 (32x32)", "tile 2 (16x16)"};
      row(names[tile], s, tile == 0 ? "-" : same(y, y0));
    }
    at::Tensor y_auto;
    const double s_auto = bench::gpu_seconds([&] { y_auto = kernels::router_logits(x, w); }, 50, 5);
    std::printf("%6lld  %-14s %10.1f %9.2f  %s (tile %d)\n", (long long)M, "auto", s_auto * 1e6, flop / s_auto / 1e12,
                same(y_auto, y0), kernels::cuda::router_logits_tile_for(M, N));
    at::Tensor y_lt;
    const double s_lt = bench::gpu_seconds(
        [&] { y_lt = kernels::linear_unsplit(x.to(torch::kFloat32), w.to(torch::kFloat32)); }, 50, 5);
    row("cuBLASLt fp32", s_lt, same(y_lt, y0));
    const double s_tc = bench::gpu_seconds([&] { (void)at::mm(x, w.t(), torch::kFloat32); }, 50, 5);
    row("cuBLAS bf16", s_tc, "-");
  }
  return 0;
}

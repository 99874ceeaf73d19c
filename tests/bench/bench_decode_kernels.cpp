// The decode step's two bandwidth-bound kernels on the GPU, each against the device's copy rate
// measured in the same run (read + write bytes of a 2 GiB device-to-device copy):
// - kernels::mla_decode_attention (absorbed MLA over the paged latent cache) at GLM-4.7-Flash's
//   widths (20 heads, latent 512, rope 64, pages of 16) for batch x context shapes: time per call
//   and the cache bytes it must read (B x context x 576 x 2) per second;
// - kernels::sample_rows over [B, 154880] fp32 logits: plain rows (temperature 1), rows with
//   top-p 0.95 and rows with top-k 50: time per call and logits bytes per second.
// - the routed experts of a decode step at GLM-4.7-Flash's widths (64 experts, D 2048, F 1536,
//   B x 4 rows routed uniformly at random): kernels::grouped_swiglu_decode against
//   kernels::grouped_swiglu (the grouped GEMM), time per call (gate/up and down) and the touched
//   experts' weight bytes per second.
// - the projections cuBLAS splits over K at few rows (o_proj [2048 x 5120], the dense layer's
//   down [2048 x 10240]): kernels::linear_unsplit (no split-K: the trainer's bits) against
//   at::linear (cuBLAS's choice), time per call and weight bytes per second.
// Prints one table per kernel.
// Usage: kiln_bench_decode_kernels [--iters N] [--only mla|sampling|experts|linear] [--contiguous-pages]
#include <ATen/cuda/CUDAContext.h>
#include <torch/torch.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "tests/bench/gpu_seconds.hpp"
#include "kernels/linear_unsplit.hpp"
#include "kernels/mla_decode.hpp"
#include "kernels/moe.hpp"
#include "kernels/moe_decode.hpp"
#include "kernels/sampling.hpp"

namespace {
template <class F>
double seconds(F&& f, int iters) {
  return kiln::bench::gpu_seconds(f, iters, 3);
}
}  // namespace

int main(int argc, char** argv) {
  int iters = 20;
  std::string only;
  bool contiguous = false;  // pages in order (else shuffled, as a long-running engine hands them out)
  const char* usage = "usage: kiln_bench_decode_kernels [--iters N] [--only mla|sampling|experts|linear] [--contiguous-pages]\n";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", usage);
      return 0;
    } else if (a == "--iters" && i + 1 < argc) {
      const std::string v = argv[++i];
      char* end = nullptr;
      errno = 0;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || errno == ERANGE || n < 1 || n > 100000) {
        std::fprintf(stderr, "kiln_bench_decode_kernels: --iters '%s': not a whole number in [1, 100000]\n", v.c_str());
        return 2;
      }
      iters = int(n);
    } else if (a == "--contiguous-pages") {
      contiguous = true;
    } else if (a == "--only" && i + 1 < argc) {
      only = argv[++i];
      if (only != "mla" && only != "sampling" && only != "experts" && only != "linear") {
        std::fprintf(stderr, "kiln_bench_decode_kernels: --only %s: not mla, sampling, experts or linear\n", only.c_str());
        return 2;
      }
    } else {
      std::fprintf(stderr, "kiln_bench_decode_kernels: unknown or incomplete argument '%s'\n%s", a.c_str(), usage);
      return 2;
    }
  }
  if (!torch::cuda::is_available()) {
    std::printf("kiln_bench_decode_kernels: needs a GPU\n");
    return 2;
  }
  torch::NoGradGuard no_grad;
  torch::manual_seed(0);
  const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  double copy_gbs = 0;
  {
    auto src = torch::randn({int64_t(1) << 30}, bf16), dst = torch::empty_like(src);
    copy_gbs = 2.0 * double(src.numel()) * 2 / seconds([&] { dst.copy_(src); }, 10) / 1e9;
  }
  std::printf("kiln_bench_decode_kernels on %s: copy rate %.0f GB/s (read + write)\n",
              at::cuda::getCurrentDeviceProperties()->name, copy_gbs);

  const int64_t H = 20, C = 512, R = 64, Z = 16, new_tokens = 32;
  if (only.empty() || only == "mla") {
  std::printf("mla_decode_attention, %lld heads, latent %lld + rope %lld, pages of %lld (%s)\n", (long long)H,
              (long long)C, (long long)R, (long long)Z, contiguous ? "pages in order" : "pages shuffled");
  std::printf("%8s %6s %12s %12s %10s\n", "context", "batch", "us", "cache_GB/s", "of_copy");
  for (int64_t P : {1024, 8192})
    for (int64_t B : {1, 32, 128, 256}) {
      const int64_t per = (P + new_tokens + Z - 1) / Z;  // pages per sequence, as the engine sizes them
      auto cache = torch::randn({B * per, Z, C + R}, bf16);
      const auto i64 = torch::TensorOptions().dtype(torch::kInt64).device(torch::kCUDA);
      auto table = (contiguous ? torch::arange(B * per, i64) : torch::randperm(B * per, i64)).view({B, per});
      auto lengths = torch::full({B}, P, torch::TensorOptions().dtype(torch::kInt64).device(torch::kCUDA));
      auto ql = torch::randn({B, H, C}, bf16), qr = torch::randn({B, H, R}, bf16);
      const double scale = 1.0 / std::sqrt(256.0);
      if (!kiln::kernels::mla_decode_kernel_supports(ql, qr, cache)) {
        std::printf("mla_decode_attention: the kernel does not take these inputs (no CUDA kernels in this build?)\n");
        return 2;
      }
      const double s = seconds([&] { kiln::kernels::mla_decode_attention(ql, qr, cache, table, lengths, scale); }, iters);
      const double bytes = double(B) * double(P) * double(C + R) * 2;
      std::printf("%8lld %6lld %12.1f %12.0f %9.1f%%\n", (long long)P, (long long)B, s * 1e6, bytes / s / 1e9,
                  100.0 * bytes / s / 1e9 / copy_gbs);
    }
  }
  if (only.empty() || only == "experts") {
    const int64_t E = 64, D = 2048, F = 1536, K = 4;
    auto w1 = torch::randn({E, 2 * F, D}, bf16) / std::sqrt(double(D)), w2 = torch::randn({E, D, F}, bf16) / std::sqrt(double(F));
    std::printf("routed experts of a decode step: %lld experts, D %lld, F %lld, top-%lld, rows routed at random\n",
                (long long)E, (long long)D, (long long)F, (long long)K);
    std::printf("%6s %6s %8s %12s %12s %10s %12s %10s %9s\n", "batch", "rows", "touched", "decode_us", "GB/s", "of_copy",
                "grouped_us", "of_copy", "speedup");
    for (int64_t B : {1, 8, 32, 64, 128, 256}) {
      const int64_t M = B * K;
      auto counts = torch::bincount(torch::randint(E, {M}, torch::kInt64), {}, E);
      const int64_t touched = (counts > 0).sum().item<int64_t>();
      counts = counts.to(torch::kCUDA);
      auto x = torch::randn({M, D}, bf16);
      const double bytes = double(touched) * 3.0 * double(D) * double(F) * 2;
      const double sd = seconds([&] { kiln::kernels::grouped_swiglu_decode(x, counts, w1, w2); }, iters);
      const double sg = seconds([&] { kiln::kernels::grouped_swiglu(x, counts, w1, w2); }, iters);
      std::printf("%6lld %6lld %8lld %12.1f %12.0f %9.1f%% %12.1f %9.1f%% %8.2fx\n", (long long)B, (long long)M,
                  (long long)touched, sd * 1e6, bytes / sd / 1e9, 100.0 * bytes / sd / 1e9 / copy_gbs, sg * 1e6,
                  100.0 * bytes / sg / 1e9 / copy_gbs, sg / sd);
    }
  }
  if (only.empty() || only == "linear") {
    std::printf("projections without split-K (kernels::linear_unsplit) vs cuBLAS's choice (at::linear), bf16\n");
    std::printf("%14s %6s %12s %12s %10s %12s %10s %9s\n", "N x K", "rows", "unsplit_us", "GB/s", "of_copy", "cublas_us",
                "of_copy", "cost");
    for (auto [N, K] : {std::pair<int64_t, int64_t>{2048, 5120}, {2048, 10240}}) {
      auto w = torch::randn({N, K}, bf16);
      for (int64_t M : {1, 8, 32, 128, 256}) {
        auto x = torch::randn({M, K}, bf16);
        const double bytes = double(N) * double(K) * 2;
        const double su = seconds([&] { kiln::kernels::linear_unsplit(x, w); }, iters);
        const double sc = seconds([&] { at::linear(x, w); }, iters);
        std::printf("%7lld x %5lld %6lld %12.1f %12.0f %9.1f%% %12.1f %9.1f%% %8.2fx\n", (long long)N, (long long)K,
                    (long long)M, su * 1e6, bytes / su / 1e9, 100.0 * bytes / su / 1e9 / copy_gbs, sc * 1e6,
                    100.0 * bytes / sc / 1e9 / copy_gbs, su / sc);
      }
    }
  }
  if (!only.empty() && only != "sampling") return 0;

  const int64_t V = 154880;
  std::printf("sample_rows, V = %lld fp32 logits\n", (long long)V);
  std::printf("%6s %8s %12s %12s %10s\n", "batch", "rows", "us", "logits_GB/s", "of_copy");
  for (int64_t B : {1, 32, 128, 256})
    for (const std::string rows : {"plain", "top_p", "top_k"}) {
      auto logits = 3 * torch::randn({B, V}, torch::TensorOptions().device(torch::kCUDA));
      auto dev = [](torch::Tensor t) { return t.to(torch::kCUDA); };
      auto T = dev(torch::ones({B}, torch::kFloat64)),
           K = dev(torch::full({B}, rows == "top_k" ? 50 : 0, torch::kInt64)),
           Pp = dev(torch::full({B}, rows == "top_p" ? 0.95 : 1.0, torch::kFloat64)),
           seed = dev(torch::arange(B, torch::kInt64)), step = dev(torch::zeros({B}, torch::kInt64));
      const double s = seconds([&] { kiln::kernels::sample_rows(logits, T, K, Pp, seed, step); }, iters);
      const double bytes = double(B) * double(V) * 4;
      std::printf("%6lld %8s %12.1f %12.0f %9.1f%%\n", (long long)B, rows.c_str(), s * 1e6, bytes / s / 1e9,
                  100.0 * bytes / s / 1e9 / copy_gbs);
    }
  return 0;
}

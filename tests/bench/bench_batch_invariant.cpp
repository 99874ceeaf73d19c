// The batch-invariant CUDA ops (kernels/batch_invariant.hpp, the true on-policy mode) against
// the ordinary ops they replace, in the same run, at GLM-4.7-Flash shapes in bf16: cuBLAS
// (torch::mm), CUTLASS grouped GEMM (at::_grouped_mm), FlashAttention-2 varlen
// (kernels::varlen_attention / varlen_attention_cached), the fused RMSNorm and at::logsumexp.
// Prints one table: time of each, and the batch-invariant op's slowdown.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <vector>

#include "tests/bench/gpu_seconds.hpp"
#include "kernels/attention.hpp"
#include "kernels/batch_invariant.hpp"
#include "kernels/rms_norm.hpp"

namespace {
template <class F>
double seconds(F&& f, int iters = 20) {
  return kiln::bench::gpu_seconds(f, iters, 3);
}

void row(const char* what, double flops, double bi, double ref, const char* ref_name) {
  std::printf("%-44s %10.1f %8.1f %10.1f %8.1f %7.2fx  %s\n", what, bi * 1e6, flops / bi / 1e12, ref * 1e6,
              flops / ref / 1e12, bi / ref, ref_name);
}
}  // namespace

int main() {
  if (!torch::cuda::is_available() || !kiln::kernels::built_with_cuda()) {
    std::printf("bench_batch_invariant: needs a CUDA build and a GPU\n");
    return 2;
  }
  namespace k = kiln::kernels;
  auto bf = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  std::printf("batch-invariant ops vs the ordinary ops, bf16, on %s\n", at::cuda::getCurrentDeviceProperties()->name);
  std::printf("%-44s %10s %8s %10s %8s %8s  %s\n", "op [shape]", "bi us", "TFLOP/s", "ref us", "TFLOP/s", "bi/ref",
              "reference");

  // Linear: trainer-sized M and decode-sized M (GLM-4.7-Flash: hidden 2048, 20 heads x 256 v).
  struct Lin { int64_t M, N, K; bool fp32_out; const char* name; };
  for (const Lin& s : std::vector<Lin>{{8192, 2048, 5120, false, "linear o_proj [8192, 2048, 5120]"},
                                       {8192, 10240, 2048, false, "linear [8192, 10240, 2048]"},
                                       {1024, 151552, 2048, true, "lm_head fp32 out [1024, 151552, 2048]"},
                                       {32, 2048, 5120, false, "linear decode o_proj [32, 2048, 5120]"},
                                       {32, 151552, 2048, true, "lm_head decode fp32 [32, 151552, 2048]"}}) {
    auto x = torch::randn({s.M, s.K}, bf), w = torch::randn({s.N, s.K}, bf) / 45.0;
    const double flops = 2.0 * s.M * s.N * s.K;
    auto out = s.fp32_out ? std::optional<at::ScalarType>(torch::kFloat32) : std::nullopt;
    const double bi = seconds([&] { k::bi_linear(x, w, out); });
    const double ref = seconds([&] {
      if (s.fp32_out) at::mm(x, w.t(), torch::kFloat32);  // cuBLAS with fp32 output
      else torch::mm(x, w.t());
    });
    row(s.name, flops, bi, ref, "cuBLAS mm");
  }

  // Grouped (routed experts' gate_up): 64 experts, top-4 of 8192 tokens, and decode's 32 x 4 rows.
  for (int64_t M : {int64_t(8192 * 4), int64_t(32 * 4)}) {
    const int64_t E = 64, N = 3072, K = 2048;
    auto x = torch::randn({M, K}, bf), w = torch::randn({E, N, K}, bf) / 45.0;
    auto counts = torch::bincount(torch::randint(0, E, {M}, torch::TensorOptions().dtype(torch::kLong).device(torch::kCUDA)),
                                  {}, E);
    auto offs = counts.cumsum(0).to(torch::kInt32);
    const double flops = 2.0 * M * N * K;
    const double bi = seconds([&] { k::bi_grouped_linear(x, counts, w); });
    const double ref = seconds([&] { at::_grouped_mm(x, w.transpose(-2, -1), offs); });
    char name[96];
    std::snprintf(name, sizeof name, "grouped gate_up [%lld, 64 x 3072, 2048]", (long long)M);
    row(name, flops, bi, ref, "at::_grouped_mm");
  }

  // Attention: a training pack of 8192 tokens (8 documents of 1024), and decode of 32
  // sequences of 1024 keys; 20 heads, Dqk = Dv = 256.
  {
    const int64_t H = 20, D = 256, T = 8192, L = 1024, B = T / L;
    auto q = torch::randn({T, H, D}, bf), kk = torch::randn({T, H, D}, bf), v = torch::randn({T, H, D}, bf);
    auto cu = torch::arange(0, T + 1, L, torch::TensorOptions().dtype(torch::kLong).device(torch::kCUDA));
    const double flops = 2.0 * B * (L * (L + 1) / 2.0) * H * (2 * D);
    const double bi = seconds([&] { k::bi_attention(q, kk, v, cu, cu, 1.0 / 16); }, 5);
    const double ref = seconds([&] { k::varlen_attention(q, kk, v, cu, 1.0 / 16, L); }, 5);
    row("attention train [8 x 1024, 20 x 256]", flops, bi, ref, "FlashAttention-2 varlen");
  }
  {
    const int64_t H = 20, D = 256, L = 1024, B = 32;
    auto q = torch::randn({B, H, D}, bf), kk = torch::randn({B * L, H, D}, bf), v = torch::randn({B * L, H, D}, bf);
    auto opt = torch::TensorOptions().dtype(torch::kLong).device(torch::kCUDA);
    auto cu_q = torch::arange(0, B + 1, opt), cu_k = torch::arange(0, B * L + 1, L, opt);
    const double flops = 2.0 * B * L * H * (2 * D);
    const double bi = seconds([&] { k::bi_attention(q, kk, v, cu_q, cu_k, 1.0 / 16); });
    const double ref = seconds([&] { k::varlen_attention_cached(q, kk, v, cu_q, cu_k, 1.0 / 16, 1, L); });
    row("attention decode [32 x 1 over 1024, 20 x 256]", flops, bi, ref, "FlashAttention-2 varlen (cached)");
  }

  // Row ops (memory-bound: the TFLOP/s columns are not meaningful, bytes/s would be).
  {
    auto x = torch::randn({8192, 2048}, bf), w = torch::randn({2048}, bf);
    const double bi = seconds([&] { k::bi_rms_norm(x, w, 1e-5); });
    const double ref = seconds([&] { k::rms_norm_forward(x, w, 1e-5); });
    row("rms_norm [8192, 2048]", 0, bi, ref, "fused RMSNorm kernel");
    auto logits = torch::randn({1024, 151552}, torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCUDA));
    const double bi2 = seconds([&] { k::bi_logsumexp(logits); });
    const double ref2 = seconds([&] { at::logsumexp(logits, {1}); });
    row("logsumexp fp32 [1024, 151552]", 0, bi2, ref2, "at::logsumexp");
  }
  return 0;
}

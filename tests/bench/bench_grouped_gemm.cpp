// kiln's grouped GEMM (kernels/grouped_gemm.hpp) beside at::_grouped_mm (what the experts ran
// before, and what torchtitan runs) and one dense cuBLAS GEMM of the same work, at
// GLM-4.7-Flash's MoE shapes: D = 2048, F = 1536, E = 64, top-4, 8192 tokens (M = 32768 rows),
// bf16, in one run on one GPU.
//
// For each of an MoE layer's six GEMMs (gate/up and down: forward, input gradient, weight
// gradient) and each tile this build compiled for its layout: CUDA-event median time and TFLOP/s
// with the counts of a random top-4 routing, the largest difference from at::_grouped_mm's
// output (in units of its bf16 rounding step), then the chosen tiles' whole MoE expert
// forward+backward (grouped_linear + swiglu_packed, autograd) against the same through
// at::_grouped_mm. Build with -DKILN_GROUPED_GEMM_SWEEP=ON to time every tile of every layout (or
// -DKILN_GG_TILE_COLROW="kPong128x128;kCoop256x128N2" etc. for some).
//   kiln_bench_grouped_gemm [--tokens N] [--iters N] [--json FILE]
#include <ATen/cuda/CUDAContext.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kernels/grouped_gemm.hpp"
#include "kernels/swiglu.hpp"

using namespace kiln::kernels;

namespace {
double median_s(const std::function<void()>& f, int iters) {
  for (int i = 0; i < 3; ++i) f();
  std::vector<double> t;
  auto stream = at::cuda::getCurrentCUDAStream();
  for (int i = 0; i < iters; ++i) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    cudaEventRecord(a, stream);
    f();
    cudaEventRecord(b, stream);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms / 1e3);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Largest |a - b| in units of b's bf16 rounding step (2^-8 of |b|, at least 2^-8 of b's rms).
double max_steps(const at::Tensor& a, const at::Tensor& b) {
  auto af = a.to(torch::kFloat64), bf = b.to(torch::kFloat64);
  const double floor = bf.pow(2).mean().sqrt().item<double>() / 256;
  return ((af - bf).abs() / (bf.abs() / 256).clamp_min(floor)).max().item<double>();
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) o += (c == '"' ? std::string("\\\"") : std::string(1, c));
  return o;
}
}  // namespace

int main(int argc, char** argv) {
  int64_t tokens = 8192;
  int iters = 20;
  std::string json_path;
  const char* usage = "usage: kiln_bench_grouped_gemm [--tokens N (1..65536)] [--iters N (1..10000)] [--json FILE]\n";
  // A whole decimal integer in [lo, hi], else nullopt.
  auto integer = [](const std::string& s, long long lo, long long hi) -> std::optional<long long> {
    if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos || s.size() > 12) return std::nullopt;
    const long long v = std::stoll(s);
    if (v < lo || v > hi) return std::nullopt;
    return v;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", usage);
      return 0;
    }
    if (i + 1 >= argc || (a != "--tokens" && a != "--iters" && a != "--json")) {
      std::fprintf(stderr, "kiln_bench_grouped_gemm: unknown option or missing value: \"%s\"\n%s", a.c_str(), usage);
      return 2;
    }
    const std::string v = argv[++i];
    if (a == "--json") {
      json_path = v;
      if (json_path.empty() || !std::ofstream(json_path)) {  // refused before the GPU work, not after
        std::fprintf(stderr, "kiln_bench_grouped_gemm: cannot write --json \"%s\"\n", json_path.c_str());
        return 2;
      }
      continue;
    }
    const auto n = a == "--tokens" ? integer(v, 1, 1 << 16) : integer(v, 1, 10000);
    if (!n) {
      std::fprintf(stderr, "kiln_bench_grouped_gemm: %s: not an integer in range, got \"%s\"\n%s", a.c_str(), v.c_str(),
                   usage);
      return 2;
    }
    if (a == "--tokens") tokens = *n;
    else iters = int(*n);
  }
  const int64_t D = 2048, F = 1536, E = 64, K = 4, M = tokens * K;
  if (!torch::cuda::is_available() ||
      !grouped_gemm_compiled(GroupedLayout::kRowCol, grouped_default_tile(GroupedLayout::kRowCol))) {
    std::printf("KILN_TEST_SKIPPED: kiln_bench_grouped_gemm needs a GPU and a build with kiln's grouped GEMM\n");
    return 0;
  }
  auto opt = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  if (!grouped_linear_available(torch::empty({8, D}, opt), torch::empty({E, 2 * F, D}, opt))) {
    std::printf("KILN_TEST_SKIPPED: kiln_bench_grouped_gemm needs a Hopper GPU\n");
    return 0;
  }
  torch::manual_seed(0);
  // Counts of a random top-4 routing (uniform scores), as tests/bench/probe_grouped_gemm.py.
  auto top = std::get<1>(torch::rand({tokens, E}).topk(K, 1)).flatten();
  auto counts = torch::bincount(top, {}, E);
  auto offs = counts.cumsum(0).to(torch::kInt32).to(torch::kCUDA);
  std::printf("kiln_bench_grouped_gemm: %s, M = %lld rows (%lld tokens x top-%lld), E = %lld, D = %lld, F = %lld; "
              "rows per expert %lld..%lld\n",
              at::cuda::getCurrentDeviceProperties()->name, (long long)M, (long long)tokens, (long long)K, (long long)E,
              (long long)D, (long long)F, (long long)counts.min().item<int64_t>(), (long long)counts.max().item<int64_t>());

  auto w1 = torch::randn({E, 2 * F, D}, opt) * 0.02, w2 = torch::randn({E, D, F}, opt) * 0.02;
  auto x = torch::randn({M, D}, opt), act = torch::randn({M, F}, opt);
  auto g1 = torch::randn({M, 2 * F}, opt), g2 = torch::randn({M, D}, opt);

  struct Gemm {
    std::string name;
    GroupedLayout layout;
    double flop;
    std::function<at::Tensor(std::optional<GroupedTile>)> kiln;
    std::function<at::Tensor()> peer;
    std::function<at::Tensor()> dense;
  };
  const double f_gu = 2.0 * M * D * 2 * F, f_dn = 2.0 * M * F * D;
  auto w1d = w1[0], w2d = w2[0];  // dense stand-ins: one expert's weight over all M rows
  std::vector<Gemm> gemms = {
      {"gate/up forward  x w1[e]^T", GroupedLayout::kRowCol, f_gu,
       [&](auto t) { return grouped_mm_ragged_m(x, w1.transpose(-2, -1), offs, t); },
       [&] { return at::_grouped_mm(x, w1.transpose(-2, -1), offs); }, [&] { return torch::mm(x, w1d.t()); }},
      {"gate/up dX  dy w1[e]", GroupedLayout::kRowRow, f_gu, [&](auto t) { return grouped_mm_ragged_m(g1, w1, offs, t); },
       [&] { return at::_grouped_mm(g1, w1, offs); }, [&] { return torch::mm(g1, w1d); }},
      {"gate/up dW  dy^T x (ragged K)", GroupedLayout::kColRow, f_gu,
       [&](auto t) { return grouped_mm_ragged_k(g1.t(), x, offs, t); },
       [&] { return at::_grouped_mm(g1.t(), x, offs); }, [&] { return torch::mm(g1.t(), x); }},
      {"down forward  a w2[e]^T", GroupedLayout::kRowCol, f_dn,
       [&](auto t) { return grouped_mm_ragged_m(act, w2.transpose(-2, -1), offs, t); },
       [&] { return at::_grouped_mm(act, w2.transpose(-2, -1), offs); }, [&] { return torch::mm(act, w2d.t()); }},
      {"down dX  dy w2[e]", GroupedLayout::kRowRow, f_dn, [&](auto t) { return grouped_mm_ragged_m(g2, w2, offs, t); },
       [&] { return at::_grouped_mm(g2, w2, offs); }, [&] { return torch::mm(g2, w2d); }},
      {"down dW  dy^T a (ragged K)", GroupedLayout::kColRow, f_dn,
       [&](auto t) { return grouped_mm_ragged_k(g2.t(), act, offs, t); },
       [&] { return at::_grouped_mm(g2.t(), act, offs); }, [&] { return torch::mm(g2.t(), act); }},
  };

  std::string js = "{\"device\": \"" + json_escape(at::cuda::getCurrentDeviceProperties()->name) +
                   "\", \"M\": " + std::to_string(M) + ", \"gemms\": [";
  double sum_peer = 0, sum_kiln = 0, sum_dense = 0;
  for (size_t gi = 0; gi < gemms.size(); ++gi) {
    auto& g = gemms[gi];
    const double t_peer = median_s([&] { g.peer(); }, iters), t_dense = median_s([&] { g.dense(); }, iters);
    auto ref = g.peer();
    std::printf("%-32s %6.1f GFLOP  at::_grouped_mm %6.3f ms %4.0f TF/s   dense cuBLAS %6.3f ms %4.0f TF/s\n",
                g.name.c_str(), g.flop / 1e9, t_peer * 1e3, g.flop / t_peer / 1e12, t_dense * 1e3,
                g.flop / t_dense / 1e12);
    js += std::string(gi ? ", " : "") + "{\"gemm\": \"" + json_escape(g.name) + "\", \"gflop\": " +
          std::to_string(g.flop / 1e9) + ", \"peer_ms\": " + std::to_string(t_peer * 1e3) +
          ", \"dense_ms\": " + std::to_string(t_dense * 1e3) + ", \"tiles\": [";
    double best = 1e30;
    bool first = true;
    for (int ti = 0; ti < kGroupedTileCount; ++ti) {
      const auto tile = GroupedTile(ti);
      if (!grouped_gemm_compiled(g.layout, tile)) continue;
      const double t = median_s([&] { g.kiln(tile); }, iters);
      const double steps = max_steps(g.kiln(tile), ref);
      const bool chosen = tile == grouped_default_tile(g.layout);
      std::printf("    kiln %-38s %6.3f ms %4.0f TF/s  %5.2fx  max diff %.2f steps%s\n", grouped_tile_name(tile),
                  t * 1e3, g.flop / t / 1e12, t_peer / t, steps, chosen ? "  (grouped_linear's)" : "");
      js += std::string(first ? "" : ", ") + "{\"tile\": \"" + grouped_tile_name(tile) + "\", \"ms\": " +
            std::to_string(t * 1e3) + ", \"max_diff_steps\": " + std::to_string(steps) +
            ", \"chosen\": " + (chosen ? "true" : "false") + "}";
      first = false;
      if (chosen) best = t;
    }
    js += "]}";
    sum_peer += t_peer;
    sum_dense += t_dense;
    sum_kiln += best;
  }
  std::printf("the six GEMMs of one MoE layer: at::_grouped_mm %.3f ms, kiln %.3f ms (%.2fx), dense cuBLAS %.3f ms\n",
              sum_peer * 1e3, sum_kiln * 1e3, sum_peer / sum_kiln, sum_dense * 1e3);

  // The experts' forward+backward both ways (autograd, the gradients of x, w1 and w2).
  auto xr = x.detach().requires_grad_(), w1r = w1.detach().requires_grad_(), w2r = w2.detach().requires_grad_();
  auto dy = torch::randn({M, D}, opt);
  auto experts = [&](bool kiln_path) {
    xr.mutable_grad() = at::Tensor();
    w1r.mutable_grad() = at::Tensor();
    w2r.mutable_grad() = at::Tensor();
    at::Tensor y;
    if (kiln_path) {
      y = grouped_linear(swiglu_packed(grouped_linear(xr, w1r, offs)), w2r, offs);
    } else {
      auto gu = at::_grouped_mm(xr, w1r.transpose(-2, -1), offs);
      y = at::_grouped_mm(swiglu_packed(gu), w2r.transpose(-2, -1), offs);
    }
    y.backward(dy);
    return y;
  };
  const double t_kiln = median_s([&] { experts(true); }, iters), t_peer = median_s([&] { experts(false); }, iters);
  experts(false);
  auto ref_dw1 = w1r.grad().clone(), ref_dx = xr.grad().clone();
  experts(true);
  const double d_dw1 = max_steps(w1r.grad(), ref_dw1), d_dx = max_steps(xr.grad(), ref_dx);
  std::printf("experts forward+backward (gate/up, SwiGLU, down; dx, dw1, dw2): kiln %.3f ms, at::_grouped_mm %.3f ms "
              "(%.2fx); gradients vs at::_grouped_mm's: dx %.2f, dw1 %.2f steps\n",
              t_kiln * 1e3, t_peer * 1e3, t_peer / t_kiln, d_dx, d_dw1);
  js += "], \"six_peer_ms\": " + std::to_string(sum_peer * 1e3) + ", \"six_kiln_ms\": " + std::to_string(sum_kiln * 1e3) +
        ", \"six_dense_ms\": " + std::to_string(sum_dense * 1e3) + ", \"experts_fwd_bwd_kiln_ms\": " +
        std::to_string(t_kiln * 1e3) + ", \"experts_fwd_bwd_peer_ms\": " + std::to_string(t_peer * 1e3) + "}\n";
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    if (!(f << js)) {
      std::fprintf(stderr, "kiln_bench_grouped_gemm: cannot write --json %s\n", json_path.c_str());
      return 1;
    }
  }
  return 0;
}

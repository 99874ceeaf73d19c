#include "kernels/batch_invariant.hpp"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#ifdef KILN_CUDA
#include "kernels/batch_invariant_cuda.hpp"
#endif

namespace kiln::kernels {

namespace {

// The one dot product every op uses: 8 fp32 lanes over k = 0, 8, 16, ... (lane l sums the
// products k = l mod 8 in increasing k), the tail k >= 8 floor(K/8) into lane k mod 8, then
// the lanes in a fixed tree. The order depends on K alone. noinline: every row runs this very
// instruction sequence, never a copy the compiler specialised for one call site.
__attribute__((noinline)) float dot(const float* a, const float* b, int64_t K) {
  float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const int64_t K8 = K - K % 8;
  for (int64_t k = 0; k < K8; k += 8)
    for (int l = 0; l < 8; ++l) lane[l] += a[k + l] * b[k + l];
  for (int64_t k = K8; k < K; ++k) lane[k - K8] += a[k] * b[k];
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

void check_float_dtype(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, op, ": ", name,
              " must be fp32 or bf16, got ", t.scalar_type());
}

// True when the op runs on the GPU (kernels/batch_invariant.cu, kernels/batch_invariant_cuda.hpp);
// false on the CPU; throws for a CUDA tensor in a build without CUDA and for other devices.
bool on_cuda(const at::Tensor& t, const char* op) {
  if (t.device().is_cpu()) return false;
  TORCH_CHECK(t.is_cuda(), op, ": tensor on ", t.device(), "; the batch-invariant ops run on CPU and CUDA");
#ifdef KILN_CUDA
  return true;
#else
  TORCH_CHECK(false, op, ": CUDA tensor, but kiln was built without CUDA");
#endif
}

at::Tensor as_fp32(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

// y [M, N] fp32 rows of x against w (both fp32, contiguous): output elements split across
// threads by n, each element one dot() over K.
void linear_rows(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K) {
  if (M == 0 || N == 0) return;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, K));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    constexpr int64_t kRowBlock = 16;  // rows sharing the same slice of w while it is in cache
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t m1 = std::min(M, m0 + kRowBlock);
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t m = m0; m < m1; ++m) y[m * N + n] = dot(x + m * K, w + n * K, K);
    }
  });
}

}  // namespace

at::Tensor bi_linear(const at::Tensor& x_MK, const at::Tensor& w_NK, std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x_MK.dim() == 2 && w_NK.dim() == 2 && x_MK.size(1) == w_NK.size(1),
              "bi_linear: x must be [M, K] and w [N, K], got ", x_MK.sizes(), " and ", w_NK.sizes());
  check_float_dtype(x_MK, "bi_linear", "x");
  TORCH_CHECK(x_MK.scalar_type() == w_NK.scalar_type(), "bi_linear: x and w dtypes differ (", x_MK.scalar_type(),
              ", ", w_NK.scalar_type(), ")");
  TORCH_CHECK(x_MK.device() == w_NK.device(), "bi_linear: x on ", x_MK.device(), " but w on ", w_NK.device());
  if (on_cuda(x_MK, "bi_linear")) {
#ifdef KILN_CUDA
    const auto out = out_dtype.value_or(x_MK.scalar_type());
    TORCH_CHECK(out == at::kFloat || out == at::kBFloat16, "bi_linear: out_dtype ", out, " (fp32 or bf16 on CUDA)");
    return cuda::bi_linear_cuda(x_MK, w_NK, out);
#endif
  }
  const int64_t M = x_MK.size(0), N = w_NK.size(0), K = x_MK.size(1);
  auto x = as_fp32(x_MK), w = as_fp32(w_NK);
  auto y = torch::empty({M, N}, x.options());  // fp32 accumulator
  linear_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, N, K);
  return y.to(out_dtype.value_or(x_MK.scalar_type()));
}

at::Tensor bi_grouped_linear(const at::Tensor& x_MK, const at::Tensor& counts_E, const at::Tensor& w_ENK) {
  TORCH_CHECK(x_MK.dim() == 2 && w_ENK.dim() == 3 && x_MK.size(1) == w_ENK.size(2),
              "bi_grouped_linear: x must be [M, K] and w [E, N, K], got ", x_MK.sizes(), " and ", w_ENK.sizes());
  check_float_dtype(x_MK, "bi_grouped_linear", "x");
  TORCH_CHECK(x_MK.scalar_type() == w_ENK.scalar_type(), "bi_grouped_linear: x and w dtypes differ (",
              x_MK.scalar_type(), ", ", w_ENK.scalar_type(), ")");
  TORCH_CHECK(x_MK.device() == w_ENK.device(), "bi_grouped_linear: x on ", x_MK.device(), " but w on ",
              w_ENK.device());
  const bool gpu = on_cuda(x_MK, "bi_grouped_linear");
  const int64_t M = x_MK.size(0), E = w_ENK.size(0), N = w_ENK.size(1), K = x_MK.size(1);
  TORCH_CHECK(counts_E.dim() == 1 && counts_E.size(0) == E, "bi_grouped_linear: counts must be [E] = [", E,
              "], got ", counts_E.sizes());
  if (gpu && counts_E.is_cuda()) {
#ifdef KILN_CUDA
    // Counts already on the GPU stay there (no host read, so their sum is not checked here).
    return cuda::bi_grouped_linear_cuda(x_MK, counts_E, w_ENK);
#endif
  }
  auto counts = counts_E.to(at::kCPU).to(at::kLong).contiguous();
  const auto* c = counts.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(c[e] >= 0, "bi_grouped_linear: counts[", e, "] = ", c[e], " is negative");
    total += c[e];
  }
  TORCH_CHECK(total == M, "bi_grouped_linear: counts sum to ", total, " but x has M = ", M, " rows");
  if (gpu) {
#ifdef KILN_CUDA
    return cuda::bi_grouped_linear_cuda(x_MK, counts, w_ENK);
#endif
  }
  auto x = as_fp32(x_MK), w = as_fp32(w_ENK);
  auto y = torch::empty({M, N}, x.options());
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    linear_rows(x.data_ptr<float>() + row * K, w.data_ptr<float>() + e * N * K, y.data_ptr<float>() + row * N, c[e],
                N, K);
    row += c[e];
  }
  return y.to(x_MK.scalar_type());
}

at::Tensor bi_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
                        const at::Tensor& cu_k, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "bi_attention: q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] expected, got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.size(0) == v.size(0) && q.size(1) == k.size(1) && k.size(1) == v.size(1) && q.size(2) == k.size(2),
              "bi_attention: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), " disagree in Tk, H or Dqk");
  check_float_dtype(q, "bi_attention", "q");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "bi_attention: q, k, v dtypes differ (", q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type(),
              ")");
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(), "bi_attention: q, k, v on different devices");
  const bool gpu = on_cuda(q, "bi_attention");
  TORCH_CHECK(cu_q.dim() == 1 && cu_q.size(0) >= 2 && cu_q.sizes() == cu_k.sizes(),
              "bi_attention: cu_q and cu_k must both be [B+1] with B >= 1, got ", cu_q.sizes(), " and ",
              cu_k.sizes());
  if (gpu && cu_q.is_cuda() && cu_k.is_cuda()) {
#ifdef KILN_CUDA
    // Offsets already on the GPU stay there (no host read, so they are not checked here).
    return cuda::bi_attention_cuda(q, k, v, cu_q, cu_k, scale);
#endif
  }
  auto cq = cu_q.to(at::kCPU).to(at::kLong).contiguous(), ck = cu_k.to(at::kCPU).to(at::kLong).contiguous();
  const auto *a = cq.data_ptr<int64_t>(), *c = ck.data_ptr<int64_t>();
  const int64_t B = cq.size(0) - 1, Tq = q.size(0), Tk = k.size(0), H = q.size(1), Dqk = q.size(2), Dv = v.size(2);
  TORCH_CHECK(a[0] == 0 && c[0] == 0 && a[B] == Tq && c[B] == Tk, "bi_attention: cu_q must run 0 .. Tq = ", Tq,
              " and cu_k 0 .. Tk = ", Tk, ", got cu_q[0] = ", a[0], ", cu_q[B] = ", a[B], ", cu_k[0] = ", c[0],
              ", cu_k[B] = ", c[B]);
  // Query row t -> its sequence, checked once here so the parallel loop cannot throw.
  std::vector<int64_t> seq_of(Tq);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = a[b + 1] - a[b], L = c[b + 1] - c[b];
    TORCH_CHECK(n >= 0 && L >= 0 && n <= L, "bi_attention: sequence ", b, " has ", n, " queries and ", L,
                " keys (need 0 <= queries <= keys)");
    for (int64_t t = a[b]; t < a[b + 1]; ++t) seq_of[t] = b;
  }
  if (gpu) {
#ifdef KILN_CUDA
    return cuda::bi_attention_cuda(q, k, v, cq, ck, scale);
#endif
  }
  auto qf = as_fp32(q), kf = as_fp32(k), vf = as_fp32(v);
  auto out = torch::empty({Tq, H, Dv}, qf.options());
  const float *qp = qf.data_ptr<float>(), *kp = kf.data_ptr<float>(), *vp = vf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  constexpr int64_t kBlock = 64;  // keys per online-softmax step
  at::parallel_for(0, Tq * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> s(kBlock), acc(Dv);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / H, h = i % H, b = seq_of[t];
      const int64_t n = a[b + 1] - a[b], L = c[b + 1] - c[b];
      const int64_t visible = L - n + (t - a[b]) + 1;  // keys 0 .. L - n + j
      const float* qv = qp + (t * H + h) * Dqk;
      float m = -std::numeric_limits<float>::infinity(), l = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j0 = 0; j0 < visible; j0 += kBlock) {
        const int64_t nb = std::min(kBlock, visible - j0);
        float mb = m;
        for (int64_t j = 0; j < nb; ++j) {
          s[j] = sc * dot(qv, kp + ((c[b] + j0 + j) * H + h) * Dqk, Dqk);
          mb = std::max(mb, s[j]);
        }
        const float rescale = std::exp(m - mb);  // exp(-inf) = 0 on the first block
        l *= rescale;
        for (int64_t d = 0; d < Dv; ++d) acc[d] *= rescale;
        for (int64_t j = 0; j < nb; ++j) {
          const float p = std::exp(s[j] - mb);
          l += p;
          const float* vv = vp + ((c[b] + j0 + j) * H + h) * Dv;
          for (int64_t d = 0; d < Dv; ++d) acc[d] += p * vv[d];
        }
        m = mb;
      }
      float* o = op + (t * H + h) * Dv;
      for (int64_t d = 0; d < Dv; ++d) o[d] = acc[d] / l;
    }
  });
  return out.to(q.scalar_type());
}

at::Tensor bi_rms_norm(const at::Tensor& x_TD, const at::Tensor& w_D, double eps) {
  TORCH_CHECK(x_TD.dim() == 2 && w_D.dim() == 1 && x_TD.size(1) == w_D.size(0),
              "bi_rms_norm: x must be [T, D] and w [D], got ", x_TD.sizes(), " and ", w_D.sizes());
  check_float_dtype(x_TD, "bi_rms_norm", "x");
  TORCH_CHECK(x_TD.scalar_type() == w_D.scalar_type(), "bi_rms_norm: x and w dtypes differ (", x_TD.scalar_type(),
              ", ", w_D.scalar_type(), ")");
  TORCH_CHECK(x_TD.device() == w_D.device(), "bi_rms_norm: x on ", x_TD.device(), " but w on ", w_D.device());
  if (on_cuda(x_TD, "bi_rms_norm")) {
#ifdef KILN_CUDA
    return cuda::bi_rms_norm_cuda(x_TD, w_D, eps);
#endif
  }
  const int64_t T = x_TD.size(0), D = x_TD.size(1);
  auto xf = as_fp32(x_TD);
  auto rstd = torch::empty({T}, xf.options());  // [T]
  const float* xp = xf.data_ptr<float>();
  float* rp = rstd.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = xp + t * D;
      rp[t] = 1.f / std::sqrt(dot(row, row, D) / static_cast<float>(D) + e);
    }
  });
  // Elementwise from here (each element alone, so invariant): the rounding to x's dtype before
  // the weight, as the module's formula.
  return w_D * (xf * rstd.unsqueeze(-1)).to(x_TD.scalar_type());  // [T, D]
}

at::Tensor bi_logsumexp(const at::Tensor& x_MN) {
  TORCH_CHECK(x_MN.dim() == 2, "bi_logsumexp: x must be [M, N], got ", x_MN.sizes());
  check_float_dtype(x_MN, "bi_logsumexp", "x");
  if (on_cuda(x_MN, "bi_logsumexp")) {
#ifdef KILN_CUDA
    return cuda::bi_logsumexp_cuda(x_MN);
#endif
  }
  const int64_t M = x_MN.size(0), N = x_MN.size(1);
  auto xf = as_fp32(x_MN);
  auto lse = torch::empty({M}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = xp + m * N;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t n = 0; n < N; ++n) mx = std::max(mx, row[n]);
      if (mx == -std::numeric_limits<float>::infinity()) {
        lp[m] = mx;
        continue;
      }
      float sum = 0.f;
      for (int64_t n = 0; n < N; ++n) sum += std::exp(row[n] - mx);
      lp[m] = mx + std::log(sum);
    }
  });
  return lse;
}

}  // namespace kiln::kernels

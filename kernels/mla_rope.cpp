#include "kernels/mla_rope.hpp"

#include <ATen/MemoryOverlap.h>
#include <torch/torch.h>

#include "kernels/alignment.hpp"
#include "kernels/linear_unsplit.hpp"
#include "kernels/rope.hpp"

#ifdef KILN_CUDA
#include "kernels/mla_rope_cuda.hpp"
#endif

namespace kiln::kernels {

namespace {
void check_tables(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_t, const at::Tensor& sin_t,
                  int64_t R, const char* what) {
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == x.size(0) && positions.scalar_type() == at::kLong, what,
              ": positions must be [T] int64 with T = ", x.size(0), ", got ", positions.sizes(), " ",
              positions.scalar_type());
  TORCH_CHECK(cos_t.dim() == 2 && cos_t.sizes() == sin_t.sizes() && cos_t.size(1) * 2 == R && cos_t.size(0) >= 1, what,
              ": cos and sin tables [P, R/2] with R = ", R, " expected, got ", cos_t.sizes(), " and ", sin_t.sizes());
  TORCH_CHECK(cos_t.scalar_type() == x.scalar_type() && sin_t.scalar_type() == x.scalar_type(), what, ": the tables (",
              cos_t.scalar_type(), ", ", sin_t.scalar_type(), ") must have the input's dtype (", x.scalar_type(), ")");
  TORCH_CHECK(positions.device() == x.device() && cos_t.device() == x.device() && sin_t.device() == x.device(), what,
              ": positions (", positions.device(), ") and tables (", cos_t.device(), ", ", sin_t.device(),
              ") must be on the input's device (", x.device(), ")");
}

void check_q(const at::Tensor& qs, int64_t N, const at::Tensor& positions, const at::Tensor& cos_t,
             const at::Tensor& sin_t) {
  TORCH_CHECK(qs.dim() == 3 && N >= 0 && N < qs.size(2) && (qs.size(2) - N) % 2 == 0,
              "mla_rope_q: qs [T, H, N+R] with 0 <= N and an even R > 0 expected, got ", qs.sizes(), " and N = ", N);
  check_tables(qs, positions, cos_t, sin_t, qs.size(2) - N, "mla_rope_q");
}

void check_kv(const at::Tensor& kv, const at::Tensor& k_pe, int64_t N, const at::Tensor& positions,
              const at::Tensor& cos_t, const at::Tensor& sin_t) {
  TORCH_CHECK(kv.dim() == 3 && k_pe.dim() == 2 && k_pe.size(0) == kv.size(0) && N >= 0 && N < kv.size(2) &&
                  k_pe.size(1) > 0 && k_pe.size(1) % 2 == 0,
              "mla_rope_kv: kv [T, H, N+V] with 0 <= N < N+V and k_pe [T, R] with an even R > 0 expected, got kv ",
              kv.sizes(), ", k_pe ", k_pe.sizes(), " and N = ", N);
  TORCH_CHECK(k_pe.scalar_type() == kv.scalar_type() && k_pe.device() == kv.device(), "mla_rope_kv: k_pe (",
              k_pe.scalar_type(), ", ", k_pe.device(), ") must have kv's dtype and device (", kv.scalar_type(), ", ",
              kv.device(), ")");
  check_tables(kv, positions, cos_t, sin_t, k_pe.size(1), "mla_rope_kv");
}

#ifdef KILN_CUDA
// Elements in a 16-byte vector, 0 for dtypes without a kernel.
int64_t vec_elems(const at::Tensor& t) {
  const auto d = t.scalar_type();
  return d == at::kBFloat16 || d == at::kHalf ? 8 : d == at::kFloat ? 4 : 0;
}

// A [T, H, D] or [T, D] tensor the kernels' 16-byte loads can read: last dim contiguous, the
// other strides and the data on 16-byte boundaries.
bool vector_ready(const at::Tensor& t, int64_t n) {
  if (t.stride(-1) != 1 || !aligned16(t)) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    if (t.stride(d) % n != 0) return false;
  return true;
}

at::Tensor vector_ready_copy(const at::Tensor& t, int64_t n) { return vector_ready(t, n) ? t : aligned_contiguous(t); }

// The widths mla_rope_kv's forward kernel takes, n elements a 16-byte vector (0: no kernel for the
// dtype): H heads, N no-position, V value and R rope dims, whole vectors each (R a whole number of
// vector pairs), a (token, head) row's N+V+R at most 256 vectors (one block's threads:
// kernels/mla_rope.cu), the heads a grid dimension.
bool kv_widths_fit(int64_t n, int64_t H, int64_t N, int64_t V, int64_t R) {
  return n > 0 && N >= 0 && V > 0 && N % n == 0 && V % n == 0 && R % (2 * n) == 0 && (N + V + R) / n <= 256 &&
         H <= 65535;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct MlaRopeQ : public torch::autograd::Function<MlaRopeQ> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& qs, int64_t N, const at::Tensor& positions,
                            const at::Tensor& cos_t, const at::Tensor& sin_t, bool interleaved) {
    ctx->save_for_backward({positions, cos_t, sin_t});
    ctx->saved_data["N"] = N;
    ctx->saved_data["interleaved"] = interleaved;
    auto q = at::empty({qs.size(0), qs.size(1), qs.size(2)}, qs.options());
    if (q.numel() > 0) cuda::mla_rope_q(qs, N, positions, cos_t, sin_t, interleaved, /*inverse=*/false, q);
    return q;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const int64_t N = ctx->saved_data["N"].toInt();
    auto dq = vector_ready_copy(grads[0].to(s[1].scalar_type()), vec_elems(s[1]));
    auto dqs = at::empty({dq.size(0), dq.size(1), dq.size(2)}, dq.options());
    if (dqs.numel() > 0)
      cuda::mla_rope_q(dq, N, s[0], s[1], s[2], ctx->saved_data["interleaved"].toBool(), /*inverse=*/true, dqs);
    return {dqs, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct MlaRopeKV : public torch::autograd::Function<MlaRopeKV> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& kv, const at::Tensor& k_pe, int64_t N,
                               const at::Tensor& positions, const at::Tensor& cos_t, const at::Tensor& sin_t,
                               bool interleaved) {
    ctx->save_for_backward({positions, cos_t, sin_t});
    ctx->saved_data["N"] = N;
    ctx->saved_data["interleaved"] = interleaved;
    const int64_t T = kv.size(0), H = kv.size(1), R = k_pe.size(1), V = kv.size(2) - N;
    ctx->saved_data["R"] = R;
    ctx->saved_data["V"] = V;
    auto k = at::empty({T, H, N + R}, kv.options()), v = at::empty({T, H, V}, kv.options());
    if (T * H > 0) cuda::mla_rope_kv_forward(kv, k_pe, N, positions, cos_t, sin_t, interleaved, k, v);
    return {k, v};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const int64_t N = ctx->saved_data["N"].toInt(), R = ctx->saved_data["R"].toInt(),
                  V = ctx->saved_data["V"].toInt(), n = vec_elems(s[1]);
    const auto dtype = s[1].scalar_type();
    // Autograd materializes the gradient of an output the loss did not use as zeros.
    auto dk = vector_ready_copy(grads[0].to(dtype), n), dv = vector_ready_copy(grads[1].to(dtype), n);
    const int64_t T = dk.size(0), H = dk.size(1);
    auto dkv = at::empty({T, H, N + V}, dk.options());
    auto dk_pe = at::empty({T, R}, dk.options());
    if (T * H > 0)
      cuda::mla_rope_kv_backward(dk, dv, N, s[0], s[1], s[2], ctx->saved_data["interleaved"].toBool(), dkv, dk_pe);
    return {dkv, dk_pe, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
#endif
}  // namespace

namespace {
// The rotation's transpose (the rotation by -angle: sin negated) of x [T, h, R], in fp32, the
// references' form of the kernels' backward rotation.
at::Tensor rotate_transpose_ref(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_t,
                                const at::Tensor& sin_t, bool interleaved) {
  return rope_rotate_ref(x.to(at::kFloat), positions, cos_t.to(at::kFloat), sin_t.to(at::kFloat).neg(), interleaved);
}
}  // namespace

void mla_rope_q_(at::Tensor& q, int64_t N, const at::Tensor& positions, const at::Tensor& cos_t,
                 const at::Tensor& sin_t, bool interleaved, bool inverse) {
  check_q(q, N, positions, cos_t, sin_t);
  TORCH_CHECK(q.stride(-1) == 1, "mla_rope_q_: q's last dim must be contiguous, got strides ", q.strides());
  at::assert_no_internal_overlap(q);  // heads or rows sharing memory would race
  if (q.numel() == 0) return;
  const int64_t R = q.size(2) - N;
#ifdef KILN_CUDA
  if (mla_rope_q_uses_kernel(q, N)) {
    cuda::mla_rope_q_inplace(q, N, positions.contiguous(), cos_t.contiguous(), sin_t.contiguous(), interleaved, inverse);
    q.unsafeGetTensorImpl()->bump_version();  // as an in-place op: a node that saved q sees it changed
    return;
  }
#endif
  const at::NoGradGuard no_grad;
  auto part = q.narrow(-1, N, R);
  if (!inverse) {
    part.copy_(rope_rotate_ref(part, positions, cos_t, sin_t, interleaved));
    return;
  }
  part.copy_(rotate_transpose_ref(part, positions, cos_t, sin_t, interleaved));  // fp32, rounded once
}

namespace {
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct ProjectRopeQ : public torch::autograd::Function<ProjectRopeQ> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, int64_t H, int64_t N,
                            const at::Tensor& positions, const at::Tensor& cos_t, const at::Tensor& sin_t,
                            bool interleaved) {
    ctx->save_for_backward({x, w, positions, cos_t, sin_t});
    ctx->saved_data["N"] = N;
    ctx->saved_data["interleaved"] = interleaved;
    auto q = linear_unsplit(x, w).view({x.size(0), H, w.size(0) / H});  // [M, H, N+R], a fresh tensor
    mla_rope_q_(q, N, positions, cos_t, sin_t, interleaved);
    return q;
  }
  // grads by reference (CppNode passes its own list): the gradient may be taken over in place.
  static variable_list backward(AutogradContext* ctx, variable_list& grads) {
    const auto s = ctx->get_saved_variables();
    const auto &x = s[0], &w = s[1];
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    at::Tensor dq = std::move(grads[0]);  // [M, H, N+R]
    // Rotate in place only a gradient nobody else can see: this list held the one reference to
    // the tensor and to its storage (FlashAttention's dq); anything else is copied first.
    const bool own = dq.use_count() == 1 && dq.storage().use_count() == 1 && dq.scalar_type() == x.scalar_type() &&
                     dq.is_contiguous() && !dq.requires_grad() && !dq._is_zerotensor() && !dq.is_conj() &&
                     !dq.is_neg();
    if (!own) dq = at::empty(dq.sizes(), x.options()).copy_(dq);
    mla_rope_q_(dq, ctx->saved_data["N"].toInt(), s[2], s[3], s[4], ctx->saved_data["interleaved"].toBool(),
                /*inverse=*/true);
    const auto g = dq.view({x.size(0), w.size(0)});  // [M, H (N+R)]
    return {ctx->needs_input_grad(0) ? g.mm(w) : at::Tensor(), ctx->needs_input_grad(1) ? g.t().mm(x) : at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
}  // namespace

at::Tensor mla_project_rope_q(const at::Tensor& x, const at::Tensor& w, int64_t H, int64_t N,
                              const at::Tensor& positions, const at::Tensor& cos_t, const at::Tensor& sin_t,
                              bool interleaved) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && H > 0 && w.size(0) % H == 0,
              "mla_project_rope_q: x [M, K] and w [H (N+R), K] with H = ", H, " expected, got x ", x.sizes(), " and w ",
              w.sizes());
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && x.device() == w.device(), "mla_project_rope_q: x (",
              x.scalar_type(), ", ", x.device(), ") and w (", w.scalar_type(), ", ", w.device(),
              ") must share dtype and device");
  const int64_t D = w.size(0) / H;
  TORCH_CHECK(N >= 0 && N < D && (D - N) % 2 == 0, "mla_project_rope_q: N = ", N, " must leave an even R > 0 of the ",
              D, " dims a head");
  check_tables(x, positions, cos_t, sin_t, D - N, "mla_project_rope_q");
  return ProjectRopeQ::apply(x, w, H, N, positions.contiguous(), cos_t.contiguous(), sin_t.contiguous(), interleaved);
}

namespace {
#ifdef KILN_CUDA
// mla_rope_kv_uses_kernel for the contiguous [M, H, N+V] projection of latent, decided before
// the GEMM; the kernel also reads the key part alone ([M, H, N], no value vectors).
bool project_kv_uses_kernel(const at::Tensor& latent, const at::Tensor& k_pe, int64_t H, int64_t N, int64_t V) {
  const int64_t n = vec_elems(latent);
  return latent.is_cuda() && N > 0 && k_pe.dim() == 2 && k_pe.scalar_type() == latent.scalar_type() &&
         kv_widths_fit(n, H, N, V, k_pe.size(1)) && vector_ready(k_pe, n);
}
#endif

struct ProjectRopeKV : public torch::autograd::Function<ProjectRopeKV> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& latent, const at::Tensor& w,
                               const at::Tensor& k_pe, int64_t H, int64_t N, const at::Tensor& positions,
                               const at::Tensor& cos_t, const at::Tensor& sin_t, bool interleaved) {
    ctx->save_for_backward({latent, w, positions, cos_t, sin_t});
    const int64_t M = latent.size(0), R = k_pe.size(1), C = latent.size(1), V = w.size(0) / H - N;
    ctx->saved_data["N"] = N;
    ctx->saved_data["R"] = R;
    ctx->saved_data["interleaved"] = interleaved;
#ifdef KILN_CUDA
    if (project_kv_uses_kernel(latent, k_pe, H, N, V)) {
      // The projection as two GEMMs over w's key rows and its value rows (each copied out of
      // [H, N+V, C]: 4.5 MB at GLM-4.7-Flash's widths): the first writes each head's no-position
      // key straight into its slot of k (linear_unsplit_into_groups), the second is v as it is,
      // and the kernel writes only k's rope slots, where it read and wrote all of [M, H, N+V] and
      // copied the keys and v. Each output element is the same unsplit sum over C as in the one
      // GEMM over w, so k and v keep mla_rope_kv's bits.
      const auto w3 = w.view({H, N + V, C});
      auto k = at::empty({M, H, N + R}, latent.options());
      linear_unsplit_into_groups(latent, w3.narrow(1, 0, N), k.narrow(2, 0, N));
      auto v = linear_unsplit(latent, w3.narrow(1, N, V).reshape({H * V, C})).view({M, H, V});
      if (M * H > 0) cuda::mla_rope_kv_forward_rope(k_pe, N, positions, cos_t, sin_t, interleaved, k);
      ctx->saved_data["kernel"] = true;
      return {k, v};
    }
#endif
    ctx->saved_data["kernel"] = false;
    const auto kv = linear_unsplit(latent, w).view({M, H, N + V});  // [M, H, N+V]
    auto [k, v] = mla_rope_kv_ref(kv, k_pe, N, positions, cos_t, sin_t, interleaved);
    return {k.contiguous(), v};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto &latent = s[0], &w = s[1];
    const int64_t N = ctx->saved_data["N"].toInt(), R = ctx->saved_data["R"].toInt();
    const bool interleaved = ctx->saved_data["interleaved"].toBool();
    const auto dtype = latent.scalar_type();
    auto dk = grads[0].to(dtype).contiguous(), dv = grads[1].to(dtype).contiguous();  // [M, H, N+R], [M, H, V]
    const int64_t M = dk.size(0), H = dk.size(1), V = dv.size(2), C = latent.size(1);
    at::Tensor dk_pe;
#ifdef KILN_CUDA
    if (ctx->saved_data["kernel"].toBool()) {
      dk_pe = at::empty({M, R}, dk.options());
      dk = vector_ready_copy(dk, vec_elems(dk));
      if (M * H > 0) {
        at::Tensor no_dkv;
        cuda::mla_rope_kv_backward(dk, dv, N, s[2], s[3], s[4], interleaved, no_dkv, dk_pe);
      }
    }
#endif
    if (!dk_pe.defined()) {  // the transpose rotation of the heads' sum, in fp32, rounded once
      const at::NoGradGuard no_grad;
      dk_pe = rotate_transpose_ref(dk.narrow(-1, N, R).to(at::kFloat).sum(1, /*keepdim=*/true), s[2], s[3], s[4],
                                   interleaved)
                  .squeeze(1)
                  .to(dtype);
    }
    const auto dk2 = dk.view({M, H * (N + R)}), dv2 = dv.view({M, H * V});
    at::Tensor dlatent, dw;
    if (ctx->needs_input_grad(0)) {
      const auto w3 = w.view({H, N + V, C});
      auto wk = at::zeros({H, N + R, C}, w.options());  // the key rows, zeros in the rope slots
      wk.narrow(1, 0, N).copy_(w3.narrow(1, 0, N));
      dlatent = dk2.mm(wk.view({H * (N + R), C})).addmm_(dv2, w3.narrow(1, N, V).reshape({H * V, C}));
    }
    if (ctx->needs_input_grad(1))
      dw = at::cat({dk2.t().mm(latent).view({H, N + R, C}).narrow(1, 0, N), dv2.t().mm(latent).view({H, V, C})}, 1)
               .view({H * (N + V), C});
    return {dlatent, dw, dk_pe, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
}  // namespace

std::pair<at::Tensor, at::Tensor> mla_project_rope_kv(const at::Tensor& latent, const at::Tensor& w,
                                                      const at::Tensor& k_pe, int64_t H, int64_t N,
                                                      const at::Tensor& positions, const at::Tensor& cos_t,
                                                      const at::Tensor& sin_t, bool interleaved) {
  TORCH_CHECK(latent.dim() == 2 && w.dim() == 2 && latent.size(1) == w.size(1) && H > 0 && w.size(0) % H == 0,
              "mla_project_rope_kv: latent [M, C] and w [H (N+V), C] with H = ", H, " expected, got latent ",
              latent.sizes(), " and w ", w.sizes());
  TORCH_CHECK(latent.scalar_type() == w.scalar_type() && latent.device() == w.device(), "mla_project_rope_kv: latent (",
              latent.scalar_type(), ", ", latent.device(), ") and w (", w.scalar_type(), ", ", w.device(),
              ") must share dtype and device");
  const int64_t D = w.size(0) / H;
  TORCH_CHECK(k_pe.dim() == 2 && k_pe.size(0) == latent.size(0) && k_pe.size(1) > 0 && k_pe.size(1) % 2 == 0 &&
                  N >= 0 && N < D,
              "mla_project_rope_kv: k_pe [M, R] with an even R > 0 and 0 <= N < N+V = ", D, " expected, got k_pe ",
              k_pe.sizes(), " and N = ", N);
  TORCH_CHECK(k_pe.scalar_type() == latent.scalar_type() && k_pe.device() == latent.device(), "mla_project_rope_kv: k_pe (",
              k_pe.scalar_type(), ", ", k_pe.device(), ") must have latent's dtype and device (", latent.scalar_type(),
              ", ", latent.device(), ")");
  check_tables(latent, positions, cos_t, sin_t, k_pe.size(1), "mla_project_rope_kv");
  auto out = ProjectRopeKV::apply(latent, w, k_pe, H, N, positions.contiguous(), cos_t.contiguous(),
                                  sin_t.contiguous(), interleaved);
  return {out[0], out[1]};
}

at::Tensor mla_rope_q_ref(const at::Tensor& qs, int64_t N, const at::Tensor& positions, const at::Tensor& cos_t,
                          const at::Tensor& sin_t, bool interleaved) {
  check_q(qs, N, positions, cos_t, sin_t);
  const int64_t R = qs.size(2) - N;
  auto rope = rope_rotate_ref(qs.narrow(-1, N, R), positions, cos_t, sin_t, interleaved);  // [T, H, R]
  return torch::cat({qs.narrow(-1, 0, N), rope}, -1);                                     // [T, H, N+R]
}

std::pair<at::Tensor, at::Tensor> mla_rope_kv_ref(const at::Tensor& kv, const at::Tensor& k_pe, int64_t N,
                                                  const at::Tensor& positions, const at::Tensor& cos_t,
                                                  const at::Tensor& sin_t, bool interleaved) {
  check_kv(kv, k_pe, N, positions, cos_t, sin_t);
  const int64_t T = kv.size(0), H = kv.size(1), R = k_pe.size(1), V = kv.size(2) - N;
  auto k_rope = rope_rotate_ref(k_pe.unsqueeze(1), positions, cos_t, sin_t, interleaved);  // [T, 1, R]
  auto k = torch::cat({kv.narrow(-1, 0, N), k_rope.expand({T, H, R})}, -1);                // [T, H, N+R]
  return {k, kv.narrow(-1, N, V).contiguous()};                                            // [T, H, V]
}

bool mla_rope_q_uses_kernel(const at::Tensor& qs, int64_t N) {
#ifdef KILN_CUDA
  const int64_t n = vec_elems(qs);
  // A row's vectors are one block's threads (at most 256: kernels/mla_rope.cu), the heads a grid
  // dimension.
  return qs.is_cuda() && n > 0 && qs.dim() == 3 && N >= 0 && N < qs.size(2) && N % n == 0 &&
         (qs.size(2) - N) % (2 * n) == 0 && qs.size(2) / n <= 256 && qs.size(1) <= 65535 && vector_ready(qs, n);
#else
  (void)qs;
  (void)N;
  return false;
#endif
}

bool mla_rope_kv_uses_kernel(const at::Tensor& kv, const at::Tensor& k_pe, int64_t N) {
#ifdef KILN_CUDA
  const int64_t n = vec_elems(kv);
  return kv.is_cuda() && kv.dim() == 3 && k_pe.dim() == 2 && k_pe.scalar_type() == kv.scalar_type() &&
         kv_widths_fit(n, kv.size(1), N, kv.size(2) - N, k_pe.size(1)) && vector_ready(kv, n) && vector_ready(k_pe, n);
#else
  (void)kv;
  (void)k_pe;
  (void)N;
  return false;
#endif
}

at::Tensor mla_rope_q(const at::Tensor& qs, int64_t N, const at::Tensor& positions, const at::Tensor& cos_t,
                      const at::Tensor& sin_t, bool interleaved) {
  check_q(qs, N, positions, cos_t, sin_t);
#ifdef KILN_CUDA
  if (mla_rope_q_uses_kernel(qs, N))
    return MlaRopeQ::apply(qs, N, positions.contiguous(), cos_t.contiguous(), sin_t.contiguous(), interleaved);
#endif
  return mla_rope_q_ref(qs, N, positions, cos_t, sin_t, interleaved);
}

std::pair<at::Tensor, at::Tensor> mla_rope_kv(const at::Tensor& kv, const at::Tensor& k_pe, int64_t N,
                                              const at::Tensor& positions, const at::Tensor& cos_t,
                                              const at::Tensor& sin_t, bool interleaved) {
  check_kv(kv, k_pe, N, positions, cos_t, sin_t);
#ifdef KILN_CUDA
  if (mla_rope_kv_uses_kernel(kv, k_pe, N)) {
    auto out = MlaRopeKV::apply(kv, k_pe, N, positions.contiguous(), cos_t.contiguous(), sin_t.contiguous(), interleaved);
    return {out[0], out[1]};
  }
#endif
  return mla_rope_kv_ref(kv, k_pe, N, positions, cos_t, sin_t, interleaved);
}

}  // namespace kiln::kernels

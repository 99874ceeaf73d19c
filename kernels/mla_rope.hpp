#pragma once
// MLA's attention inputs in training (DeepSeek-V2, arXiv:2405.04434 §2.1.3; transformers'
// Glm4MoeLiteAttention): the query is q_b's output with RoPE on the last R dims of each head,
// the key is kv_b's no-position part of each head with the one shared rope key k_pe appended
// (rotated, the same for every head), the value is the rest of kv_b's output.
//
// Legend: T tokens, H heads, N no-position dims (qk_nope_head_dim), R rope dims (qk_rope_head_dim,
// even), V value dims, P rows of the cos/sin tables (positions 0 .. P-1).
//
//   mla_rope_q(qs [T, H, N+R])               -> q [T, H, N+R]   = [qs[..., :N] | rope(qs[..., N:])]
//   mla_rope_kv(kv [T, H, N+V], k_pe [T, R]) -> k [T, H, N+R]   = [kv[..., :N] | rope(k_pe) per head],
//                                               v [T, H, V]     = kv[..., N:]
//
// The rotation is kernels::rope_rotate's (tables' rows at `positions`, every product and sum
// rounded to the dtype), so q and k have the bits of the LibTorch composite that the reference
// below computes, and of the rollout engine's rope (model::apply_rope_cached). Both ops are
// differentiable in their tensor inputs. On CUDA (bf16, fp16 or fp32; last dims contiguous,
// data and row/head strides on 16-byte boundaries; N, V multiples of 16 bytes' elements, R of
// twice that) each runs one kernel forward and q one, kv two backward (kernels/mla_rope.cu):
// where autograd through the composite ran ~70 small kernels per layer (the rotation's
// products, two concatenations, the value copy, and for every narrow view a zero-filled
// gradient, a copy and an add). The backward computes in fp32 and rounds once (the reference's
// autograd rounds after each op): gradients agree within a rounding step of the dtype, not bit
// for bit. A position outside [0, P) reads row 0 or P - 1 in the kernels (the reference refuses
// it): callers size the tables from the largest position (model::rope_table).
// Throws c10::Error on shapes, dtypes or devices that disagree, naming them.
#include <ATen/core/Tensor.h>

#include <utility>

namespace kiln::kernels {

/// qs [T, H, N+R] (last dim contiguous, any row and head strides), nope_dim N, positions [T]
/// int64, cos_table and sin_table [P, R/2] (qs's dtype) -> q [T, H, N+R] contiguous.
at::Tensor mla_rope_q(const at::Tensor& qs, int64_t nope_dim, const at::Tensor& positions, const at::Tensor& cos_table,
                      const at::Tensor& sin_table, bool interleaved);
/// kv [T, H, N+V], k_pe [T, R] (last dims contiguous), nope_dim N, positions and tables as
/// mla_rope_q's -> {k [T, H, N+R], v [T, H, V]}, both contiguous.
std::pair<at::Tensor, at::Tensor> mla_rope_kv(const at::Tensor& kv, const at::Tensor& k_pe, int64_t nope_dim,
                                              const at::Tensor& positions, const at::Tensor& cos_table,
                                              const at::Tensor& sin_table, bool interleaved);

/// In place, no autograd: q [T, H, N+R] (last dim contiguous) with q[..., N:] rotated as
/// mla_rope_q rotates it (its bits), or with `inverse` by the transpose rotation (mla_rope_q's
/// backward: fp32, rounded once). CUDA when mla_rope_q_uses_kernel(q, N) holds: one kernel
/// reading and writing only the rope part (R of each head's N+R elements); elsewhere the
/// reference's rotation copied back. Throws c10::Error as mla_rope_q does.
void mla_rope_q_(at::Tensor& q, int64_t nope_dim, const at::Tensor& positions, const at::Tensor& cos_table,
                 const at::Tensor& sin_table, bool interleaved, bool inverse = false);

/// MLA's query from its projection in one autograd function: x_MK [M, K], w_NK [H (N+R), K] ->
/// q [M, H, N+R] = mla_rope_q((x w^T).view(M, H, N+R)), the projection by
/// kernels::linear_unsplit (its bits) and the rotation in place in the projection's output (no
/// second [M, H, N+R] written and read). Backward: dq's rope part rotated back in place when
/// the function holds the only reference to dq and its storage, and dq needs no gradient itself
/// (FlashAttention's fresh dq; else a copy), then
/// dx = dq w, dw = dq^T x in x's dtype. Every device (CPU: at::linear and the references).
/// Throws c10::Error naming shapes, dtypes or devices that do not fit.
at::Tensor mla_project_rope_q(const at::Tensor& x_MK, const at::Tensor& w_NK, int64_t heads, int64_t nope_dim,
                              const at::Tensor& positions, const at::Tensor& cos_table, const at::Tensor& sin_table,
                              bool interleaved);

/// MLA's key and value from their projection in one autograd function: latent [M, C], w
/// [H (N+V), C], k_pe [M, R] -> {k [M, H, N+R], v [M, H, V]} = mla_rope_kv((latent w^T).view(M, H,
/// N+V), k_pe), the projection by kernels::linear_unsplit (the forward's bits are the two ops').
/// On CUDA with mla_rope_kv's kernel the projection runs as two GEMMs, over w's key rows and its
/// value rows (each copied out, [H, N, C] and [H V, C]): the first writes each head's keys into
/// their slots of k (kernels::linear_unsplit_into_groups), the second's output is v as it is,
/// and a kernel writes k's rope slots, where the one GEMM's [M, H, N+V] output was read whole and
/// k and v copied out of it (at 8192 tokens and GLM-4.7-Flash's widths ~290 MB less moved a
/// layer); each element is the same unsplit sum over C, so the bits are the one GEMM's (the CUDA
/// test checks them equal).
/// Backward without the [M, H, N+V] gradient mla_rope_kv assembles from dk and dv: the
/// projection's gradients are GEMMs over dk and dv as they are, dlatent = dk W_k + dv W_v and
/// dw = [dk^T latent without its rope rows | dv^T latent] per head, where W_k [H (N+R), C] is w's
/// key rows with zero rows in the rope slots (at GLM-4.7-Flash's widths these GEMMs do 14% more
/// multiply-adds than over the assembled gradient, against its pass over 3 x [M, H, ~N+V]
/// values); dk_pe as mla_rope_kv's. dlatent is summed in two GEMMs (rounded between them),
/// not one: gradients within a rounding step of mla_rope_kv's, not its bits. Every device (CPU:
/// at::linear and the references). Throws c10::Error naming shapes, dtypes or devices that do
/// not fit.
std::pair<at::Tensor, at::Tensor> mla_project_rope_kv(const at::Tensor& latent_MC, const at::Tensor& w_NC,
                                                      const at::Tensor& k_pe, int64_t heads, int64_t nope_dim,
                                                      const at::Tensor& positions, const at::Tensor& cos_table,
                                                      const at::Tensor& sin_table, bool interleaved);

/// LibTorch references (rope_rotate_ref and concatenations), differentiable through autograd.
at::Tensor mla_rope_q_ref(const at::Tensor& qs, int64_t nope_dim, const at::Tensor& positions,
                          const at::Tensor& cos_table, const at::Tensor& sin_table, bool interleaved);
std::pair<at::Tensor, at::Tensor> mla_rope_kv_ref(const at::Tensor& kv, const at::Tensor& k_pe, int64_t nope_dim,
                                                  const at::Tensor& positions, const at::Tensor& cos_table,
                                                  const at::Tensor& sin_table, bool interleaved);

/// True when mla_rope_q / mla_rope_kv run the kernels for these inputs (else the references).
bool mla_rope_q_uses_kernel(const at::Tensor& qs, int64_t nope_dim);
bool mla_rope_kv_uses_kernel(const at::Tensor& kv, const at::Tensor& k_pe, int64_t nope_dim);

}  // namespace kiln::kernels

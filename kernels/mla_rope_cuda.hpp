#pragma once
// Host entry points of kernels/mla_rope.cu (CUDA builds only); arguments checked by the caller
// (kernels/mla_rope.cpp), outputs contiguous and allocated there.
#include <ATen/core/Tensor.h>

namespace kiln::kernels::cuda {
/// out [T, H, N+R] = [in[..., :N] | rotate(in[..., N:])]; inverse: the rotation's transpose
/// (the backward of mla_rope_q: sin negated, fp32, one rounding).
void mla_rope_q(const at::Tensor& in, int64_t nope_dim, const at::Tensor& positions, const at::Tensor& cos_table,
                const at::Tensor& sin_table, bool interleaved, bool inverse, at::Tensor& out);
/// q [T, H, N+R] with q[..., N:] rotated in place (inverse: the transpose rotation, fp32, one
/// rounding); the rope part's pairs each handled by one thread.
void mla_rope_q_inplace(at::Tensor& q, int64_t nope_dim, const at::Tensor& positions, const at::Tensor& cos_table,
                        const at::Tensor& sin_table, bool interleaved, bool inverse);
/// k [T, H, N+R] and v [T, H, V] from kv [T, H, N+V] and k_pe [T, R].
void mla_rope_kv_forward(const at::Tensor& kv, const at::Tensor& k_pe, int64_t nope_dim, const at::Tensor& positions,
                         const at::Tensor& cos_table, const at::Tensor& sin_table, bool interleaved, at::Tensor& k,
                         at::Tensor& v);
/// k [T, H, N+R] contiguous with k[..., :N] already written: only k[..., N:] = rope(k_pe) per head.
void mla_rope_kv_forward_rope(const at::Tensor& k_pe, int64_t nope_dim, const at::Tensor& positions,
                              const at::Tensor& cos_table, const at::Tensor& sin_table, bool interleaved, at::Tensor& k);
/// dkv [T, H, N+V] = [dk[..., :N] | dv] (skipped when dkv is undefined; dv unread then);
/// dk_pe [T, R] = rotation^T(sum over heads of dk[..., N:]).
void mla_rope_kv_backward(const at::Tensor& dk, const at::Tensor& dv, int64_t nope_dim, const at::Tensor& positions,
                          const at::Tensor& cos_table, const at::Tensor& sin_table, bool interleaved, at::Tensor& dkv,
                          at::Tensor& dk_pe);
}  // namespace kiln::kernels::cuda

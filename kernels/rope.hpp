#pragma once
// Rotary position embedding (RoPE; Su et al. 2021, "RoFormer", arXiv:2104.09864), the rotation
// of transformers' apply_rotary_pos_emb: pair (x0, x1) of head dim r -> (x0 c - x1 s, x1 c + x0 s)
// with c = cos, s = sin of the token's angle for the pair. Pairs: (2i, 2i+1) when interleaved
// (DeepSeek-V2 / GLM's rope_interleave), else (i, i + R/2).
//
// Legend: T tokens, H heads, R rope dims (even), P positions of a table.
// Every product and every sum is rounded to x's dtype, as the LibTorch ops of
// rope_rotate_rows compute them (opmath fp32, one rounding per op), so the kernel and the
// reference give the same bits.
#include <ATen/core/Tensor.h>

namespace kiln::kernels {

/// x [T, H, R], cos and sin [T, R/2] (x's dtype, one row per token) -> [T, H, R] in x's dtype.
/// LibTorch ops, differentiable in x; any device.
at::Tensor rope_rotate_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved);

/// x [T, H, R] (last dim contiguous), positions [T] int64 in [0, P), cos_table and sin_table
/// [P, R/2] (x's dtype) -> [T, H, R] in x's dtype: rope_rotate_rows with the tables' rows at
/// `positions`. CUDA tensors of fp32, bf16 or fp16 when no gradient is recorded: one kernel
/// (kernels/rope.cu; a position outside [0, P) reads row 0 or P - 1, the reference refuses
/// it); else the reference below. Throws c10::Error on shapes, dtypes or devices that
/// disagree, naming them.
at::Tensor rope_rotate(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_table,
                       const at::Tensor& sin_table, bool interleaved);
/// LibTorch reference: index_select of the tables' rows, then rope_rotate_rows.
at::Tensor rope_rotate_ref(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_table,
                           const at::Tensor& sin_table, bool interleaved);

}  // namespace kiln::kernels

#pragma once
// The index work and the combine of model::MoE's dispatch (model/blocks/moe.hpp) as kernels.
// Legend: T tokens, K experts per token, E experts, M = T*K slots (slot t*K + k is token t's
// k-th expert), D hidden.
//
// dispatch_order: the M rows of the expert computation in expert order, ties in slot order
// (a stable sort of the flat expert ids):
//   slot [M]         the slot of row r
//   token_index [M]  slot / K: the token row r reads
//   row_of_slot [M]  the inverse permutation: row_of_slot[slot[r]] = r
//   counts [E]       rows per expert
// ids [T, K] int64 in [0, E) (all int64, on ids' device). CUDA with M <= 1024 and E <= 1024:
// one CTA (kernels/moe_dispatch.cu: per-warp ranks by __match_any_sync over 32-slot chunks,
// per-chunk and per-expert offsets in shared memory; an id outside [0, E) is clamped into
// it); otherwise the reference: LibTorch's stable sort, searchsorted for the counts (no host
// read: the step stays capturable in a CUDA graph). Both give the same integers.
//
// moe_combine: y[t] = sum_k weights[t, k] * rows[row_of_slot[t*K + k]], products and sum in
// fp32 (k = 0, 1, ... in the kernel), rounded once to rows' dtype. rows [M, D], row_of_slot
// [M] int64, weights [T, K] fp32 -> [T, D]. CUDA (bf16, fp16 or fp32 rows): one kernel; else the reference (index_select, the products, sum over K),
// whose sum order is LibTorch's: the two agree to the rounding of the fp32 sum. No autograd
// (its gradient is moe_combine_backward; model::combine ties the two together for training).
//
// moe_combine_backward: moe_combine's gradients for grad_y [T, D] (rows' dtype):
//   rows    [M, D]: grad_rows[row_of_slot[t*K + k]] = weights[t, k] * grad_y[t]  (fp32 product,
//                   rounded once to rows' dtype; every row written once: no atomics)
//   weights [T, K]: sum_d rows[row_of_slot[t*K + k], d] * grad_y[t, d]           (fp32)
// CUDA (bf16, fp16 or fp32 rows): one kernel, one CTA per token (its K dot products summed per
// thread in d order, then across the CTA in a fixed order: the same bits on every run); else the
// reference (the autograd formulas of the reference forward: products, index_copy, sum over D),
// equal to the kernel up to the order of the fp32 sums over D.
// gather_rows: out[r] = src[index[r]], src [N, D], index [M] int64 with values in [0, N) -> [M, D]
// in src's dtype: index_select's values (bit for bit except that a -0.0 comes out as +0.0 and a
// NaN as the canonical NaN on CUDA, where the kernel adds 1 * x to an fp32 0). CUDA (bf16, fp16
// or fp32): moe_combine's kernel with K = 1 and unit weights (16-byte vectors) — ATen's
// index_select moves one element per thread, several times slower at the MoE's [T*K, D] rows;
// an index outside [0, N) is not checked there (the callers' indices come from dispatch_order).
// Elsewhere index_select.
// Throws c10::Error on shapes, dtypes or devices that disagree, naming them.
#include <ATen/core/Tensor.h>

namespace kiln::kernels {

struct DispatchOrder {
  at::Tensor slot, token_index, row_of_slot, counts;
};
DispatchOrder dispatch_order(const at::Tensor& ids_TK, int64_t num_experts);
DispatchOrder dispatch_order_ref(const at::Tensor& ids_TK, int64_t num_experts);

at::Tensor moe_combine(const at::Tensor& rows_MD, const at::Tensor& row_of_slot_M, const at::Tensor& weights_TK);
at::Tensor moe_combine_ref(const at::Tensor& rows_MD, const at::Tensor& row_of_slot_M, const at::Tensor& weights_TK);

at::Tensor gather_rows(const at::Tensor& src_ND, const at::Tensor& index_M);

struct CombineGrads {
  at::Tensor rows_MD, weights_TK;
};
CombineGrads moe_combine_backward(const at::Tensor& rows_MD, const at::Tensor& row_of_slot_M,
                                  const at::Tensor& weights_TK, const at::Tensor& grad_TD);
CombineGrads moe_combine_backward_ref(const at::Tensor& rows_MD, const at::Tensor& row_of_slot_M,
                                      const at::Tensor& weights_TK, const at::Tensor& grad_TD);

}  // namespace kiln::kernels

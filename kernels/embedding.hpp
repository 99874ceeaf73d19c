#pragma once
// Token embedding for training: y [T, D] = weight[ids] (at::embedding's forward), with the
// weight's gradient made by one pass over the dense [V, D] gradient.
//
// Legend: T tokens, V vocabulary rows, D embedding width.
//
//   embedding_backward(dy [T, D], ids [T], V) -> dweight [V, D], row v = sum of dy[t] over the
//   t with ids[t] = v (fp32, rounded once to dy's dtype), zeros for every other row
//
// the values of PyTorch's embedding_dense_backward (padding_idx -1, no scaling by frequency),
// its fp32 sums taken in another order (within a rounding step of the dtype, not its bits).
// Why: LibTorch's CUDA backward zero-fills the [V, D] gradient (634 MB at GLM-4.7-Flash's V =
// 154880, D = 2048, bf16), then sorts the ids, sums segments of rows into fp32 partials and
// scatters their sums: ~30 launches, 0.56 ms of an 8192-token step on the H100. Here
// (kernels/embedding.cu): the ids sorted with their positions (cub's stable radix sort), whole 32-entry chunks of one id summed by their own warps, then one kernel
// writing every row of the gradient once: a warp per row finds its tokens in the sorted ids
// (binary search) and sums their dy rows in position order in fp32 (for a run longer than 64,
// the rows before and after its whole chunks and the chunks' sums in order: a token repeated
// through a pack, as degenerate rollouts repeat one, does not leave one warp summing thousands
// of rows in series), or writes zeros. No atomics: the same bits every run.
// CUDA: dy bf16, fp16 or fp32, contiguous rows from a 16-byte boundary, D a multiple of 16
// bytes' elements, V < 2^31; elsewhere (CPU, other layouts) at::embedding_dense_backward.
// ids must lie in [0, V), as at::embedding's forward requires (the kernels: an id outside
// adds to no row; read on the device, it is not checked there). Throws c10::Error naming
// shapes, dtypes or devices that do not fit.
#include <ATen/core/Tensor.h>

namespace kiln::kernels {

/// weight [V, D], ids [...] int64 -> [..., D]; differentiable in weight (its gradient by
/// embedding_backward), as at::embedding (padding_idx -1, no scale_grad_by_freq, dense).
at::Tensor embedding(const at::Tensor& weight, const at::Tensor& ids);
/// dy [T, D], ids [T] int64, V -> [V, D] in dy's dtype (the kernels above on CUDA).
at::Tensor embedding_backward(const at::Tensor& dy, const at::Tensor& ids, int64_t V);
/// at::embedding_dense_backward's gradient, any device.
at::Tensor embedding_backward_ref(const at::Tensor& dy, const at::Tensor& ids, int64_t V);
/// True when embedding_backward runs kiln's kernels for these inputs.
bool embedding_backward_uses_kernel(const at::Tensor& dy, const at::Tensor& ids, int64_t V);

}  // namespace kiln::kernels

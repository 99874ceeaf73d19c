#pragma once
// Token embedding, forward and backward (torch.nn.functional.embedding without padding_idx,
// max_norm or scale_grad_by_freq):
//   out[t]    = weight[ids[t]]                                       [T, D]
//   dweight[v] = sum over the t with ids[t] == v of dout[t]          [V, D], 0 where no t reads v
// Legend: T tokens, V vocabulary rows, D hidden.
// The backward on CUDA (kernels/embedding.cu): the ids sorted once (stable, LibTorch; int32
// keys), each vocabulary row then written by one warp, its tokens' gradient rows summed in fp32
// in token order and rounded once to the gradient's dtype: every row of [V, D] written once,
// with no zero fill before it and no atomics (the same bits on every run). LibTorch's
// embedding_dense_backward, which it replaces, fills [V, D] with zeros, sorts int64 ids and runs
// two more kernels over the tokens (0.47 ms at T 8192, V 154880, D 2048 on an H100, of which
// the fill is 0.19).
#include <ATen/core/Tensor.h>

namespace kiln::kernels {

/// weight_VD [V, D] (any dtype), ids_T [T] int64 on its device, in [0, V) -> [T, D] (as
/// at::embedding, which checks the ids on CPU and asserts on CUDA); differentiable in weight,
/// its gradient from embedding_backward.
at::Tensor embedding(const at::Tensor& weight_VD, const at::Tensor& ids_T);

/// grad_TD [T, D] (fp32, bf16 or fp16), ids_T [T] int64 in [0, V) on its device -> [V, D] in
/// grad's dtype. CUDA with rows of a multiple of 16 bytes on 16-byte boundaries: the kernel
/// above; elsewhere embedding_backward_ref. Throws c10::Error naming a shape, dtype or device
/// that does not fit.
at::Tensor embedding_backward(const at::Tensor& grad_TD, const at::Tensor& ids_T, int64_t V);

/// LibTorch's at::embedding_dense_backward (any device).
at::Tensor embedding_backward_ref(const at::Tensor& grad_TD, const at::Tensor& ids_T, int64_t V);

/// True when embedding_backward runs kiln's kernel for these inputs.
bool embedding_backward_uses_kernel(const at::Tensor& grad_TD, const at::Tensor& ids_T);

}  // namespace kiln::kernels

#pragma once
// SwiGLU activation over a packed gate/up projection (Shazeer 2020, "GLU Variants Improve
// Transformer", arXiv:2002.05202), the layout of grouped_swiglu's first grouped GEMM
// (kernels/moe.hpp): gu [M, 2F] holds the gate columns [0, F) and then the up columns [F, 2F).
//
//   swiglu_packed(gu) = silu(gate) * up  -> [M, F] in gu's dtype,  silu(x) = x / (1 + e^-x)
//
// Differentiable in gu: the backward writes d gate and d up into one [M, 2F] gradient (no
// zero-filled halves added together, as autograd through two narrow views does).
// Rounding: LibTorch's, op by op (the reference below: silu rounded to gu's dtype, then the
// product rounded; backward: d up = dy * silu(gate), d s = dy * up, each rounded, then d gate =
// d s * sig (1 + gate (1 - sig)) rounded, sig = 1 / (1 + e^-gate), every op in fp32), so the
// kernel agrees with the reference to within a 16-bit rounding step (expf may differ in its
// last bit from the one LibTorch was built with).
// CUDA, bf16 or fp16, gu contiguous from a 16-byte boundary with F a multiple of 8 and no limit: one kernel each way
// (kernels/swiglu.cu, 16-byte vectors); anything else (CPU, fp32, swiglu_limit): the reference.
// swiglu_limit: transformers' clamped form (kernels::swiglu).
// Throws c10::Error when gu is not [M, 2F].
#include <ATen/core/Tensor.h>

#include <optional>
#include <utility>

namespace kiln::kernels {

at::Tensor swiglu_packed(const at::Tensor& gu_M2F, std::optional<double> swiglu_limit = std::nullopt);
/// kernels::swiglu on the two halves (LibTorch ops, differentiable through autograd).
at::Tensor swiglu_packed_ref(const at::Tensor& gu_M2F, std::optional<double> swiglu_limit = std::nullopt);
/// True when swiglu_packed runs the kernels for this input.
bool swiglu_packed_uses_kernel(const at::Tensor& gu_M2F, std::optional<double> swiglu_limit = std::nullopt);

/// kernels::swiglu(gate, up, limit) over two [M, F] tensors (the dense MLPs' and shared experts'
/// separate gate and up projections) by the same kernels, rows read at their strides: one pass
/// each way (autograd ran silu and mul, and backward two muls and silu_backward). Differentiable
/// in both; the backward writes d gate and d up, each [M, F] contiguous. Kernel conditions as
/// swiglu_packed's (CUDA bf16/fp16, no limit, F % 8 == 0, last dims contiguous, rows on 16-byte
/// boundaries), else kernels::swiglu. Throws c10::Error when gate and up differ in shape.
at::Tensor swiglu_pair(const at::Tensor& gate_MF, const at::Tensor& up_MF, std::optional<double> swiglu_limit = std::nullopt);
/// The routed experts' SwiGLU backward with the combine weight folded in (kernels::
/// routed_experts_combine's backward, kernels/moe.hpp): for row r of the packed projection gu
/// [M, 2F], h [M, F] = dL/d(act) before the row's combine weight w_row [M] fp32 is applied
/// (the down projection's input gradient of the unweighted output gradient), and
/// act = swiglu_packed(gu) recomputed (rounded as the forward rounds it):
///   dgu[r]     = swiglu_packed's backward at gu[r] of dy = w_row[r] * h[r] (fp32, not rounded)
///   act_w[r]   = w_row[r] * act[r], rounded to gu's dtype     (the down weight's GEMM operand)
///   dw_row[r]  = sum_f h[r, f] * act[r, f] in fp32             (dL/dw_row[r])
/// gu, h: one dtype; -> {dgu [M, 2F], act_w [M, F] in gu's dtype, dw_row [M] fp32}. CUDA with
/// swiglu_packed_uses_kernel(gu, limit), h contiguous and 16-byte aligned: one kernel, a warp
/// per row (the row sum over f in a fixed order: the same bits every run); elsewhere the
/// reference (LibTorch ops, the clamped form with a limit: no gradient through a clamped entry,
/// as torch.clamp). Throws c10::Error naming a shape or dtype that does not fit.
struct SwigluRoutedGrads {
  at::Tensor dgu, act_w, dw_row;
};
SwigluRoutedGrads swiglu_routed_backward(const at::Tensor& gu_M2F, const at::Tensor& h_MF, const at::Tensor& w_row_M,
                                         std::optional<double> swiglu_limit = std::nullopt);
SwigluRoutedGrads swiglu_routed_backward_ref(const at::Tensor& gu_M2F, const at::Tensor& h_MF,
                                             const at::Tensor& w_row_M, std::optional<double> swiglu_limit = std::nullopt);

/// swiglu_pair's backward as a plain function (no autograd; a caller that recomputes the
/// activation instead of keeping it): gate, up, dy [M, F] -> {d gate, d up} [M, F] contiguous,
/// the same kernel and conditions as swiglu_pair's backward, else autograd through
/// kernels::swiglu (the clamped form with a limit). With want_act, also act [M, F] contiguous
/// = swiglu_pair(gate, up, limit)'s value (its bits), written by the same pass on the kernel
/// path (gate and up read once for both: a down projection's weight gradient needs act).
/// Throws c10::Error when the shapes differ.
struct SwigluPairGrads {
  at::Tensor dgate, dup, act;  ///< act undefined unless asked for
};
SwigluPairGrads swiglu_pair_backward(const at::Tensor& gate_MF, const at::Tensor& up_MF, const at::Tensor& dy_MF,
                                     std::optional<double> swiglu_limit = std::nullopt, bool want_act = false);
/// True when swiglu_pair runs the kernels for these inputs.
bool swiglu_pair_uses_kernel(const at::Tensor& gate_MF, const at::Tensor& up_MF,
                             std::optional<double> swiglu_limit = std::nullopt);

}  // namespace kiln::kernels

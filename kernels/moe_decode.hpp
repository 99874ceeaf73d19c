#pragma once
// The routed experts' SwiGLU for a decode step: few rows per expert (a batch of B sequences has
// B * K rows over E experts: ~2 per touched expert at B = 32 on GLM-4.7-Flash), where the step's
// cost is reading each touched expert's weights once. Legend as kernels/moe.hpp: M rows in
// expert order, D hidden, F expert intermediate, E experts.
//
// grouped_swiglu_decode(x, counts, w_gate_up_EFD, w_down_EDF, swiglu_limit): the function of
// kernels::grouped_swiglu (transformers' Glm4MoeLiteExperts: y[r] = W_down[e] swiglu(W_gate[e]
// x[r], W_up[e] x[r]) for the rows r of expert e), for inference (no autograd). x [M, D],
// counts [E] int64 on x's device summing to M, w_gate_up_EFD [E, 2F, D], w_down_EDF [E, D, F]
// -> [M, D] in x's dtype.
// CUDA (kernels/moe_decode.cu, when grouped_swiglu_decode_supports()): two kernels, gate/up with
// the SwiGLU, then down; a CTA per (64 weight rows, expert) streams those rows' weights once
// (a 4-stage cp.async pipeline, chunks of 64 along K) and multiplies them with the expert's rows
// (32 per pass) on the tensor cores (mma.sync m16n8k16, fp32 accumulation; the weights as the
// 16-row operand, the rows as the 8-column one); an expert with no rows reads nothing. Gate and
// up are rounded to x's dtype before the activation and the activation after it, as the
// grouped-GEMM path rounds its outputs. The row counts stay on the device (no host sync:
// capturable in a CUDA graph). Any row distribution is correct; an expert with more than 32
// rows streams its weights once per 32, so the caller takes it for small M only (MoE decode
// steps).
// Elsewhere (CPU, other dtypes or widths) it is kernels::grouped_swiglu.
// Throws c10::Error on shape mismatch.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace kiln::kernels {

at::Tensor grouped_swiglu_decode(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& w_gate_up_EFD,
                                 const at::Tensor& w_down_EDF, std::optional<double> swiglu_limit = std::nullopt);
/// While one lives on this thread (the rollout engine's steps: EngineOptions::moe_decode_kernel),
/// kernels::grouped_swiglu with grad mode off and at most `max_rows` rows runs
/// grouped_swiglu_decode when it supports the inputs (kernels captured in a CUDA graph meanwhile
/// are those kernels). Nests: the destructor restores the setting it found. Training (grad mode
/// on) and the trainer's log-prob forwards (no guard) never take it.
class DecodeExpertsGuard {
 public:
  explicit DecodeExpertsGuard(bool on, int64_t max_rows = kDecodeExpertsMaxRows);
  ~DecodeExpertsGuard();
  DecodeExpertsGuard(const DecodeExpertsGuard&) = delete;
  DecodeExpertsGuard& operator=(const DecodeExpertsGuard&) = delete;
  /// Rows up to which grouped_swiglu takes the decode kernels on this thread now; 0: none.
  static int64_t max_rows();
  /// The default bound: 1024 rows (B * K <= 1024, e.g. 256 sequences at K = 4: ~16 rows per
  /// expert of 64). Past it, experts of more than 32 rows become common and each reads its
  /// weights again per 32 rows; the grouped GEMM reads them once (docs/benchmarks.md).
  static constexpr int64_t kDecodeExpertsMaxRows = 1024;

 private:
  int64_t previous_;
};

/// True when grouped_swiglu_decode runs its kernels for these inputs: a CUDA build, CUDA bf16 x
/// and weights, D and F multiples of 64 (GLM-4.7-Flash: D 2048, F 1536).
bool grouped_swiglu_decode_supports(const at::Tensor& x, const at::Tensor& w_gate_up_EFD, const at::Tensor& w_down_EDF);
/// Calls of grouped_swiglu_decode that ran its CUDA kernels, in this process so far (what tests
/// tell the two paths apart by: both round alike, so their outputs may be equal bit for bit).
int64_t grouped_swiglu_decode_kernel_calls();

}  // namespace kiln::kernels

#pragma once
// Whether a CUDA training step takes the fused passes of 2026-12-07 (process-wide, like
// set_recompute_in_backward): MLA's query rotated in place in q_b's output and kv_b's gradients
// from dk and dv as they are (kernels::mla_project_rope_q / mla_project_rope_kv), the decoder
// layer's residual additions and their gradient sums inside its norms' kernels
// (RMSNorm::forward_pass / forward_add), the dense and shared MLPs' activation for the down
// weight's gradient from the SwiGLU backward's own pass, and the embedding's weight gradient
// in one pass (kernels::embedding). The forward's values are the same either way; the gradients
// agree to rounding (tests/kernels/test_mla_rope.cpp, test_rms_norm.cpp, test_embedding.cpp,
// test_swiglu.cpp). On by default since their CUDA cases passed on an H100 and the 8k step ran
// 1.3-1.5% faster with them (docs/benchmarks.md, 2026-12-07); KILN_TRAINING_FUSIONS=0 in the
// environment at start-up turns them off (another value than 0 or 1: c10::Error naming it, at
// the first use).
// On the CPU the model's paths are the composites either way.
namespace kiln::model {

bool training_fusions();
/// Returns the setting it replaces.
bool set_training_fusions(bool on);

/// Whether a CUDA training step runs an MoE layer's shared experts on a second stream beside its
/// router, dispatch, routed experts and combine (kernels::run_beside; MoEImpl::forward), as
/// Megatron-LM's moe_shared_expert_overlap. The same kernels run: the same forward and parameter
/// gradients, bit for bit; the layer's input gradient sums its three parts (shared experts, routed
/// experts, router) in another order, so it agrees to bf16 rounding.
/// On by default (the 8k step 0.5-0.7% faster on an H100: docs/benchmarks.md, 2026-12-07);
/// KILN_SHARED_EXPERT_OVERLAP=0 at start-up turns it off (another value than 0 or 1: c10::Error
/// naming it, at the first use). Not taken in the batch-invariant mode, without grad, or on CPU.
bool shared_expert_overlap();
/// Returns the setting it replaces.
bool set_shared_expert_overlap(bool on);

}  // namespace kiln::model

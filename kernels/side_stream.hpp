#pragma once
// Two independent branches of a layer on one CUDA device at once: `side` queued on a second
// stream of the device while `main` is queued on the current stream, the current stream joined
// to the side's work before return. For branches whose kernels each leave the GPU partly idle:
// an MoE's shared experts (three GEMMs) beside its router, dispatch and grouped GEMMs, as
// Megatron-LM's moe_shared_expert_overlap. Autograd records each op's stream, so the branches'
// backward ops run on the same two streams, the engine making a stream wait where a gradient
// crosses over (and recording the tensor for the consumer's stream).
//
// Memory: the tensors in `side_reads` (made on the current stream, read by `side`) are recorded
// for the side stream, and side's result for the current stream, so the caching allocator
// reuses neither block before the other stream's queued work is done. What `side` allocates
// comes from the side stream's pool (peak memory can be a little higher than one stream's).
// The side stream is one per device and thread's first use (c10's stream pool), so every call
// queues its side work in one order.
#include <torch/torch.h>

#include <functional>
#include <utility>
#include <vector>

namespace kiln::kernels {

/// {main(), side()}. On a CUDA `device` (KILN_CUDA builds): side() is called first, under a
/// stream guard of the side stream, which waits for the current stream's queued work before
/// it starts; then main() on the current stream; then the current stream waits for the side
/// stream. Elsewhere (CPU, or a build without CUDA kernels): side() then main(), in this thread,
/// the same calls in the same order. Whatever either function throws propagates (the current
/// stream still waits for what side queued).
std::pair<torch::Tensor, torch::Tensor> run_beside(torch::Device device, const std::function<torch::Tensor()>& main,
                                                   const std::function<torch::Tensor()>& side,
                                                   const std::vector<torch::Tensor>& side_reads);

}  // namespace kiln::kernels

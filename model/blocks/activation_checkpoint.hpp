#pragma once
// Activation checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost",
// arXiv:1604.06174), in the reentrant form of torch.utils.checkpoint.checkpoint
// (use_reentrant=True): y = f(x) runs without recording a graph, so none of f's activations
// stay alive after it; only x is kept. The backward runs f(x) again with gradients on and
// back-propagates the incoming gradient through that recomputed graph: x's gradient is
// returned and f's parameters' gradients are accumulated into their .grad, as the plain call
// would. One extra forward of f per backward.
//
// Shapes and dtypes: any; x must be a floating tensor. f must compute the same y again from
// the same x (no randomness; an MoE layer's routing depends on x only, or is replayed) and may
// record side outputs (e.g. chosen expert ids) through state it owns: the recomputation
// writes them again. Collectives inside f (expert parallel's all-to-alls) run again in the
// backward, in the same order on every rank, since every rank recomputes the same layers.
// Without grad mode or when x needs no gradient, f(x) is called plainly.
#include <torch/torch.h>

#include <functional>

namespace kiln::model {

torch::Tensor checkpointed(const std::function<torch::Tensor(const torch::Tensor&)>& f, const torch::Tensor& x);

}  // namespace kiln::model

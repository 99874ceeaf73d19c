#include "kernels/embedding.hpp"

#include <torch/torch.h>

#include <limits>

#include "kernels/alignment.hpp"

#ifdef KILN_CUDA
#include "kernels/embedding_cuda.hpp"
#endif

namespace kiln::kernels {

namespace {
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void check(const at::Tensor& grad, const at::Tensor& ids, int64_t V) {
  TORCH_CHECK(grad.dim() == 2 && ids.dim() == 1 && ids.size(0) == grad.size(0), "embedding_backward: grad must be ",
              "[T, D] and ids [T], got ", grad.sizes(), " and ", ids.sizes());
  TORCH_CHECK(ids.scalar_type() == at::kLong, "embedding_backward: ids must be int64, got ", ids.scalar_type());
  TORCH_CHECK(ids.device() == grad.device(), "embedding_backward: ids on ", ids.device(), ", grad on ", grad.device());
  const auto t = grad.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, "embedding_backward: grad must be fp32, bf16 ",
              "or fp16, got ", t);
  TORCH_CHECK(V >= 0, "embedding_backward: V = ", V, " < 0");
}

// out = weight[ids] with embedding_backward as the weight's gradient.
struct EmbeddingFn : public torch::autograd::Function<EmbeddingFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& weight, const torch::Tensor& ids) {
    ctx->save_for_backward({ids});
    ctx->saved_data["V"] = weight.size(0);
    return at::embedding(weight, ids);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto ids = ctx->get_saved_variables()[0];
    const int64_t V = ctx->saved_data["V"].toInt(), D = grads[0].size(-1);
    return {embedding_backward(grads[0].reshape({-1, D}), ids.reshape({-1}), V), torch::Tensor()};
  }
};
}  // namespace

at::Tensor embedding(const at::Tensor& weight_VD, const at::Tensor& ids_T) {
  TORCH_CHECK(weight_VD.dim() == 2, "embedding: weight must be [V, D], got ", weight_VD.sizes());
  TORCH_CHECK(ids_T.scalar_type() == at::kLong && ids_T.device() == weight_VD.device(), "embedding: ids must be ",
              "int64 on the weight's device (", weight_VD.device(), "), got ", ids_T.scalar_type(), " on ",
              ids_T.device());
  return EmbeddingFn::apply(weight_VD, ids_T);
}

at::Tensor embedding_backward_ref(const at::Tensor& grad_TD, const at::Tensor& ids_T, int64_t V) {
  check(grad_TD, ids_T, V);
  return at::embedding_dense_backward(grad_TD, ids_T, V, /*padding_idx=*/-1, /*scale_grad_by_freq=*/false);
}

bool embedding_backward_uses_kernel(const at::Tensor& grad_TD, const at::Tensor& ids_T) {
#ifdef KILN_CUDA
  const auto t = grad_TD.scalar_type();
  return grad_TD.is_cuda() && ids_T.is_cuda() && grad_TD.dim() == 2 &&
         (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf) &&
         (grad_TD.size(1) * int64_t(grad_TD.element_size())) % 16 == 0;
#else
  (void)grad_TD;
  (void)ids_T;
  return false;
#endif
}

at::Tensor embedding_backward(const at::Tensor& grad_TD, const at::Tensor& ids_T, int64_t V) {
  check(grad_TD, ids_T, V);
  if (!embedding_backward_uses_kernel(grad_TD, ids_T)) return embedding_backward_ref(grad_TD, ids_T, V);
#ifdef KILN_CUDA
  // The tokens in id order (stable: token order within an id), as int32 keys when the ids fit
  // (4 radix passes, not 8), and where each id's run starts: [V + 1], no host read.
  const bool narrow = V < std::numeric_limits<int32_t>::max();
  const auto keys = narrow ? ids_T.to(at::kInt) : ids_T;
  auto [sorted, order] = keys.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false);
  const auto offsets = at::searchsorted(sorted, at::arange(V + 1, keys.options()));  // [V + 1] int64
  auto out = at::empty({V, grad_TD.size(1)}, grad_TD.options());
  if (grad_TD.size(0) == 0) return out.zero_();
  cuda::embedding_backward(aligned_contiguous(grad_TD), order, offsets, out);
  return out;
#else
  return embedding_backward_ref(grad_TD, ids_T, V);
#endif
}

}  // namespace kiln::kernels

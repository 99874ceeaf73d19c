#include "kernels/embedding.hpp"

#include <torch/torch.h>

#include "kernels/alignment.hpp"

#ifdef KILN_CUDA
#include "kernels/embedding_cuda.hpp"
#endif

namespace kiln::kernels {

namespace {
void check(const at::Tensor& dy, const at::Tensor& ids, int64_t V) {
  TORCH_CHECK(dy.dim() == 2 && ids.dim() == 1 && ids.size(0) == dy.size(0) && V > 0,
              "embedding_backward: dy [T, D], ids [T] and V > 0 expected, got dy ", dy.sizes(), ", ids ", ids.sizes(),
              " and V = ", V);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.device() == dy.device(), "embedding_backward: ids must be int64 on dy's device (",
              dy.device(), "), got ", ids.scalar_type(), " on ", ids.device());
}

struct EmbeddingFn : public torch::autograd::Function<EmbeddingFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& weight, const at::Tensor& ids) {
    ctx->save_for_backward({ids});
    ctx->saved_data["V"] = weight.size(0);
    ctx->saved_data["D"] = weight.size(1);
    return at::embedding(weight, ids);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    const auto ids = ctx->get_saved_variables()[0].reshape({-1});
    const auto dy = g[0].reshape({ids.size(0), ctx->saved_data["D"].toInt()});  // [T, D] (T may be 0)
    return {embedding_backward(dy, ids, ctx->saved_data["V"].toInt()), at::Tensor()};
  }
};
}  // namespace

at::Tensor embedding_backward_ref(const at::Tensor& dy, const at::Tensor& ids, int64_t V) {
  check(dy, ids, V);
  return at::embedding_dense_backward(dy, ids, V, /*padding_idx=*/-1, /*scale_grad_by_freq=*/false);
}

bool embedding_backward_uses_kernel(const at::Tensor& dy, const at::Tensor& ids, int64_t V) {
#ifdef KILN_CUDA
  const auto t = dy.scalar_type();
  const int64_t n = t == at::kFloat ? 4 : (t == at::kBFloat16 || t == at::kHalf) ? 8 : 0;
  return dy.is_cuda() && n > 0 && dy.dim() == 2 && dy.size(1) > 0 && dy.size(1) % n == 0 && dy.is_contiguous() &&
         aligned16(dy) &&
         ids.numel() < (int64_t(1) << 31) && V < (int64_t(1) << 31);
#else
  (void)dy;
  (void)ids;
  (void)V;
  return false;
#endif
}

at::Tensor embedding_backward(const at::Tensor& dy, const at::Tensor& ids, int64_t V) {
  check(dy, ids, V);
#ifdef KILN_CUDA
  const auto d = dy.is_cuda() ? aligned_contiguous(dy) : dy;
  if (embedding_backward_uses_kernel(d, ids, V)) {
    auto dw = at::empty({V, d.size(1)}, d.options());
    cuda::embedding_backward(d, ids.contiguous(), dw);
    return dw;
  }
#endif
  return embedding_backward_ref(dy, ids, V);
}

at::Tensor embedding(const at::Tensor& weight, const at::Tensor& ids) {
  TORCH_CHECK(weight.dim() == 2 && ids.scalar_type() == at::kLong && ids.device() == weight.device(),
              "embedding: weight [V, D] and int64 ids on its device expected, got weight ", weight.sizes(), " on ",
              weight.device(), ", ids ", ids.scalar_type(), " on ", ids.device());
  return EmbeddingFn::apply(weight, ids);
}

}  // namespace kiln::kernels

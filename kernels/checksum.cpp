#include "kernels/checksum.hpp"

#include <torch/torch.h>

#ifdef KILN_CUDA
#include "kernels/checksum_cuda.hpp"
#endif

namespace kiln::kernels {

namespace {
int64_t halves_of(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), "checksum: tensor must be contiguous");
  const int64_t bytes = t.numel() * int64_t(t.element_size());
  TORCH_CHECK(bytes % 2 == 0, "checksum: tensor of ", bytes, " bytes; an even byte count is needed");
  return bytes / 2;
}
}  // namespace

at::Tensor checksum_ref(const at::Tensor& t) {
  const int64_t halves = halves_of(t);
  if (halves == 0) return torch::zeros({}, t.options().dtype(torch::kInt64));
  auto bytes = t.view({-1}).view(torch::kUInt8);                                   // [2 * halves]
  if (halves % 2) bytes = torch::cat({bytes, torch::zeros({2}, bytes.options())});  // pad the last word
  auto w = bytes.view(torch::kInt32).to(torch::kInt64).bitwise_and(int64_t(0xffffffffLL));  // little-endian words
  const int64_t n = w.size(0);
  const int64_t mask = int64_t(0xffffffffLL);
  auto idx = torch::arange(1, n + 1, t.options().dtype(torch::kInt64));
  auto m = (idx * int64_t(2654435761LL)).bitwise_and(mask).bitwise_or(1);
  // w * m < 2^64 wraps in int64 two's complement; its low 32 bits are the product mod 2^32.
  return (w * m).bitwise_and(mask).sum();  // < 2^32 per term; int64 sum wraps mod 2^64 like the kernel
}

at::Tensor checksum(const at::Tensor& t) {
#ifdef KILN_CUDA
  if (t.is_cuda()) {
    const int64_t n = halves_of(t);
    auto out = torch::empty({}, t.options().dtype(torch::kInt64));
    cuda::checksum_copy(t.data_ptr(), nullptr, n, out);
    return out;
  }
#endif
  return checksum_ref(t);
}

at::Tensor copy_with_checksum(at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.sizes() == src.sizes() && dst.scalar_type() == src.scalar_type() && dst.device() == src.device(),
              "copy_with_checksum: dst ", dst.sizes(), " ", dst.scalar_type(), " on ", dst.device(), " vs src ",
              src.sizes(), " ", src.scalar_type(), " on ", src.device());
#ifdef KILN_CUDA
  if (src.is_cuda() && dst.is_contiguous()) {
    const int64_t n = halves_of(src);
    auto out = torch::empty({}, src.options().dtype(torch::kInt64));
    cuda::checksum_copy(src.data_ptr(), dst.data_ptr(), n, out);
    return out;
  }
#endif
  dst.copy_(src);
  return checksum_ref(src.contiguous());
}

void checksum_add(const at::Tensor& t, at::Tensor& acc) {
  TORCH_CHECK(acc.dim() == 0 && acc.scalar_type() == torch::kInt64 && acc.device() == t.device(),
              "checksum_add: acc must be a 0-dim int64 tensor on ", t.device());
#ifdef KILN_CUDA
  if (t.is_cuda()) {
    cuda::checksum_copy(t.data_ptr(), nullptr, halves_of(t), acc, /*zero=*/false);
    return;
  }
#endif
  acc.add_(checksum_ref(t));
}

void copy_with_checksum_add(at::Tensor& dst, const at::Tensor& src, at::Tensor& acc) {
  TORCH_CHECK(acc.dim() == 0 && acc.scalar_type() == torch::kInt64 && acc.device() == src.device(),
              "copy_with_checksum_add: acc must be a 0-dim int64 tensor on ", src.device());
#ifdef KILN_CUDA
  if (src.is_cuda() && dst.is_contiguous() && dst.sizes() == src.sizes() && dst.scalar_type() == src.scalar_type() &&
      dst.device() == src.device()) {
    cuda::checksum_copy(src.data_ptr(), dst.data_ptr(), halves_of(src), acc, /*zero=*/false);
    return;
  }
#endif
  acc.add_(copy_with_checksum(dst, src));
}

}  // namespace kiln::kernels

#include "kernels/checksum.hpp"

#include <torch/torch.h>

#ifdef KILN_CUDA
#include "kernels/checksum_cuda.hpp"
#endif

namespace kiln::kernels {

namespace {
int64_t words_of(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), "checksum: tensor must be contiguous");
  const int64_t bytes = t.numel() * int64_t(t.element_size());
  TORCH_CHECK(bytes % 2 == 0, "checksum: tensor of ", bytes, " bytes; an even byte count is needed");
  return bytes / 2;
}
}  // namespace

at::Tensor checksum_ref(const at::Tensor& t) {
  const int64_t n = words_of(t);
  if (n == 0) return torch::zeros({}, t.options().dtype(torch::kInt64));
  auto bytes = t.view({-1}).view(torch::kUInt8);                                   // [2n]
  auto w = bytes.view(torch::kInt16).to(torch::kInt64).bitwise_and(0xffff);        // [n] little-endian words
  auto idx = torch::arange(1, n + 1, t.options().dtype(torch::kInt64));
  auto m = (idx * int64_t(2654435761LL)).bitwise_and(int64_t(0xffffffffLL)).bitwise_or(1);
  return (w * m).sum();  // int64 sum wraps mod 2^64, as the kernel's uint64
}

at::Tensor checksum(const at::Tensor& t) {
#ifdef KILN_CUDA
  if (t.is_cuda()) {
    const int64_t n = words_of(t);
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
    const int64_t n = words_of(src);
    auto out = torch::empty({}, src.options().dtype(torch::kInt64));
    cuda::checksum_copy(src.data_ptr(), dst.data_ptr(), n, out);
    return out;
  }
#endif
  dst.copy_(src);
  return checksum_ref(src.contiguous());
}

}  // namespace kiln::kernels

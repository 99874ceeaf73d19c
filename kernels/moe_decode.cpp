#include "kernels/moe_decode.hpp"

#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <limits>

#include "kernels/moe.hpp"

#ifdef KILN_CUDA
#include "kernels/moe_decode_cuda.hpp"
#endif

namespace kiln::kernels {

namespace {
thread_local int64_t decode_rows = 0;  // DecodeExpertsGuard's bound on this thread; 0: off
std::atomic<int64_t> kernel_calls{0};
}  // namespace

int64_t grouped_swiglu_decode_kernel_calls() { return kernel_calls.load(); }

DecodeExpertsGuard::DecodeExpertsGuard(bool on, int64_t max_rows) : previous_(decode_rows) {
  decode_rows = on ? max_rows : 0;
}
DecodeExpertsGuard::~DecodeExpertsGuard() { decode_rows = previous_; }
int64_t DecodeExpertsGuard::max_rows() { return decode_rows; }

bool grouped_swiglu_decode_supports(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2) {
#ifdef KILN_CUDA
  if (!(x.is_cuda() && x.scalar_type() == at::kBFloat16 && w1.scalar_type() == at::kBFloat16 &&
        w2.scalar_type() == at::kBFloat16 && x.dim() == 2 && w1.dim() == 3 && w2.dim() == 3))
    return false;
  const int64_t D = x.size(1), F = w2.size(2);
  return D >= 64 && F >= 64 && D % 64 == 0 && F % 64 == 0;  // the kernels' K chunks and weight tiles
#else
  (void)x;
  (void)w1;
  (void)w2;
  return false;
#endif
}

at::Tensor grouped_swiglu_decode(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& w1,
                                 const at::Tensor& w2, std::optional<double> swiglu_limit) {
#ifdef KILN_CUDA
  if (grouped_swiglu_decode_supports(x, w1, w2)) {
    const int64_t E = w1.size(0), D = x.size(1), F = w2.size(2);
    TORCH_CHECK(w1.size(1) == 2 * F && w1.size(2) == D && w2.size(0) == E && w2.size(1) == D,
                "grouped_swiglu_decode: weights ", w1.sizes(), " and ", w2.sizes(), " do not fit D = ", D);
    TORCH_CHECK(counts.dim() == 1 && counts.size(0) == E && counts.scalar_type() == at::kLong,
                "grouped_swiglu_decode: counts must be [E = ", E, "] int64, got ", counts.sizes(), " ",
                counts.scalar_type());
    auto act = torch::empty({x.size(0), F}, x.options());
    auto y = torch::empty({x.size(0), D}, x.options());
    const float limit = swiglu_limit ? float(*swiglu_limit) : std::numeric_limits<float>::infinity();
    cuda::grouped_swiglu_decode(x.contiguous(), counts.to(x.device()).contiguous(), w1.contiguous(), w2.contiguous(),
                                limit, act, y);
    ++kernel_calls;
    return y;
  }
#endif
  return grouped_swiglu(x, counts, w1, w2, swiglu_limit);
}

}  // namespace kiln::kernels

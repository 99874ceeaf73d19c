#pragma once
// Host entry points of kernels/checksum.cu (CUDA builds only).
#include <ATen/core/Tensor.h>

namespace kiln::kernels::cuda {
/// out: 0-dim int64 on the device, added into (zeroed first when `zero`). dst may be null.
/// `halves`: the byte count / 2 (the data are read as uint16 pairs; an odd count pads).
void checksum_copy(const void* src, void* dst, int64_t halves, at::Tensor& out, bool zero = true);
}  // namespace kiln::kernels::cuda

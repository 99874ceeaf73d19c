#pragma once
// Bridge between at::Tensor and messaging::Tensor, zero-copy both ways where possible.
#include <ATen/core/Tensor.h>

#include <string>

#include "messaging/tensor.hpp"

namespace kiln::messaging {

/// Wire dtype of a torch scalar type. Throws std::invalid_argument naming the type for
/// dtypes kiln does not send (complex, uint16/32/64, other fp8 variants, ...).
DType dtype_from_torch(c10::ScalarType type);
/// Torch scalar type of a wire dtype.
c10::ScalarType dtype_to_torch(DType dtype);

/// Wraps `t` for sending. A contiguous CPU tensor is shared without copying (the returned
/// owner keeps its storage alive; do not write to it until the message is delivered); a
/// non-contiguous one is made contiguous (one copy); a CUDA tensor is copied to host.
/// Throws std::invalid_argument for unsupported dtypes.
Tensor from_torch(std::string name, const at::Tensor& t);

/// A CPU at::Tensor over the received bytes, without copying; it keeps the bytes alive.
/// In one process (inproc) the bytes are the sender's storage: treat them as read-only,
/// or clone() before writing.
at::Tensor to_torch(const Tensor& t);

}  // namespace kiln::messaging

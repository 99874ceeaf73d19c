#pragma once
// Position-weighted checksum of a tensor's bytes, and a device copy that computes the
// checksum of what it writes in the same pass (weight sync: the sender's checksum comes free
// with the copy; the receiver re-reads its storage once to check it).
//   words w_i = the tensor's bytes as little-endian uint32, i = 0 .. n-1 (n = ceil(nbytes / 4),
//               a last half word padded with zero bytes)
//   checksum = sum_i (w_i * m_i mod 2^32)  mod 2^64,  m_i = ((i + 1) * 2654435761 mod 2^32) | 1
// (32-bit products keep the kernel at memory speed: two integer multiply-adds per 4 bytes)
// (the odd multiplier depends on the position, so swapped or shifted words change it).
// Tensors must be contiguous with an even byte count; any dtype. Results are 0-dim int64
// tensors on the tensor's device (no host sync); the CUDA kernels and the LibTorch
// reference give the same value. Throws c10::Error on a non-contiguous tensor, an odd byte
// count, or dst/src of other shape, dtype or device.
#include <ATen/core/Tensor.h>

namespace kiln::kernels {

at::Tensor checksum(const at::Tensor& t);
/// dst <- src (same dtype, shape and device), -> checksum(src) computed while copying.
at::Tensor copy_with_checksum(at::Tensor& dst, const at::Tensor& src);
at::Tensor checksum_ref(const at::Tensor& t);
/// As above, but adding the checksum into `acc` (a 0-dim int64 tensor on the same device, e.g.
/// one slot of a zeroed buffer: no zeroing launch per tensor; sums wrap mod 2^64).
void checksum_add(const at::Tensor& t, at::Tensor& acc);
void copy_with_checksum_add(at::Tensor& dst, const at::Tensor& src, at::Tensor& acc);

}  // namespace kiln::kernels

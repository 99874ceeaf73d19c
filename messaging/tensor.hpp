#pragma once
// A tensor as the messaging layer sees it: a named, typed, shaped, contiguous (row-major)
// byte range plus an owner that keeps the bytes alive. No LibTorch here; the bridge to
// at::Tensor is messaging/torch_tensor.hpp.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "messaging/dtype.hpp"

namespace kiln::messaging {

struct Tensor {
  std::string name;             ///< free-form label, e.g. "layers.3.moe.w_gate_up_EFD"
  DType dtype = DType::uint8;
  std::vector<int64_t> shape;   ///< dims, each >= 0; {} is a scalar (numel 1)
  const std::byte* data = nullptr;  ///< nbytes contiguous bytes (may be null when nbytes == 0)
  std::size_t nbytes = 0;       ///< numel() * item_size(dtype), always
  std::shared_ptr<const void> owner;  ///< keeps `data` alive; shared, never copied

  /// Product of dims (1 for a scalar).
  int64_t numel() const;

  /// A zero-filled tensor that owns a fresh 64-byte-aligned buffer.
  static Tensor zeros(std::string name, DType dtype, std::vector<int64_t> shape);
  /// A tensor that owns a 64-byte-aligned copy of `nbytes` bytes at `src`.
  /// Throws std::invalid_argument if nbytes != numel * item_size.
  static Tensor copy_of(std::string name, DType dtype, std::vector<int64_t> shape,
                        const void* src, std::size_t nbytes);
  /// Writable view of an owned buffer made by zeros()/copy_of() (for filling it).
  std::byte* mutable_data() const { return const_cast<std::byte*>(data); }
};

/// CRC-32 (zlib polynomial, as Python's zlib.crc32) of the tensor's bytes.
uint32_t crc32(const Tensor& t);

}  // namespace kiln::messaging

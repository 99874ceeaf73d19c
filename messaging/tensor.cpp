#include "messaging/tensor.hpp"

#include <zlib.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace kiln::messaging {

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

namespace {
std::size_t checked_bytes(DType dtype, const std::vector<int64_t>& shape) {
  std::size_t n = item_size(dtype);
  for (auto d : shape) {
    if (d < 0) throw std::invalid_argument("negative dimension " + std::to_string(d));
    if (__builtin_mul_overflow(n, static_cast<std::size_t>(d), &n))
      throw std::invalid_argument("tensor byte size overflows size_t");
  }
  return n;
}

std::shared_ptr<void> aligned_buffer(std::size_t nbytes) {
  // 64-byte alignment suits every dtype and vector loads; round the size up as
  // aligned_alloc requires.
  std::size_t rounded = ((nbytes + 63) / 64) * 64;
  void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
  if (!p) throw std::bad_alloc();
  return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
}
}  // namespace

Tensor Tensor::zeros(std::string name, DType dtype, std::vector<int64_t> shape) {
  std::size_t nbytes = checked_bytes(dtype, shape);
  auto buf = aligned_buffer(nbytes);
  std::memset(buf.get(), 0, nbytes);
  Tensor t{std::move(name), dtype, std::move(shape), static_cast<const std::byte*>(buf.get()),
           nbytes, std::move(buf)};
  return t;
}

Tensor Tensor::copy_of(std::string name, DType dtype, std::vector<int64_t> shape,
                       const void* src, std::size_t nbytes) {
  std::size_t expected = checked_bytes(dtype, shape);
  if (expected != nbytes)
    throw std::invalid_argument("tensor '" + name + "': " + std::to_string(nbytes) +
                                " bytes given, shape and dtype need " + std::to_string(expected));
  auto buf = aligned_buffer(nbytes);
  if (nbytes) std::memcpy(buf.get(), src, nbytes);
  return Tensor{std::move(name), dtype, std::move(shape), static_cast<const std::byte*>(buf.get()),
                nbytes, std::move(buf)};
}

uint32_t crc32(const Tensor& t) {
  uLong c = ::crc32(0L, Z_NULL, 0);
  const auto* p = reinterpret_cast<const Bytef*>(t.data);
  std::size_t left = t.nbytes;
  while (left > 0) {  // zlib takes uInt lengths
    uInt chunk = static_cast<uInt>(std::min<std::size_t>(left, 1u << 30));
    c = ::crc32(c, p, chunk);
    p += chunk;
    left -= chunk;
  }
  return static_cast<uint32_t>(c);
}

}  // namespace kiln::messaging

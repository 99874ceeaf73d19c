#include "messaging/torch_tensor.hpp"

#include <ATen/ATen.h>

#include <stdexcept>

namespace kiln::messaging {

namespace {
struct Mapping {
  DType dtype;
  c10::ScalarType torch;
};
constexpr Mapping kMap[] = {
    {DType::bool_, c10::ScalarType::Bool},         {DType::uint8, c10::ScalarType::Byte},
    {DType::int8, c10::ScalarType::Char},          {DType::int32, c10::ScalarType::Int},
    {DType::int64, c10::ScalarType::Long},         {DType::float16, c10::ScalarType::Half},
    {DType::bfloat16, c10::ScalarType::BFloat16},  {DType::float32, c10::ScalarType::Float},
    {DType::float64, c10::ScalarType::Double},     {DType::float8_e4m3fn, c10::ScalarType::Float8_e4m3fn},
    {DType::float8_e5m2, c10::ScalarType::Float8_e5m2},
};
}  // namespace

DType dtype_from_torch(c10::ScalarType type) {
  for (const auto& m : kMap)
    if (m.torch == type) return m.dtype;
  throw std::invalid_argument(std::string("torch dtype ") + c10::toString(type) + " has no kiln wire dtype");
}

c10::ScalarType dtype_to_torch(DType dtype) {
  for (const auto& m : kMap)
    if (m.dtype == dtype) return m.torch;
  throw std::invalid_argument("unknown kiln dtype");
}

Tensor from_torch(std::string name, const at::Tensor& t) {
  DType dtype = dtype_from_torch(t.scalar_type());
  at::Tensor c = t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();  // [*] row-major
  Tensor out;
  out.name = std::move(name);
  out.dtype = dtype;
  out.shape.assign(c.sizes().begin(), c.sizes().end());
  out.nbytes = c.nbytes();
  out.data = static_cast<const std::byte*>(c.data_ptr());
  out.owner = std::make_shared<at::Tensor>(std::move(c));
  return out;
}

at::Tensor to_torch(const Tensor& t) {
  auto options = at::TensorOptions().dtype(dtype_to_torch(t.dtype)).device(at::kCPU);
  if (t.nbytes == 0) return at::empty(t.shape, options);
  auto owner = t.owner;  // the deleter holds the frame until torch frees the storage
  return at::from_blob(const_cast<std::byte*>(t.data), t.shape, [owner](void*) mutable { owner.reset(); }, options);
}

}  // namespace kiln::messaging

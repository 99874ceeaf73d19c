#include "messaging/dtype.hpp"

namespace kiln::messaging {

namespace {
struct DTypeInfo {
  DType dtype;
  std::string_view name;
  std::size_t size;
  std::string_view torch_name;
};
constexpr DTypeInfo kTable[] = {
    {DType::bool_, "BOOL", 1, "bool"},          {DType::uint8, "U8", 1, "uint8"},
    {DType::int8, "I8", 1, "int8"},             {DType::int32, "I32", 4, "int32"},
    {DType::int64, "I64", 8, "int64"},          {DType::float16, "F16", 2, "float16"},
    {DType::bfloat16, "BF16", 2, "bfloat16"},   {DType::float32, "F32", 4, "float32"},
    {DType::float64, "F64", 8, "float64"},      {DType::float8_e4m3fn, "F8_E4M3", 1, "float8_e4m3fn"},
    {DType::float8_e5m2, "F8_E5M2", 1, "float8_e5m2"},
};
}  // namespace

std::size_t item_size(DType dtype) { return kTable[static_cast<int>(dtype)].size; }
std::string_view dtype_name(DType dtype) { return kTable[static_cast<int>(dtype)].name; }

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& e : kTable)
    if (e.name == name) return e.dtype;
  return std::nullopt;
}

std::string_view torch_dtype_name(DType dtype) { return kTable[static_cast<int>(dtype)].torch_name; }

std::optional<DType> dtype_from_torch_name(std::string_view name) {
  if (name.substr(0, 6) == "torch.") name.remove_prefix(6);
  for (const auto& e : kTable)
    if (e.torch_name == name) return e.dtype;
  return std::nullopt;
}

}  // namespace kiln::messaging

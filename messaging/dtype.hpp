#pragma once
// Tensor element types on the wire. Names follow the safetensors format ("BF16", "F8_E4M3"),
// which checkpoints use too, so one vocabulary covers files and messages.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace kiln::messaging {

enum class DType : uint8_t {
  bool_, uint8, int8, int32, int64, float16, bfloat16, float32, float64,
  float8_e4m3fn,  ///< OCP FP8 E4M3 (finite-only, NaN = S.1111.111), torch.float8_e4m3fn
  float8_e5m2,    ///< OCP FP8 E5M2, torch.float8_e5m2
};

inline constexpr DType kAllDTypes[] = {
    DType::bool_,   DType::uint8,   DType::int8,    DType::int32,
    DType::int64,   DType::float16, DType::bfloat16, DType::float32,
    DType::float64, DType::float8_e4m3fn, DType::float8_e5m2};

/// Bytes per element (bool is one byte).
std::size_t item_size(DType dtype);
/// Wire name: BOOL U8 I8 I32 I64 F16 BF16 F32 F64 F8_E4M3 F8_E5M2.
std::string_view dtype_name(DType dtype);
/// Parses a wire name; std::nullopt for anything else.
std::optional<DType> dtype_from_name(std::string_view name);
/// torch's name of the dtype, as str(torch.bfloat16) minus "torch.": bool uint8 int8 int32 int64
/// float16 bfloat16 float32 float64 float8_e4m3fn float8_e5m2 (SGLang's weight-update requests
/// carry these).
std::string_view torch_dtype_name(DType dtype);
/// Parses a torch name, with or without "torch." ("bfloat16", "torch.bfloat16"); std::nullopt
/// for anything else (aliases such as "float" or "half" included).
std::optional<DType> dtype_from_torch_name(std::string_view name);

}  // namespace kiln::messaging

#pragma once
// A config value as error messages show it ("..., got 0"): integers in full, doubles as the
// shortest text that reads back to the same double (1e-07, 0.5, inf).
#include <charconv>
#include <string>
#include <type_traits>

namespace kiln {

template <class T>
std::string shown(T value) {
  if constexpr (std::is_floating_point_v<T>) {
    char buf[64];
    return std::string(buf, std::to_chars(buf, buf + sizeof buf, double(value)).ptr);
  } else {
    return std::to_string(value);
  }
}

}  // namespace kiln

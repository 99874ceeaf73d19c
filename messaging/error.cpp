#include "messaging/error.hpp"

#include <array>

namespace kiln::messaging {

namespace {
constexpr std::array<const char*, 10> kNames = {
    "bad_message", "schema_mismatch", "unknown_type", "unknown_actor", "timeout",
    "peer_lost",   "remote_error",    "transport",    "shutdown",     "collective_failed"};
}

const char* to_string(ErrorCode code) { return kNames[static_cast<std::size_t>(code)]; }

ErrorCode error_code_from_string(const std::string& name) {
  for (std::size_t i = 0; i < kNames.size(); ++i)
    if (name == kNames[i]) return static_cast<ErrorCode>(i);
  return ErrorCode::remote_error;
}

}  // namespace kiln::messaging

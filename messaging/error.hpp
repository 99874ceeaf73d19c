#pragma once
// Errors as values across the messaging layer (STYLE: errors travel as values between
// actors). `Expected<T>` holds either a T or an Error; nothing here throws.
#include <string>
#include <utility>
#include <variant>

namespace kiln::messaging {

/// What went wrong, by category. Stable: it travels in `error` replies as a string.
enum class ErrorCode {
  bad_message,      ///< bytes or fields that do not decode (names the field)
  schema_mismatch,  ///< envelope or message-type schema version differs from this build's
  unknown_type,     ///< message type not declared in messaging/schema.hpp
  unknown_actor,    ///< no actor of that logical name is known to the graph
  timeout,          ///< no reply within the request's timeout
  peer_lost,        ///< the peer process disconnected or stopped answering heartbeats
  remote_error,     ///< the remote actor answered with an error
  transport,        ///< a ZeroMQ call failed (names the call and errno text)
  shutdown,         ///< the gateway stopped before the request completed
  collective_failed,  ///< the remote rank's collectives failed (a peer of them lost): it exits
};

/// Returns the wire/log name of `code` ("bad_message", ...).
const char* to_string(ErrorCode code);
/// Parses a wire name; unknown names map to `remote_error`.
ErrorCode error_code_from_string(const std::string& name);

struct Error {
  ErrorCode code = ErrorCode::bad_message;
  std::string message;  ///< human-readable, names the offending field/value/peer
  std::string what() const { return std::string(to_string(code)) + ": " + message; }
};

inline Error make_error(ErrorCode code, std::string message) { return Error{code, std::move(message)}; }

/// Either a value or an Error (a small stand-in for C++23 std::expected).
template <class T>
class Expected {
 public:
  Expected(T value) : v_(std::move(value)) {}
  Expected(Error error) : v_(std::move(error)) {}
  bool has_value() const { return v_.index() == 0; }
  explicit operator bool() const { return has_value(); }
  T& value() & { return std::get<0>(v_); }
  const T& value() const& { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  const Error& error() const { return std::get<1>(v_); }

 private:
  std::variant<T, Error> v_;
};

}  // namespace kiln::messaging

#pragma once
// The wire schema's core: errors, liveness, the graph directory, diagnostics. Every message
// type is declared once: a struct with its wire name (kType), its schema version (kVersion)
// and its payload fields (MSGPACK_DEFINE_MAP: field names are the msgpack map keys). The
// types of each actor family live beside the actor, one header per family:
//   actors/weight_sync/messages.hpp  weight_sync.*     actors/rollout/messages.hpp  rollout.*
//   actors/reference/messages.hpp    ref.*             actors/trainer/messages.hpp  trainer.*
// each declaring its types with declare_message_types; the decoder rejects any other name.
// Adding a type: write the struct in its family's header, add it to that header's
// declaration, document it in docs/wire-format.md. Changing a type's fields: bump kVersion.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <msgpack.hpp>

#include "messaging/envelope.hpp"

namespace kiln::messaging {

/// Answer to a failed request (Kind::error). code is an ErrorCode name.
struct ErrorReply {
  static constexpr std::string_view kType = "error";
  static constexpr uint32_t kVersion = 1;
  std::string code;
  std::string message;
  MSGPACK_DEFINE_MAP(code, message);
};

/// Liveness probe; any actor answers with Pong.
struct Ping {
  static constexpr std::string_view kType = "ping";
  static constexpr uint32_t kVersion = 1;
  std::string note;
  MSGPACK_DEFINE_MAP(note);
};
struct Pong {
  static constexpr std::string_view kType = "pong";
  static constexpr uint32_t kVersion = 1;
  std::string node;   ///< node name of the answering process
  std::string actor;  ///< logical name of the answering actor
  std::string note;   ///< Ping::note, echoed
  MSGPACK_DEFINE_MAP(node, actor, note);
};

/// A node joins a graph: it announces the actors it hosts at `endpoint`.
struct GraphJoin {
  static constexpr std::string_view kType = "graph.join";
  static constexpr uint32_t kVersion = 1;
  std::string node;
  std::string endpoint;             ///< where the node's gateway is bound
  std::vector<std::string> actors;  ///< logical names it hosts
  MSGPACK_DEFINE_MAP(node, endpoint, actors);
};
/// Asks the graph's root where an actor lives.
struct GraphLookup {
  static constexpr std::string_view kType = "graph.lookup";
  static constexpr uint32_t kVersion = 1;
  std::string actor;
  MSGPACK_DEFINE_MAP(actor);
};
/// The root's directory (actor name -> endpoint), the answer to join and lookup.
struct GraphDirectory {
  static constexpr std::string_view kType = "graph.directory";
  static constexpr uint32_t kVersion = 1;
  std::map<std::string, std::string> actors;
  MSGPACK_DEFINE_MAP(actors);
};

/// Diagnostics: the receiver answers DiagEchoResult with the same tensors and their CRC-32s.
struct DiagEcho {
  static constexpr std::string_view kType = "diag.echo";
  static constexpr uint32_t kVersion = 1;
  std::string note;
  MSGPACK_DEFINE_MAP(note);
};
struct DiagEchoResult {
  static constexpr std::string_view kType = "diag.echo_result";
  static constexpr uint32_t kVersion = 1;
  std::string node;
  std::vector<uint32_t> crc32;   ///< per received tensor, zlib CRC-32 of its bytes
  std::vector<uint64_t> nbytes;  ///< per received tensor
  MSGPACK_DEFINE_MAP(node, crc32, nbytes);
};
/// Diagnostics: the receiver waits `milliseconds` before answering Pong (a slow actor).
struct DiagSleep {
  static constexpr std::string_view kType = "diag.sleep";
  static constexpr uint32_t kVersion = 1;
  uint32_t milliseconds = 0;
  MSGPACK_DEFINE_MAP(milliseconds);
};

/// Benchmark payload: one tensor per message, sequence number for ordering checks.
struct BenchChunk {
  static constexpr std::string_view kType = "bench.chunk";
  static constexpr uint32_t kVersion = 1;
  uint64_t seq = 0;
  MSGPACK_DEFINE_MAP(seq);
};

/// The core types above, declared at start-up (each actor family declares its own in its
/// messages header: actors/*/messages.hpp).
using MessageTypes = std::tuple<ErrorReply, Ping, Pong, GraphJoin, GraphLookup, GraphDirectory, DiagEcho,
                                DiagEchoResult, DiagSleep, BenchChunk>;

/// Declares a message type this process speaks (wire name -> schema version); the decoder
/// rejects undeclared names with unknown_type and other versions with schema_mismatch.
/// Throws std::logic_error if `type` was declared with another version (two families
/// claiming one name).
void declare_message_type(std::string_view type, uint32_t version);
/// Declares every type of a family; returns true, so that a family header can write
///   inline const bool kFooMessages = messaging::declare_message_types<FooInit, FooReady>();
/// and every program that includes the header speaks them.
template <class... T>
bool declare_message_types() {
  (declare_message_type(T::kType, T::kVersion), ...);
  return true;
}


/// Schema version of a declared type, or nullopt if `type` is not declared.
std::optional<uint32_t> message_type_version(std::string_view type);

/// Builds an envelope of message type T with `value` packed as its payload.
template <class T>
Envelope make_envelope(const T& value, Kind kind, std::string sender, std::string receiver) {
  Envelope env;
  env.type = std::string(T::kType);
  env.type_version = T::kVersion;
  env.kind = kind;
  env.sender = std::move(sender);
  env.receiver = std::move(receiver);
  msgpack::sbuffer buf;
  msgpack::pack(buf, value);
  env.payload.assign(buf.data(), buf.size());
  return env;
}

/// Decodes the payload of `env` as T. Errors: unknown_type if env.type is not T's,
/// bad_message naming the type when the payload does not decode as T's fields.
Expected<msgpack::object_handle> unpack_payload(const Envelope& env);
/// "{key: type, ...}" of a payload map, for error messages.
std::string describe_payload(const msgpack::object& map);
template <class T>
Expected<T> payload_as(const Envelope& env) {
  if (env.type != T::kType)
    return make_error(ErrorCode::unknown_type,
                      "expected message type '" + std::string(T::kType) + "', got '" + env.type + "'");
  auto handle = unpack_payload(env);
  if (!handle) return handle.error();
  try {
    T value;
    handle->get().convert(value);
    return value;
  } catch (const std::exception& e) {
    return make_error(ErrorCode::bad_message, "payload of '" + env.type +
                                                  "' does not match its schema (a field has the wrong type or range; "
                                                  "got " + describe_payload(handle->get()) + "): " + e.what());
  }
}

/// An Kind::error envelope answering `request` with (code, message).
Envelope make_error_reply(const Envelope& request, const Error& error, std::string sender);
/// Turns an error envelope into an Error (remote_error unless the code names another).
Error error_from_reply(const Envelope& reply);

}  // namespace kiln::messaging

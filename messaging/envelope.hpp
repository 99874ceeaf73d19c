#pragma once
// The message envelope and its codec. Wire layout (docs/wire-format.md is the contract):
//   frame 0      msgpack map: v, type, tv, kind, from, to, id, payload, tensors
//   frame 1..n   raw bytes of tensor i-1, exactly tensors[i-1].nbytes long
// Decoding never trusts the bytes: every fault comes back as an Error naming it.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "messaging/error.hpp"
#include "messaging/tensor.hpp"

namespace kiln::messaging {

/// Envelope schema version this build speaks (field "v").
inline constexpr uint32_t kEnvelopeSchemaVersion = 1;

enum class Kind : uint8_t {
  request,  ///< expects exactly one `reply` or `error` with the same id
  reply,    ///< answers the request whose id it carries
  error,    ///< answers a request with an ErrorReply payload (messaging/schema.hpp)
  tell,     ///< one-way, no answer
};
const char* to_string(Kind kind);

/// Where a reply to a received request goes. Set by the gateway when it delivers an
/// envelope; never on the wire.
struct ReturnPath {
  enum class Via : uint8_t { none, local, router } via = Via::none;
  std::string routing_id;      ///< ZeroMQ ROUTER identity of the requesting connection
  bool req_delimiter = false;  ///< the peer is a REQ socket (expects an empty frame first)
};

struct Envelope {
  uint32_t schema_version = kEnvelopeSchemaVersion;
  std::string type;           ///< message type name, declared in messaging/schema.hpp
  uint32_t type_version = 0;  ///< that type's schema version
  Kind kind = Kind::tell;
  std::string sender;         ///< logical name of the sending actor ("trainer/0")
  std::string receiver;       ///< logical name of the receiving actor ("rollout/3")
  uint64_t correlation_id = 0;
  std::string payload;        ///< msgpack-encoded map of the type's fields ("\x80" = {})
  std::vector<Tensor> tensors;
  ReturnPath return_path;     ///< not on the wire
};

/// Bounds applied while decoding untrusted frames. The gateway also sets its sockets'
/// ZMQ_MAXMSGSIZE to the larger of the two byte limits, so ZeroMQ drops a larger frame itself.
struct DecodeLimits {
  std::size_t max_envelope_bytes = 16u << 20;  ///< frame 0 size, bytes
  std::size_t max_tensor_bytes = 4ull << 30;   ///< one tensor frame, bytes
  std::size_t max_tensors = 65536;
  std::size_t max_ndim = 64;
  std::size_t max_depth = 32;                  ///< msgpack nesting
};

/// One received frame: bytes plus the owner that keeps them alive (a ZeroMQ message).
struct Frame {
  const std::byte* data = nullptr;
  std::size_t size = 0;
  std::shared_ptr<const void> owner;
};

/// Encodes frame 0 (the msgpack envelope) of `env`; tensor frames are the tensors' bytes.
std::string encode_header(const Envelope& env);

/// Decodes frames [header, tensor...] into an Envelope. Tensors point into the frames
/// (no copy) unless a frame is not aligned to its dtype's item size, then it is copied.
/// Errors (never throws): bad_message (wrong frame count, malformed/oversized/truncated
/// msgpack, missing or mistyped field, unknown dtype, negative dim, shape overflow, byte
/// length != numel * item size, a tensor over max_tensor_bytes), schema_mismatch (v or tv),
/// unknown_type. A frame 0 over max_envelope_bytes is refused by its size, unread.
Expected<Envelope> decode(std::span<const Frame> frames, const DecodeLimits& limits = {});

/// Checks an envelope built in this process before it is sent (same rules as decode).
Expected<bool> validate(const Envelope& env, const DecodeLimits& limits = {});

/// What a rejected frame 0 says about the request it carried: enough to answer it with an error.
struct RequestOrigin {
  uint64_t correlation_id = 0;
  std::string sender;
};
/// Best effort for a frame that did not decode: its correlation id and sender, if frame 0 is a
/// msgpack map with "kind": "request" and a uint "id", so that the error can be sent back
/// instead of leaving the sender to time out. A frame 0 over limits.max_envelope_bytes is
/// not read at all (nullopt): refusing an oversized frame costs O(1) time and memory.
std::optional<RequestOrigin> peek_request(const Frame& head, const DecodeLimits& limits = {});

}  // namespace kiln::messaging

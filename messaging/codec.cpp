// Envelope codec: encode_header / decode / validate, and payload helpers.
#include <cstring>
#include <string_view>

#include "messaging/envelope.hpp"
#include "messaging/schema.hpp"

#include <map>
#include <mutex>

namespace kiln::messaging {

namespace {

constexpr const char* kKindNames[] = {"request", "reply", "error", "tell"};

std::optional<Kind> kind_from_name(std::string_view s) {
  for (int i = 0; i < 4; ++i)
    if (s == kKindNames[i]) return static_cast<Kind>(i);
  return std::nullopt;
}

Error bad(std::string what) { return make_error(ErrorCode::bad_message, std::move(what)); }

const char* type_name(const msgpack::object& o) {
  switch (o.type) {
    case msgpack::type::NIL: return "nil";
    case msgpack::type::BOOLEAN: return "bool";
    case msgpack::type::POSITIVE_INTEGER: return "uint";
    case msgpack::type::NEGATIVE_INTEGER: return "int";
    case msgpack::type::FLOAT32: case msgpack::type::FLOAT64: return "float";
    case msgpack::type::STR: return "str";
    case msgpack::type::BIN: return "bin";
    case msgpack::type::ARRAY: return "array";
    case msgpack::type::MAP: return "map";
    case msgpack::type::EXT: return "ext";
  }
  return "?";
}

// Field lookup in a msgpack map; keys that are not strings are ignored.
const msgpack::object* field(const msgpack::object& map, std::string_view key) {
  for (uint32_t i = 0; i < map.via.map.size; ++i) {
    const auto& kv = map.via.map.ptr[i];
    if (kv.key.type == msgpack::type::STR &&
        std::string_view(kv.key.via.str.ptr, kv.key.via.str.size) == key)
      return &kv.val;
  }
  return nullptr;
}

Expected<uint64_t> get_uint(const msgpack::object& map, const std::string& where, bool required,
                            uint64_t fallback = 0) {
  const auto* o = field(map, where.substr(where.rfind('.') + 1));
  if (!o) {
    if (required) return bad("envelope field '" + where + "' is missing");
    return fallback;
  }
  if (o->type != msgpack::type::POSITIVE_INTEGER)
    return bad("envelope field '" + where + "' must be an unsigned integer, got " + type_name(*o));
  return o->via.u64;
}

Expected<std::string> get_str(const msgpack::object& map, std::string_view key,
                              const std::string& where, bool required) {
  const auto* o = field(map, key);
  if (!o) {
    if (required) return bad("envelope field '" + where + "' is missing");
    return std::string();
  }
  if (o->type != msgpack::type::STR)
    return bad("envelope field '" + where + "' must be a string, got " + type_name(*o));
  return std::string(o->via.str.ptr, o->via.str.size);
}

// Bytes of a tensor of this dtype and shape, or an error naming the fault.
Expected<std::size_t> tensor_bytes(DType dtype, const std::vector<int64_t>& shape,
                                   const std::string& where) {
  std::size_t n = item_size(dtype);
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0)
      return bad(where + ".shape[" + std::to_string(i) + "] is negative (" +
                 std::to_string(shape[i]) + ")");
    if (__builtin_mul_overflow(n, static_cast<std::size_t>(shape[i]), &n))
      return bad(where + ".shape overflows: numel * item size exceeds 2^64 bytes");
  }
  return n;
}

Expected<bool> check_type(const std::string& type, uint32_t tv) {
  auto declared = message_type_version(type);
  if (!declared) return make_error(ErrorCode::unknown_type, "unknown message type '" + type + "'");
  if (*declared != tv)
    return make_error(ErrorCode::schema_mismatch,
                      "message type '" + type + "' has schema version " + std::to_string(tv) +
                          ", this build speaks " + std::to_string(*declared));
  return true;
}

// The declared message types (wire name -> schema version), the core ones from the start.
struct DeclaredTypes {
  std::mutex mu;
  std::map<std::string, uint32_t, std::less<>> versions;
  DeclaredTypes() {
    std::apply([this](auto... t) { ((versions[std::string(decltype(t)::kType)] = decltype(t)::kVersion), ...); },
               MessageTypes{});
  }
};
DeclaredTypes& declared_types() {
  static DeclaredTypes d;
  return d;
}

}  // namespace

const char* to_string(Kind kind) { return kKindNames[static_cast<int>(kind)]; }

std::optional<uint32_t> message_type_version(std::string_view type) {
  auto& d = declared_types();
  std::lock_guard<std::mutex> l(d.mu);
  auto it = d.versions.find(type);
  if (it == d.versions.end()) return std::nullopt;
  return it->second;
}

void declare_message_type(std::string_view type, uint32_t version) {
  auto& d = declared_types();
  std::lock_guard<std::mutex> l(d.mu);
  auto [it, added] = d.versions.emplace(std::string(type), version);
  if (!added && it->second != version)
    throw std::logic_error("message type '" + std::string(type) + "' declared with versions " +
                           std::to_string(it->second) + " and " + std::to_string(version));
}

std::string encode_header(const Envelope& env) {
  msgpack::sbuffer buf(256 + env.payload.size() + 64 * env.tensors.size());
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_map(9);
  pk.pack("v"); pk.pack(env.schema_version);
  pk.pack("type"); pk.pack(env.type);
  pk.pack("tv"); pk.pack(env.type_version);
  pk.pack("kind"); pk.pack(std::string_view(to_string(env.kind)));
  pk.pack("from"); pk.pack(env.sender);
  pk.pack("to"); pk.pack(env.receiver);
  pk.pack("id"); pk.pack(env.correlation_id);
  pk.pack("payload");
  if (env.payload.empty()) pk.pack_map(0);
  else buf.write(env.payload.data(), env.payload.size());  // already msgpack: no re-encode
  pk.pack("tensors");
  pk.pack_array(static_cast<uint32_t>(env.tensors.size()));
  for (const auto& t : env.tensors) {
    pk.pack_map(4);
    pk.pack("name"); pk.pack(t.name);
    pk.pack("dtype"); pk.pack(dtype_name(t.dtype));
    pk.pack("shape"); pk.pack(t.shape);
    pk.pack("nbytes"); pk.pack(static_cast<uint64_t>(t.nbytes));
  }
  return std::string(buf.data(), buf.size());
}

std::string describe_payload(const msgpack::object& map) {
  std::string s = "{";
  if (map.type == msgpack::type::MAP)
    for (uint32_t i = 0; i < map.via.map.size; ++i) {
      const auto& kv = map.via.map.ptr[i];
      std::string key = kv.key.type == msgpack::type::STR ? std::string(kv.key.via.str.ptr, kv.key.via.str.size) : "?";
      std::string type = type_name(kv.val);
      if (kv.val.type == msgpack::type::NEGATIVE_INTEGER) type += " " + std::to_string(kv.val.via.i64);
      if (kv.val.type == msgpack::type::POSITIVE_INTEGER) type += " " + std::to_string(kv.val.via.u64);
      s += (i ? ", " : "") + key + ": " + type;
    }
  return s + "}";
}

Expected<msgpack::object_handle> unpack_payload(const Envelope& env) {
  const std::size_t n = env.payload.size();
  if (n == 0) {  // an empty payload is an empty map
    static const char kEmptyMap = '\x80';
    return msgpack::unpack(&kEmptyMap, 1);
  }
  try {
    std::size_t off = 0;
    // Limits scale with the bytes at hand, so a tiny frame cannot claim a huge container.
    msgpack::unpack_limit limit(n, n / 2 + 1, n, n, n, 32);
    auto h = msgpack::unpack(env.payload.data(), n, off, nullptr, nullptr, limit);
    if (off != n) return bad("payload of '" + env.type + "' has trailing bytes");
    if (h.get().type != msgpack::type::MAP)
      return bad("payload of '" + env.type + "' must be a map, got " + type_name(h.get()));
    return h;
  } catch (const std::exception& e) {
    return bad("payload of '" + env.type + "' is not valid msgpack: " + e.what());
  }
}

namespace {

// Frame 0 as a msgpack map, within the limits.
Expected<msgpack::object_handle> unpack_head(const Frame& head, const DecodeLimits& limits) {
  const std::size_t n = head.size;
  if (n == 0) return bad("frame 0 (envelope) is empty");
  if (n > limits.max_envelope_bytes)
    return bad("frame 0 (envelope) is " + std::to_string(n) + " bytes, limit " +
               std::to_string(limits.max_envelope_bytes));
  msgpack::object_handle h;
  try {
    std::size_t off = 0;
    msgpack::unpack_limit limit(n, n / 2 + 1, n, n, n, limits.max_depth);
    h = msgpack::unpack(reinterpret_cast<const char*>(head.data), n, off, nullptr, nullptr, limit);
    if (off != n) return bad("frame 0 (envelope) has " + std::to_string(n - off) + " trailing bytes");
  } catch (const std::exception& e) {
    return bad(std::string("frame 0 (envelope) is not valid msgpack: ") + e.what());
  }
  if (h.get().type != msgpack::type::MAP)
    return bad(std::string("envelope must be a msgpack map, got ") + type_name(h.get()));
  return h;
}

// The envelope's own fields (all but the tensors) from its map `root` into `env`.
Expected<bool> read_fields(const msgpack::object& root, Envelope& env) {
  // The version comes first: another version may lay out other fields.
  auto v = get_uint(root, "v", true);
  if (!v) return v.error();
  if (*v != kEnvelopeSchemaVersion)
    return make_error(ErrorCode::schema_mismatch,
                      "envelope schema version " + std::to_string(*v) + ", this build speaks " +
                          std::to_string(kEnvelopeSchemaVersion));
  env.schema_version = static_cast<uint32_t>(*v);

  auto type = get_str(root, "type", "type", true);
  if (!type) return type.error();
  env.type = std::move(*type);
  auto tv = get_uint(root, "tv", true);
  if (!tv) return tv.error();
  if (*tv > UINT32_MAX) return bad("envelope field 'tv' out of range");
  if (auto ok = check_type(env.type, static_cast<uint32_t>(*tv)); !ok) return ok.error();
  env.type_version = static_cast<uint32_t>(*tv);

  auto kind = get_str(root, "kind", "kind", true);
  if (!kind) return kind.error();
  auto k = kind_from_name(*kind);
  if (!k) return bad("envelope field 'kind' is '" + *kind + "', expected request|reply|error|tell");
  env.kind = *k;
  auto from = get_str(root, "from", "from", false);
  if (!from) return from.error();
  env.sender = std::move(*from);
  auto to = get_str(root, "to", "to", true);
  if (!to) return to.error();
  env.receiver = std::move(*to);
  auto id = get_uint(root, "id", true);
  if (!id) return id.error();
  env.correlation_id = *id;

  if (const auto* p = field(root, "payload")) {
    if (p->type != msgpack::type::MAP)
      return bad(std::string("envelope field 'payload' must be a map, got ") + type_name(*p));
    msgpack::sbuffer pb;
    msgpack::pack(pb, *p);
    env.payload.assign(pb.data(), pb.size());
  }
  return true;
}

// A descriptor's shape: non-negative int64 dims, at most limits.max_ndim of them.
Expected<std::vector<int64_t>> read_shape(const msgpack::object& d, const std::string& where, const DecodeLimits& limits) {
  const auto* shape = field(d, "shape");
  if (!shape) return bad(where + ".shape is missing");
  if (shape->type != msgpack::type::ARRAY) return bad(where + ".shape must be an array, got " + type_name(*shape));
  if (shape->via.array.size > limits.max_ndim)
    return bad(where + ".shape has " + std::to_string(shape->via.array.size) + " dims, limit " +
               std::to_string(limits.max_ndim));
  std::vector<int64_t> out;
  for (uint32_t j = 0; j < shape->via.array.size; ++j) {
    const auto& dim = shape->via.array.ptr[j];
    if (dim.type == msgpack::type::NEGATIVE_INTEGER)
      return bad(where + ".shape[" + std::to_string(j) + "] is negative (" + std::to_string(dim.via.i64) + ")");
    if (dim.type != msgpack::type::POSITIVE_INTEGER)
      return bad(where + ".shape[" + std::to_string(j) + "] must be an integer, got " + type_name(dim));
    if (dim.via.u64 > static_cast<uint64_t>(INT64_MAX))
      return bad(where + ".shape[" + std::to_string(j) + "] overflows int64");
    out.push_back(static_cast<int64_t>(dim.via.u64));
  }
  return out;
}

// Tensor `i` from its descriptor `d` and its frame `f` (frame i + 1).
Expected<Tensor> read_tensor(const msgpack::object& d, std::size_t i, const Frame& f, const DecodeLimits& limits) {
  const std::string where = "tensors[" + std::to_string(i) + "]";
  if (d.type != msgpack::type::MAP) return bad(where + " must be a map, got " + type_name(d));
  Tensor t;
  auto name = get_str(d, "name", where + ".name", false);
  if (!name) return name.error();
  t.name = std::move(*name);
  auto dt = get_str(d, "dtype", where + ".dtype", true);
  if (!dt) return dt.error();
  auto dtype = dtype_from_name(*dt);
  if (!dtype) return bad(where + ".dtype '" + *dt + "' is not a known dtype");
  t.dtype = *dtype;
  auto shape = read_shape(d, where, limits);
  if (!shape) return shape.error();
  t.shape = std::move(*shape);
  auto expect = tensor_bytes(t.dtype, t.shape, where);
  if (!expect) return expect.error();
  auto nbytes = get_uint(d, where + ".nbytes", true);
  if (!nbytes) return nbytes.error();
  if (*nbytes != *expect)
    return bad(where + ".nbytes is " + std::to_string(*nbytes) + " but shape and dtype " +
               std::string(dtype_name(t.dtype)) + " need " + std::to_string(*expect));
  if (*expect > limits.max_tensor_bytes)
    return bad(where + " is " + std::to_string(*expect) + " bytes, limit " + std::to_string(limits.max_tensor_bytes));
  if (f.size != *expect)
    return bad("frame " + std::to_string(i + 1) + " (" + where + ") holds " + std::to_string(f.size) +
               " bytes, expected " + std::to_string(*expect));
  t.nbytes = f.size;
  auto addr = reinterpret_cast<std::uintptr_t>(f.data);
  if (f.size > 0 && addr % item_size(t.dtype) != 0)  // misaligned for the dtype (possible on tcp/ipc): one copy
    return Tensor::copy_of(std::move(t.name), t.dtype, std::move(t.shape), f.data, f.size);
  t.data = f.data;
  t.owner = f.owner;
  return t;
}

}  // namespace

Expected<Envelope> decode(std::span<const Frame> frames, const DecodeLimits& limits) {
  if (frames.empty()) return bad("no frames (expected an envelope frame)");
  auto h = unpack_head(frames[0], limits);
  if (!h) return h.error();
  const msgpack::object& root = h->get();
  Envelope env;
  if (auto ok = read_fields(root, env); !ok) return ok.error();

  std::size_t ntensors = 0;
  const msgpack::object* tensors = field(root, "tensors");
  if (tensors) {
    if (tensors->type != msgpack::type::ARRAY)
      return bad(std::string("envelope field 'tensors' must be an array, got ") + type_name(*tensors));
    ntensors = tensors->via.array.size;
  }
  if (ntensors > limits.max_tensors)
    return bad("envelope lists " + std::to_string(ntensors) + " tensors, limit " +
               std::to_string(limits.max_tensors));
  if (frames.size() != ntensors + 1)
    return bad("envelope lists " + std::to_string(ntensors) + " tensors but " +
               std::to_string(frames.size() - 1) + " tensor frames followed");
  env.tensors.reserve(ntensors);
  for (std::size_t i = 0; i < ntensors; ++i) {
    auto t = read_tensor(tensors->via.array.ptr[i], i, frames[i + 1], limits);
    if (!t) return t.error();
    env.tensors.push_back(std::move(*t));
  }
  return env;
}

Expected<bool> validate(const Envelope& env, const DecodeLimits& limits) {
  if (env.schema_version != kEnvelopeSchemaVersion)
    return make_error(ErrorCode::schema_mismatch, "envelope schema version " +
                                                      std::to_string(env.schema_version));
  if (auto ok = check_type(env.type, env.type_version); !ok) return ok;
  if (env.tensors.size() > limits.max_tensors) return bad("too many tensors");
  for (std::size_t i = 0; i < env.tensors.size(); ++i) {
    const auto& t = env.tensors[i];
    const std::string where = "tensors[" + std::to_string(i) + "] '" + t.name + "'";
    if (t.shape.size() > limits.max_ndim) return bad(where + " has too many dims");
    auto expect = tensor_bytes(t.dtype, t.shape, where);
    if (!expect) return expect.error();
    if (*expect != t.nbytes)
      return bad(where + " holds " + std::to_string(t.nbytes) + " bytes, shape and dtype need " +
                 std::to_string(*expect));
    if (t.nbytes > limits.max_tensor_bytes)
      return bad(where + " is " + std::to_string(t.nbytes) + " bytes, limit " + std::to_string(limits.max_tensor_bytes));
    if (t.nbytes > 0 && !t.data) return bad(where + " has no data");
  }
  return true;
}

std::optional<RequestOrigin> peek_request(const Frame& head, const DecodeLimits& limits) {
  const std::size_t n = head.size;
  if (n == 0 || n > limits.max_envelope_bytes) return std::nullopt;  // not one byte of it is read
  try {
    std::size_t off = 0;
    msgpack::unpack_limit limit(n, n / 2 + 1, n, n, n, 4096);  // deep enough for any bad request
    auto h = msgpack::unpack(reinterpret_cast<const char*>(head.data), n, off, nullptr, nullptr, limit);
    const msgpack::object& root = h.get();
    if (root.type != msgpack::type::MAP) return std::nullopt;
    const auto* id = field(root, "id");
    const auto* kind = field(root, "kind");
    const auto* from = field(root, "from");
    if (!id || id->type != msgpack::type::POSITIVE_INTEGER) return std::nullopt;
    if (!kind || kind->type != msgpack::type::STR ||
        std::string_view(kind->via.str.ptr, kind->via.str.size) != "request")
      return std::nullopt;
    RequestOrigin origin{id->via.u64, {}};
    if (from && from->type == msgpack::type::STR) origin.sender.assign(from->via.str.ptr, from->via.str.size);
    return origin;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

Envelope make_error_reply(const Envelope& request, const Error& error, std::string sender) {
  Envelope e = make_envelope(ErrorReply{to_string(error.code), error.message}, Kind::error,
                             std::move(sender), request.sender);
  e.correlation_id = request.correlation_id;
  e.return_path = request.return_path;
  return e;
}

Error error_from_reply(const Envelope& reply) {
  auto r = payload_as<ErrorReply>(reply);
  if (!r) return r.error();
  ErrorCode code = error_code_from_string(r->code);
  return make_error(code, r->message);
}

}  // namespace kiln::messaging

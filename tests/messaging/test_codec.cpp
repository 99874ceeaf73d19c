// Envelope codec: round trips for every dtype, empty/scalar tensors, typed payloads, and
// one test per kind of malformed input (each error names the fault).
#include <doctest/doctest.h>
#include <sys/mman.h>

#include <cstring>

#include "helpers.hpp"
#include "messaging/envelope.hpp"
#include "messaging/schema.hpp"

using namespace kiln::messaging;
using kiln::test::frames_of;
using kiln::test::random_tensor;

namespace {
Envelope sample(std::vector<Tensor> tensors) {
  auto env = make_envelope(DiagEcho{"hello"}, Kind::request, "trainer/0", "rollout/3");
  env.correlation_id = 0xfedcba9876543210ull;
  env.tensors = std::move(tensors);
  return env;
}

// A header built field by field, to write envelopes the encoder would never produce.
struct RawHeader {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk{buf};
  std::string str() const { return std::string(buf.data(), buf.size()); }
};

Expected<Envelope> decode_raw(const std::string& header, std::vector<std::string> tensor_frames = {},
                              DecodeLimits limits = {}) {
  std::vector<Frame> f{{reinterpret_cast<const std::byte*>(header.data()), header.size(), nullptr}};
  for (const auto& t : tensor_frames) f.push_back({reinterpret_cast<const std::byte*>(t.data()), t.size(), nullptr});
  return decode(f, limits);
}

// A valid header with one tensor descriptor whose fields can be overridden.
std::string header_with(const std::string& dtype, std::vector<int64_t> shape, uint64_t nbytes,
                        uint32_t v = kEnvelopeSchemaVersion, const std::string& type = "diag.echo", uint32_t tv = 1) {
  RawHeader h;
  h.pk.pack_map(9);
  h.pk.pack("v"); h.pk.pack(v);
  h.pk.pack("type"); h.pk.pack(type);
  h.pk.pack("tv"); h.pk.pack(tv);
  h.pk.pack("kind"); h.pk.pack("request");
  h.pk.pack("from"); h.pk.pack("a");
  h.pk.pack("to"); h.pk.pack("b");
  h.pk.pack("id"); h.pk.pack(1);
  h.pk.pack("payload"); h.pk.pack_map(0);
  h.pk.pack("tensors"); h.pk.pack_array(1);
  h.pk.pack_map(4);
  h.pk.pack("name"); h.pk.pack("t");
  h.pk.pack("dtype"); h.pk.pack(dtype);
  h.pk.pack("shape"); h.pk.pack(shape);
  h.pk.pack("nbytes"); h.pk.pack(nbytes);
  return h.str();
}

void check_error(const Expected<Envelope>& r, ErrorCode code, const std::string& needle) {
  REQUIRE_FALSE(r.has_value());
  CHECK(r.error().code == code);
  INFO("error: " << r.error().what());
  CHECK(r.error().message.find(needle) != std::string::npos);
}
}  // namespace

TEST_CASE("every dtype round-trips with its bytes, shape and name intact, without a copy") {
  std::mt19937_64 rng(7);
  for (DType dt : kAllDTypes) {
    CAPTURE(dtype_name(dt));
    auto env = sample({random_tensor("w", dt, {3, 5, 2}, rng)});
    std::string hs;
    auto frames = frames_of(env, hs);
    auto r = decode(frames);
    REQUIRE(r.has_value());
    CHECK(r->type == "diag.echo");
    CHECK(r->kind == Kind::request);
    CHECK(r->sender == "trainer/0");
    CHECK(r->receiver == "rollout/3");
    CHECK(r->correlation_id == 0xfedcba9876543210ull);
    REQUIRE(r->tensors.size() == 1);
    const auto& t = r->tensors[0];
    CHECK(t.name == "w");
    CHECK(t.dtype == dt);
    CHECK(t.shape == std::vector<int64_t>{3, 5, 2});
    CHECK(t.nbytes == 30 * item_size(dt));
    CHECK(t.data == env.tensors[0].data);  // points into the frame: no copy
    CHECK(std::memcmp(t.data, env.tensors[0].data, t.nbytes) == 0);
    CHECK(payload_as<DiagEcho>(*r)->note == "hello");
  }
}

TEST_CASE("every dtype's torch name parses back, with or without torch., and nothing else does") {
  for (DType dt : kAllDTypes) {
    const std::string name(torch_dtype_name(dt));
    CAPTURE(name);
    CHECK(dtype_from_torch_name(name) == dt);
    CHECK(dtype_from_torch_name("torch." + name) == dt);
  }
  CHECK(torch_dtype_name(DType::bfloat16) == "bfloat16");
  CHECK(torch_dtype_name(DType::float32) == "float32");
  for (const char* other : {"", "float", "half", "BF16", "torch.", "torch.float", "Float32", "bfloat16 "})
    CHECK_FALSE(dtype_from_torch_name(other).has_value());
}

TEST_CASE("empty, zero-sized and scalar tensors round-trip") {
  std::mt19937_64 rng(1);
  auto env = sample({random_tensor("empty", DType::float32, {0, 7}, rng), random_tensor("scalar", DType::int64, {}, rng),
                     random_tensor("zero-tail", DType::bfloat16, {4, 0}, rng)});
  std::string hs;
  auto r = decode(frames_of(env, hs));
  REQUIRE(r.has_value());
  REQUIRE(r->tensors.size() == 3);
  CHECK(r->tensors[0].nbytes == 0);
  CHECK(r->tensors[0].shape == std::vector<int64_t>{0, 7});
  CHECK(r->tensors[1].shape.empty());
  CHECK(r->tensors[1].nbytes == 8);
  CHECK(std::memcmp(r->tensors[1].data, env.tensors[1].data, 8) == 0);
  CHECK(r->tensors[2].numel() == 0);
}

TEST_CASE("typed payloads round-trip through the envelope") {
  auto env = make_envelope(GraphJoin{"node-7", "tcp://127.0.0.1:5555", {"rollout/0", "rollout/1"}}, Kind::request,
                           "node-7", "graph");
  std::string hs;
  auto r = decode(frames_of(env, hs));
  REQUIRE(r.has_value());
  auto j = payload_as<GraphJoin>(*r);
  REQUIRE(j.has_value());
  CHECK(j->node == "node-7");
  CHECK(j->endpoint == "tcp://127.0.0.1:5555");
  CHECK(j->actors == std::vector<std::string>{"rollout/0", "rollout/1"});
  // Asking for the wrong type is an error, not a garbage value.
  CHECK(payload_as<Ping>(*r).error().code == ErrorCode::unknown_type);
}

TEST_CASE("a payload whose fields have the wrong types is rejected naming the message type") {
  auto env = make_envelope(Ping{}, Kind::request, "a", "b");
  msgpack::sbuffer b;
  msgpack::packer<msgpack::sbuffer> pk(b);
  pk.pack_map(1);
  pk.pack("milliseconds");
  pk.pack("soon");  // DiagSleep::milliseconds is an integer
  env.type = "diag.sleep";
  env.payload.assign(b.data(), b.size());
  auto r = payload_as<DiagSleep>(env);
  REQUIRE_FALSE(r.has_value());
  CHECK(r.error().code == ErrorCode::bad_message);
  CHECK(r.error().message.find("diag.sleep") != std::string::npos);
}

TEST_CASE("decode rejects malformed envelopes and names the fault") {
  const std::string four(4, 'x');
  SUBCASE("no frames") { CHECK(decode({}).error().code == ErrorCode::bad_message); }
  SUBCASE("missing tensor frame") {
    check_error(decode_raw(header_with("F32", {1}, 4)), ErrorCode::bad_message, "1 tensors but 0 tensor frames");
  }
  SUBCASE("extra frame") {
    check_error(decode_raw(header_with("F32", {1}, 4), {four, four}), ErrorCode::bad_message, "2 tensor frames");
  }
  SUBCASE("frame byte length differs from numel x item size") {
    check_error(decode_raw(header_with("F32", {2}, 8), {four}), ErrorCode::bad_message, "holds 4 bytes, expected 8");
  }
  SUBCASE("nbytes field disagrees with shape and dtype") {
    check_error(decode_raw(header_with("F32", {2}, 4), {four}), ErrorCode::bad_message, "nbytes is 4");
  }
  SUBCASE("negative dimension") {
    check_error(decode_raw(header_with("F32", {-1}, 4), {four}), ErrorCode::bad_message, "shape[0] is negative");
  }
  SUBCASE("shape overflow") {
    check_error(decode_raw(header_with("F64", {int64_t(1) << 40, int64_t(1) << 40}, 0), {""}), ErrorCode::bad_message,
                "overflows");
  }
  SUBCASE("unknown dtype") {
    check_error(decode_raw(header_with("F128", {1}, 16), {std::string(16, 'x')}), ErrorCode::bad_message,
                "'F128' is not a known dtype");
  }
  SUBCASE("unknown message type") {
    check_error(decode_raw(header_with("F32", {1}, 4, 1, "rollout.fly"), {four}), ErrorCode::unknown_type,
                "unknown message type 'rollout.fly'");
  }
  SUBCASE("envelope schema version mismatch") {
    check_error(decode_raw(header_with("F32", {1}, 4, 2), {four}), ErrorCode::schema_mismatch,
                "envelope schema version 2");
  }
  SUBCASE("message type schema version mismatch") {
    check_error(decode_raw(header_with("F32", {1}, 4, 1, "diag.echo", 9), {four}), ErrorCode::schema_mismatch,
                "'diag.echo' has schema version 9");
  }
  SUBCASE("truncated msgpack") {
    auto h = header_with("F32", {1}, 4);
    check_error(decode_raw(h.substr(0, h.size() / 2), {four}), ErrorCode::bad_message, "not valid msgpack");
  }
  SUBCASE("trailing bytes after the envelope") {
    check_error(decode_raw(header_with("F32", {1}, 4) + "\x01", {four}), ErrorCode::bad_message, "trailing");
  }
  SUBCASE("oversized envelope frame") {
    DecodeLimits lim;
    lim.max_envelope_bytes = 32;
    check_error(decode_raw(header_with("F32", {1}, 4), {four}, lim), ErrorCode::bad_message, "limit 32");
  }
  SUBCASE("a container that claims more elements than the frame holds") {
    // map32 header claiming 2^31 entries in a 5-byte frame: rejected without allocating.
    std::string h = "\xdf\x80\x00\x00\x00";
    check_error(decode_raw(h), ErrorCode::bad_message, "not valid msgpack");
    std::string a = "\xdd\x7f\xff\xff\xff";  // array32 of 2^31-1 elements
    check_error(decode_raw(a), ErrorCode::bad_message, "not valid msgpack");
  }
  SUBCASE("too deep nesting") {
    std::string deep(100, '\x91');  // 100 nested one-element arrays
    deep += '\x00';
    check_error(decode_raw(deep), ErrorCode::bad_message, "not valid msgpack");
  }
  SUBCASE("missing required field") {
    RawHeader h;
    h.pk.pack_map(4);
    h.pk.pack("v"); h.pk.pack(1);
    h.pk.pack("type"); h.pk.pack("ping");
    h.pk.pack("tv"); h.pk.pack(1);
    h.pk.pack("kind"); h.pk.pack("tell");
    check_error(decode_raw(h.str()), ErrorCode::bad_message, "'to' is missing");
  }
  SUBCASE("field of the wrong type") {
    RawHeader h;
    h.pk.pack_map(6);
    h.pk.pack("v"); h.pk.pack(1);
    h.pk.pack("type"); h.pk.pack("ping");
    h.pk.pack("tv"); h.pk.pack(1);
    h.pk.pack("kind"); h.pk.pack("tell");
    h.pk.pack("to"); h.pk.pack("x");
    h.pk.pack("id"); h.pk.pack("seven");
    check_error(decode_raw(h.str()), ErrorCode::bad_message, "'id' must be an unsigned integer, got str");
  }
  SUBCASE("unknown kind") {
    RawHeader h;
    h.pk.pack_map(6);
    h.pk.pack("v"); h.pk.pack(1);
    h.pk.pack("type"); h.pk.pack("ping");
    h.pk.pack("tv"); h.pk.pack(1);
    h.pk.pack("kind"); h.pk.pack("shout");
    h.pk.pack("to"); h.pk.pack("x");
    h.pk.pack("id"); h.pk.pack(3);
    check_error(decode_raw(h.str()), ErrorCode::bad_message, "'kind' is 'shout'");
  }
  SUBCASE("not a map at all") { check_error(decode_raw(std::string("\x93\x01\x02\x03")), ErrorCode::bad_message, "must be a msgpack map"); }
}

TEST_CASE("a misaligned tensor frame is copied into an aligned buffer") {
  std::string storage(1 + 16, '\0');
  for (int i = 0; i < 16; ++i) storage[1 + i] = char(i);
  auto h = header_with("F64", {2}, 16);
  std::vector<Frame> f{{reinterpret_cast<const std::byte*>(h.data()), h.size(), nullptr},
                       {reinterpret_cast<const std::byte*>(storage.data() + 1), 16, nullptr}};
  auto r = decode(f);
  REQUIRE(r.has_value());
  CHECK(reinterpret_cast<std::uintptr_t>(r->tensors[0].data) % 8 == 0);
  CHECK(std::memcmp(r->tensors[0].data, storage.data() + 1, 16) == 0);
}

TEST_CASE("validate catches an envelope built wrong before it is sent") {
  auto t = Tensor::zeros("t", DType::float32, {4});
  t.nbytes = 12;  // lies about its size
  auto env = sample({t});
  auto ok = validate(env);
  REQUIRE_FALSE(ok.has_value());
  CHECK(ok.error().message.find("holds 12 bytes") != std::string::npos);
  env.tensors.clear();
  env.type = "nope";
  CHECK(validate(env).error().code == ErrorCode::unknown_type);
}

TEST_CASE("a tensor over max_tensor_bytes is refused naming its size and the limit") {
  DecodeLimits lim;
  lim.max_tensor_bytes = 8;
  check_error(decode_raw(header_with("F32", {4}, 16), {std::string(16, '\0')}, lim), ErrorCode::bad_message,
              "tensors[0] is 16 bytes, limit 8");
  auto ok = validate(sample({Tensor::zeros("t", DType::float32, {4})}), lim);
  REQUIRE_FALSE(ok.has_value());
  CHECK(ok.error().message.find("is 16 bytes, limit 8") != std::string::npos);
}

TEST_CASE("a frame 0 over the limit is refused by its size without reading a byte of it") {
  // 128 MiB + 1 of address space with no memory behind it and no read permission: a decoder,
  // or a peek for the request id, that touched one byte of it would crash this test.
  const std::size_t n = (std::size_t(128) << 20) + 1;
  void* p = ::mmap(nullptr, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  REQUIRE(p != MAP_FAILED);
  const Frame head{static_cast<const std::byte*>(p), n, nullptr};
  auto r = decode(std::span<const Frame>(&head, 1));
  REQUIRE_FALSE(r.has_value());
  CHECK(r.error().code == ErrorCode::bad_message);
  CHECK(r.error().message == "frame 0 (envelope) is 134217729 bytes, limit 16777216");
  CHECK_FALSE(peek_request(head).has_value());
  ::munmap(p, n);
}

TEST_CASE("a rejected request within the limit still gives its id and sender for the error reply") {
  auto h = header_with("F32", {1}, 4);  // a request, id 1, from "a"
  const Frame head{reinterpret_cast<const std::byte*>(h.data()), h.size(), nullptr};
  auto origin = peek_request(head);
  REQUIRE(origin.has_value());
  CHECK(origin->correlation_id == 1);
  CHECK(origin->sender == "a");
  DecodeLimits lim;
  lim.max_envelope_bytes = h.size() - 1;  // one byte over the limit: not read
  CHECK_FALSE(peek_request(head, lim).has_value());
}

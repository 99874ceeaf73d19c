// Gateways inside one process: request/reply and tells over inproc, ipc and tcp; zero-copy
// inproc delivery; errors as values (unknown actor, timeout, remote error, malformed bytes).
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstring>
#include <zmq.hpp>

#include "actors/diag/diag_service.hpp"
#include "../scratch.hpp"
#include "../test_util.hpp"
#include "helpers.hpp"
#include "messaging/gateway.hpp"

using namespace kiln::messaging;
using namespace std::chrono_literals;
using kiln::test::decode_reply;
using kiln::test::raw_dealer;

namespace {
std::string endpoint(const std::string& transport, const std::string& tag) {
  if (transport == "inproc") return "inproc://gw-test-" + tag;
  if (transport == "ipc") return kiln::test::scratch_ipc("gw-" + tag);
  return "tcp://127.0.0.1:0";
}

// Hosts a DiagService directly on the gateway thread (the tests need no CAF here).
void serve_diag(Gateway& gw, const std::string& name) {
  auto svc = std::make_shared<kiln::actors::DiagService>(gw.node(), name);
  gw.serve(name, [&gw, svc](Envelope env) {
    auto r = svc->handle(env);
    if (r) gw.reply(env, std::move(*r));
    else gw.reply_error(env, r.error());
  });
}
}  // namespace

TEST_CASE("request and reply with tensors over inproc, ipc and tcp") {
  for (std::string transport : {"inproc", "ipc", "tcp"}) {
    CAPTURE(transport);
    Gateway b({"b", endpoint(transport, "rr")});
    Gateway a({"a", ""});
    serve_diag(b, "diag/0");
    a.add_route("diag/0", b.endpoint());
    std::mt19937_64 rng(3);
    auto env = make_envelope(DiagEcho{"x"}, Kind::request, "test", "diag/0");
    env.tensors = {kiln::test::random_tensor("w", DType::bfloat16, {128, 64}, rng),
                   kiln::test::random_tensor("ids", DType::int64, {7}, rng)};
    auto r = a.request(env, 5s).get();
    REQUIRE_MESSAGE(r.has_value(), r.error().what());
    auto res = payload_as<DiagEchoResult>(*r);
    REQUIRE(res.has_value());
    CHECK(res->node == "b");
    REQUIRE(res->crc32.size() == 2);
    CHECK(res->crc32[0] == crc32(env.tensors[0]));
    CHECK(res->crc32[1] == crc32(env.tensors[1]));
    REQUIRE(r->tensors.size() == 2);
    CHECK(std::memcmp(r->tensors[0].data, env.tensors[0].data, env.tensors[0].nbytes) == 0);
    CHECK(r->tensors[1].shape == std::vector<int64_t>{7});
    CHECK(a.stats().sent == 1);
    CHECK(b.stats().received == 1);
  }
}

TEST_CASE("inproc delivery passes the sender's buffer: no byte is copied") {
  Gateway b({"b", "inproc://gw-test-zero-copy"});
  Gateway a({"a", ""});
  std::promise<const std::byte*> seen;
  b.serve("sink", [&](Envelope env) { seen.set_value(env.tensors.at(0).data); });
  a.add_route("sink", b.endpoint());
  auto t = Tensor::zeros("big", DType::float32, {1 << 20});
  auto env = make_envelope(BenchChunk{1}, Kind::tell, "test", "sink");
  env.tensors.push_back(t);
  a.tell(env);
  CHECK(seen.get_future().get() == t.data);
}

TEST_CASE("a local actor is reached without ZeroMQ, replies included") {
  Gateway a({"a", ""});
  serve_diag(a, "diag/0");
  auto r = a.request(make_envelope(Ping{"local"}, Kind::request, "test", "diag/0"), 2s).get();
  REQUIRE(r.has_value());
  CHECK(payload_as<Pong>(*r)->note == "local");
}

TEST_CASE("unknown actors are errors that name the actor") {
  Gateway b({"b", endpoint("inproc", "unknown")});
  Gateway a({"a", ""});
  auto local = a.request(make_envelope(Ping{}, Kind::request, "test", "ghost/0"), 1s).get();
  REQUIRE_FALSE(local.has_value());
  CHECK(local.error().code == ErrorCode::unknown_actor);
  CHECK(local.error().message.find("ghost/0") != std::string::npos);
  // Routed to a node that does not host it: the remote node answers with the error.
  serve_diag(b, "diag/0");
  a.add_route("ghost/1", b.endpoint());
  auto remote = a.request(make_envelope(Ping{}, Kind::request, "test", "ghost/1"), 2s).get();
  REQUIRE_FALSE(remote.has_value());
  CHECK(remote.error().code == ErrorCode::unknown_actor);
  CHECK(remote.error().message.find("hosts no actor 'ghost/1' (it hosts: diag/0)") != std::string::npos);
}

TEST_CASE("a request nobody answers completes with timeout, not a hang") {
  Gateway b({"b", endpoint("ipc", "silent")});
  Gateway a({"a", ""});
  b.serve("silent/0", [](Envelope) {});  // never replies
  a.add_route("silent/0", b.endpoint());
  auto t0 = kiln::test::Clock::now();
  auto r = a.request(make_envelope(Ping{}, Kind::request, "test", "silent/0"), 300ms).get();
  auto waited = kiln::test::since(t0);
  REQUIRE_FALSE(r.has_value());
  CHECK(r.error().code == ErrorCode::timeout);
  CHECK(waited >= 300ms);
  CHECK(waited < 2s);
}

TEST_CASE("a remote actor's error comes back as a value") {
  Gateway b({"b", endpoint("tcp", "")});
  Gateway a({"a", ""});
  serve_diag(b, "diag/0");
  a.add_route("diag/0", b.endpoint());
  // DiagService does not handle graph.lookup: it answers unknown_type.
  auto r = a.request(make_envelope(GraphLookup{"x"}, Kind::request, "test", "diag/0"), 2s).get();
  REQUIRE_FALSE(r.has_value());
  CHECK(r.error().code == ErrorCode::unknown_type);
  CHECK(r.error().message.find("does not handle 'graph.lookup'") != std::string::npos);
}

TEST_CASE("nodes join a root and reach each other's actors through its directory") {
  Gateway root({"root", endpoint("ipc", "root")});
  Gateway b({"b", endpoint("ipc", "join-b")});
  Gateway c({"c", endpoint("tcp", "")});
  serve_diag(b, "diag/7");
  serve_diag(root, "diag/root");
  auto jb = b.join(root.endpoint(), 3s);
  REQUIRE_MESSAGE(jb.has_value(), jb.error().what());
  CHECK(jb->actors.at("diag/root") == root.endpoint());
  auto jc = c.join(root.endpoint(), 3s);
  REQUIRE(jc.has_value());
  CHECK(jc->actors.at("diag/7") == b.endpoint());
  CHECK(root.wait_for_actor("diag/7", 2s).has_value());
  // c never added a route to diag/7 by hand: it resolves it through the root.
  Gateway d({"d", ""});
  REQUIRE(d.join(root.endpoint(), 3s).has_value());
  auto r = d.request(make_envelope(Ping{"via root"}, Kind::request, "test", "diag/7"), 3s).get();
  REQUIRE_MESSAGE(r.has_value(), r.error().what());
  CHECK(payload_as<Pong>(*r)->node == "b");
  auto miss = d.request(make_envelope(Ping{}, Kind::request, "test", "nobody/0"), 3s).get();
  REQUIRE_FALSE(miss.has_value());
  CHECK(miss.error().code == ErrorCode::unknown_actor);
  CHECK(miss.error().message.find("graph root") != std::string::npos);
}

TEST_CASE("a malformed message from a raw socket gets an error reply naming the fault") {
  Gateway b({"b", endpoint("tcp", "")});
  serve_diag(b, "diag/0");
  zmq::context_t ctx;
  auto s = raw_dealer(ctx, b.endpoint());
  // A request that lists one tensor but sends none.
  auto env = make_envelope(DiagEcho{}, Kind::request, "raw", "diag/0");
  env.correlation_id = 77;
  env.tensors.push_back(Tensor::zeros("t", DType::float32, {4}));
  std::string header = encode_header(env);
  s.send(zmq::buffer(header));
  zmq::message_t reply;
  REQUIRE(s.recv(reply));
  auto r = decode_reply(reply);
  REQUIRE(r.has_value());
  CHECK(r->kind == Kind::error);
  CHECK(r->correlation_id == 77);
  auto err = error_from_reply(*r);
  CHECK(err.code == ErrorCode::bad_message);
  CHECK(err.message.find("1 tensors but 0 tensor frames") != std::string::npos);
  CHECK(b.stats().rejected == 1);
  // The gateway keeps serving after rejecting garbage.
  Gateway a({"a", ""});
  a.add_route("diag/0", b.endpoint());
  CHECK(a.request(make_envelope(Ping{}, Kind::request, "t", "diag/0"), 2s).get().has_value());
}

TEST_CASE("an endpoint that cannot be bound is an exception naming it") {
  CHECK_THROWS_WITH_AS(Gateway({"x", "tcp://no-such-host-kiln:1"}), doctest::Contains("tcp://no-such-host-kiln:1"),
                       std::runtime_error);
}

TEST_CASE("an envelope built wrong is refused before it is sent") {
  Gateway a({"a", ""});
  serve_diag(a, "diag/0");
  auto env = make_envelope(DiagEcho{}, Kind::request, "t", "diag/0");
  env.tensors.push_back(Tensor::zeros("t", DType::float32, {4}));
  env.tensors[0].shape = {5};
  auto r = a.request(env, 1s).get();
  REQUIRE_FALSE(r.has_value());
  CHECK(r.error().code == ErrorCode::bad_message);
}

TEST_CASE("an endpoint with an unsupported transport is an error value, not a crash") {
  Gateway a({"a", ""});
  a.add_route("far/0", "bogus://x");
  auto r = a.request(make_envelope(Ping{}, Kind::request, "t", "far/0"), 1s).get();
  REQUIRE_FALSE(r.has_value());
  CHECK(r.error().code == ErrorCode::transport);
  CHECK(r.error().message.find("cannot connect to 'bogus://x'") != std::string::npos);
  auto j = a.join("bogus://root", 1s);
  REQUIRE_FALSE(j.has_value());
  CHECK(j.error().code == ErrorCode::transport);
}

TEST_CASE("a node cannot join with an actor name the graph already has") {
  Gateway root({"root", endpoint("inproc", "conflict-root")});
  serve_diag(root, "diag/0");
  Gateway b({"b", endpoint("inproc", "conflict-b")});
  serve_diag(b, "diag/0");
  auto j = b.join(root.endpoint(), 2s);
  REQUIRE_FALSE(j.has_value());
  CHECK(j.error().message.find("already in the graph: 'diag/0'") != std::string::npos);
}

TEST_CASE("bad payload fields are reported with what arrived, and over-long sleeps are refused") {
  Gateway a({"a", ""});
  serve_diag(a, "diag/0");
  auto r = a.request(make_envelope(DiagSleep{100000}, Kind::request, "t", "diag/0"), 2s).get();
  REQUIRE_FALSE(r.has_value());
  CHECK(r.error().message.find("'milliseconds' is 100000, at most 60000") != std::string::npos);
  auto env = make_envelope(Ping{}, Kind::request, "t", "diag/0");
  env.type = "diag.echo";
  msgpack::sbuffer b;
  msgpack::packer<msgpack::sbuffer> pk(b);
  pk.pack_map(1);
  pk.pack("note");
  pk.pack(5);
  env.payload.assign(b.data(), b.size());
  auto e = a.request(env, 2s).get();
  REQUIRE_FALSE(e.has_value());
  CHECK(e.error().message.find("got {note: uint 5}") != std::string::npos);
}

TEST_CASE("a request nested too deep still gets an error reply") {
  Gateway b({"b", endpoint("tcp", "")});
  zmq::context_t ctx;
  auto s = raw_dealer(ctx, b.endpoint());
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_map(8);
  pk.pack("v"); pk.pack(1);
  pk.pack("type"); pk.pack("ping");
  pk.pack("tv"); pk.pack(1);
  pk.pack("kind"); pk.pack("request");
  pk.pack("to"); pk.pack("x");
  pk.pack("id"); pk.pack(99);
  pk.pack("tensors"); pk.pack_array(0);
  pk.pack("payload");
  for (int i = 0; i < 200; ++i) pk.pack_array(1);
  pk.pack(0);
  s.send(zmq::buffer(std::string(buf.data(), buf.size())));
  zmq::message_t reply;
  REQUIRE(s.recv(reply));
  auto r = decode_reply(reply);
  REQUIRE(r.has_value());
  CHECK(r->kind == Kind::error);
  CHECK(r->correlation_id == 99);
}

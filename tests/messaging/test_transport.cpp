// The gateway's transport and its size limits (DecodeLimits): refusing a frame over the limit
// costs memory that does not grow with the frame, and a frame over the limits is dropped by
// ZeroMQ itself (ZMQ_MAXMSGSIZE) without disturbing the gateway.
#include <doctest/doctest.h>
#include <sys/resource.h>

#include <atomic>
#include <thread>
#include <zmq.hpp>

#include "helpers.hpp"
#include "messaging/gateway.hpp"

using namespace kiln::messaging;
using namespace std::chrono_literals;
using kiln::test::decode_reply;
using kiln::test::raw_dealer;

namespace {
// The process's peak resident memory so far, MiB.
long peak_rss_mib() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024;
}

// A msgpack map32 of `pairs` nil -> nil entries: 2 bytes a pair on the wire, 48 bytes a pair
// once parsed into msgpack-c objects.
std::string nil_pairs(uint32_t pairs) {
  std::string s(5 + 2 * std::size_t(pairs), '\xc0');
  s[0] = '\xdf';
  for (int i = 0; i < 4; ++i) s[1 + i] = char(pairs >> (24 - 8 * i));
  return s;
}

// Polls `done` every 10 ms for up to 10 s.
template <class F>
bool eventually(F done) {
  for (int i = 0; i < 1000; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return done();
}
}  // namespace

TEST_CASE("refusing an envelope frame over the limit costs memory that does not grow with the frame") {
  Gateway b({"b", "inproc://gw-limits-refuse"});  // default limits: frame 0 up to 16 MiB
  DecodeLimits roomy;
  roomy.max_envelope_bytes = 256u << 20;  // the sender allows what b refuses
  Gateway a(Gateway::Options{.node = "a", .limits = roomy});
  std::atomic<int> delivered{0};
  b.serve("sink/0", [&](Envelope) { delivered++; });
  a.add_route("sink/0", b.endpoint());
  auto env = make_envelope(BenchChunk{1}, Kind::tell, "t", "sink/0");
  env.payload = nil_pairs(16u << 20);  // 32 MiB; parsed, it would take about 800 MB
  const long before = peak_rss_mib();
  a.tell(std::move(env));  // inproc: no ZMQ_MAXMSGSIZE, b's decoder sees the frame
  REQUIRE(eventually([&] { return b.stats().rejected == 1; }));
  // b counts the frame as rejected before it is done with it: a ping to b's own graph actor
  // runs on b's I/O thread after that.
  REQUIRE(b.request(make_envelope(Ping{}, Kind::request, "t", "graph"), 10s).get().has_value());
  const long grown = peak_rss_mib() - before;
  CHECK(delivered == 0);
  // The frame passes through a few buffers (the encoder's, ZeroMQ's): a small multiple of it.
  CHECK_MESSAGE(grown < 256, "refusing a 32 MiB frame raised the peak RSS by " << grown << " MiB");
}

TEST_CASE("a frame over the limits is dropped by ZeroMQ at the socket and the gateway keeps serving") {
  DecodeLimits small;
  small.max_envelope_bytes = 4096;
  small.max_tensor_bytes = 64 << 10;  // so ZMQ_MAXMSGSIZE is 64 KiB
  Gateway b(Gateway::Options{.node = "b", .bind = "tcp://127.0.0.1:0", .limits = small});
  std::atomic<int> delivered{0};
  b.serve("sink/0", [&](Envelope env) {
    delivered++;
    if (env.kind == Kind::request) b.reply(env, make_envelope(Pong{"b", "sink/0", ""}, Kind::reply, "", ""));
  });
  zmq::context_t ctx;
  auto s = raw_dealer(ctx, b.endpoint());
  s.set(zmq::sockopt::rcvtimeo, 500);
  // A well-formed tell whose one tensor frame (1 MiB) is over the limit.
  auto big = make_envelope(BenchChunk{1}, Kind::tell, "raw", "sink/0");
  big.tensors.push_back(Tensor::zeros("t", DType::uint8, {1 << 20}));
  std::string header = encode_header(big);
  s.send(zmq::buffer(header), zmq::send_flags::sndmore);
  s.send(zmq::const_buffer(big.tensors[0].data, big.tensors[0].nbytes));
  // ZeroMQ dropped the connection that sent it; the DEALER reconnects and is answered again.
  bool answered = false;
  for (uint64_t id = 1; id <= 20 && !answered; ++id) {
    auto ping = make_envelope(Ping{}, Kind::request, "raw", "graph");
    ping.correlation_id = id;
    std::string ping_header = encode_header(ping);
    s.send(zmq::buffer(ping_header));
    zmq::message_t reply;
    if (s.recv(reply)) answered = decode_reply(reply).has_value();
  }
  CHECK(answered);
  CHECK(delivered == 0);
  CHECK(b.stats().rejected == 0);  // it never reached the decoder
  Gateway a({"a", ""});
  a.add_route("sink/0", b.endpoint());
  auto r = a.request(make_envelope(Ping{}, Kind::request, "t", "sink/0"), 3s).get();
  CHECK_MESSAGE(r.has_value(), r.error().what());
  CHECK(delivered == 1);
}

TEST_CASE("an envelope frame over the sender's own limit is refused before it is sent") {
  Gateway b({"b", "inproc://gw-limits-sender"});
  DecodeLimits small;
  small.max_envelope_bytes = 1024;
  Gateway a(Gateway::Options{.node = "a", .limits = small});
  b.serve("sink/0", [](Envelope) {});
  a.add_route("sink/0", b.endpoint());
  auto r = a.request(make_envelope(DiagEcho{std::string(2000, 'x')}, Kind::request, "t", "sink/0"), 2s).get();
  REQUIRE_FALSE(r.has_value());
  CHECK(r.error().code == ErrorCode::bad_message);
  CHECK(r.error().message.find("bytes, limit 1024") != std::string::npos);
  CHECK(b.stats().received == 0);
}

// The gateway's transport and its size limits (DecodeLimits): refusing a frame over the limit
// costs memory that does not grow with the frame.
#include <doctest/doctest.h>
#include <sys/resource.h>

#include <atomic>
#include <thread>

#include "helpers.hpp"
#include "messaging/gateway.hpp"

using namespace kiln::messaging;
using namespace std::chrono_literals;

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

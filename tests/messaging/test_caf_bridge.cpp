// CAF actors behind logical names: a service hosted by spawn_service, and a hand-written
// CAF actor bound with bind_actor, both reached through a gateway.
#include <doctest/doctest.h>

#include "actors/diag/diag_service.hpp"
#include "messaging/caf_bridge.hpp"

using namespace kiln::messaging;
using namespace std::chrono_literals;

TEST_CASE("a service in a CAF actor answers requests arriving over ZeroMQ") {
  caf::actor_system_config cfg;
  caf::actor_system sys{cfg};
  {
    Gateway b({"b", "inproc://caf-bridge-b"});
    Gateway a({"a", ""});
    auto actor = spawn_service(sys, b, "diag/0", std::make_shared<kiln::actors::DiagService>("b", "diag/0"), true);
    a.add_route("diag/0", b.endpoint());
    auto r = a.request(make_envelope(Ping{"caf"}, Kind::request, "t", "diag/0"), 5s).get();
    REQUIRE_MESSAGE(r.has_value(), r.error().what());
    CHECK(payload_as<Pong>(*r)->actor == "diag/0");
    auto bad = a.request(make_envelope(GraphLookup{}, Kind::request, "t", "diag/0"), 5s).get();
    REQUIRE_FALSE(bad.has_value());
    CHECK(bad.error().code == ErrorCode::unknown_type);
    caf::anon_send_exit(actor, caf::exit_reason::user_shutdown);
    sys.await_all_actors_done();
  }
}

TEST_CASE("a hand-written CAF actor bound to a name receives tells in order") {
  caf::actor_system_config cfg;
  caf::actor_system sys{cfg};
  Gateway b({"b", "inproc://caf-bridge-tells"});
  Gateway a({"a", ""});
  auto seen = std::make_shared<std::promise<std::vector<uint64_t>>>();
  auto actor = sys.spawn([seen](caf::event_based_actor* self) -> caf::behavior {
    auto got = std::make_shared<std::vector<uint64_t>>();
    return {[=](Envelope& env) {
      got->push_back(payload_as<BenchChunk>(env)->seq);
      if (got->size() == 100) {
        seen->set_value(*got);
        self->quit();
      }
    }};
  });
  bind_actor(b, "counter/0", actor);
  a.add_route("counter/0", b.endpoint());
  for (uint64_t i = 0; i < 100; ++i) a.tell(make_envelope(BenchChunk{i}, Kind::tell, "t", "counter/0"));
  auto got = seen->get_future().get();
  REQUIRE(got.size() == 100);
  for (uint64_t i = 0; i < 100; ++i) CHECK(got[i] == i);
  sys.await_all_actors_done();
}

// Collective weight sync's receiving side (actors/weight_sync/collective.hpp) over Gloo, the
// sender played by hand (rank 0 of a group made here) so that a checksum can be made wrong:
// a good version lands bit for bit; a bucket whose checksum differs is not written, nor any
// bucket after it, the error names the tensor, and the engine reports itself torn when an
// earlier bucket was written; a plan naming a tensor the engine lacks writes nothing.
#include <doctest/doctest.h>

#include <future>
#include <thread>

#include "actors/weight_sync/collective.hpp"
#include "actors/weight_sync/messages.hpp"
#include "kernels/checksum.hpp"
#include "parallel/process_group.hpp"

using namespace kiln;
using namespace kiln::messaging;

namespace {

struct Net : torch::nn::Module {
  torch::Tensor a, b;
  explicit Net(float fill) {
    a = register_parameter("a", torch::full({4, 3}, fill));
    b = register_parameter("b", torch::full({5}, fill));
  }
};

// The sender's side by hand: rank 0 of a 2-rank Gloo group on `port`.
std::unique_ptr<parallel::ProcessGroups> sender_group(int port) {
  parallel::LaunchInfo info;
  info.world_size = 2;
  info.master_port = port;
  return std::make_unique<parallel::ProcessGroups>(info, torch::kCPU, std::vector<parallel::MeshDim>{},
                                                   parallel::GroupOptions{std::chrono::seconds(30), std::chrono::seconds(30), 7});
}

// One bucket per tensor: "a" then "b", 16-byte aligned within the bucket (kAlign).
WeightSyncCollective plan(int64_t version, const std::string& second = "b") {
  return {version, {{"a"}, {second}}, {48, 32}, {48, 20}};
}

// Broadcasts `a` and `b` as the plan's two buckets; `wrong`: the bucket whose checksum is off.
void send(parallel::Group& g, const torch::Tensor& a, const torch::Tensor& b, int wrong = -1) {
  int bucket = 0;
  for (const auto& t : {a, b}) {
    auto buffer = torch::zeros({bucket == 0 ? 48 : 32}, torch::kUInt8);
    buffer.narrow(0, 0, t.numel() * 4).view(torch::kFloat32).copy_(t.flatten());
    auto sums = kernels::checksum(t.contiguous()).view({1}).clone();
    if (bucket == wrong) sums += 1;
    g.broadcast(buffer, 0);
    g.broadcast(sums, 0);
    ++bucket;
  }
}

}  // namespace

TEST_CASE("collective weight sync: checked buckets land, a bad one and those after it do not") {
  const int port = parallel::free_loopback_port();
  weight_sync::CollectiveReceiver rx;
  Net engine(0.f);
  auto join = std::async(std::launch::async, [&] {
    return rx.join(make_envelope(WeightSyncJoinGroup{"127.0.0.1", port, 1, 2, 7, 30000, 30000}, Kind::request, "t", "e"),
                   torch::kCPU);
  });
  auto g = sender_group(port);
  REQUIRE(join.get());

  // A good version.
  auto a1 = torch::arange(12, torch::kFloat32).view({4, 3}), b1 = torch::arange(5, torch::kFloat32) + 100;
  auto r = std::async(std::launch::async, [&] { return rx.receive(make_envelope(plan(1), Kind::request, "t", "e"), engine); });
  send(g->world(), a1, b1);
  auto got = r.get();
  REQUIRE(got);
  CHECK(payload_as<WeightSyncAck>(*got)->version == 1);
  CHECK(torch::equal(engine.a, a1));
  CHECK(torch::equal(engine.b, b1));
  CHECK_FALSE(rx.torn());

  // The first bucket's checksum is off: nothing is written.
  r = std::async(std::launch::async, [&] { return rx.receive(make_envelope(plan(2), Kind::request, "t", "e"), engine); });
  send(g->world(), a1 * 2, b1 * 2, /*wrong=*/0);
  got = r.get();
  REQUIRE_FALSE(got);
  CHECK(got.error().message.find("a (checksum differs)") != std::string::npos);
  CHECK(torch::equal(engine.a, a1));
  CHECK(torch::equal(engine.b, b1));
  CHECK_FALSE(rx.torn());

  // The second bucket's checksum is off: the first is written, the engine says it is torn.
  r = std::async(std::launch::async, [&] { return rx.receive(make_envelope(plan(3), Kind::request, "t", "e"), engine); });
  send(g->world(), a1 * 3, b1 * 3, /*wrong=*/1);
  got = r.get();
  REQUIRE_FALSE(got);
  CHECK(got.error().message.find("b (checksum differs)") != std::string::npos);
  CHECK(got.error().message.find("mix of versions") != std::string::npos);
  CHECK(torch::equal(engine.a, a1 * 3));
  CHECK(torch::equal(engine.b, b1));
  CHECK(rx.torn());

  // A plan naming a tensor this engine lacks: received, nothing written; a whole version then
  // clears the torn state.
  r = std::async(std::launch::async, [&] { return rx.receive(make_envelope(plan(4, "c"), Kind::request, "t", "e"), engine); });
  send(g->world(), a1 * 4, b1 * 4);
  got = r.get();
  REQUIRE_FALSE(got);
  CHECK(got.error().message.find("c (unknown to this engine)") != std::string::npos);
  CHECK(torch::equal(engine.a, a1 * 3));
  r = std::async(std::launch::async, [&] { return rx.receive(make_envelope(plan(5), Kind::request, "t", "e"), engine); });
  send(g->world(), a1 * 5, b1 * 5);
  REQUIRE(r.get());
  CHECK(torch::equal(engine.a, a1 * 5));
  CHECK(torch::equal(engine.b, b1 * 5));
  CHECK_FALSE(rx.torn());
}

TEST_CASE("collective weight sync: a receive before joining, and a malformed plan, are refused by name") {
  weight_sync::CollectiveReceiver rx;
  Net engine(0.f);
  auto r = rx.receive(make_envelope(plan(1), Kind::request, "t", "e"), engine);
  REQUIRE_FALSE(r);
  CHECK(r.error().message.find("before weight_sync.join_group") != std::string::npos);
  auto j = rx.join(make_envelope(WeightSyncJoinGroup{"127.0.0.1", 0, 1, 2, 1, 1000, 1000}, Kind::request, "t", "e"), torch::kCPU);
  REQUIRE_FALSE(j);
  CHECK(j.error().message.find("port 0") != std::string::npos);
}

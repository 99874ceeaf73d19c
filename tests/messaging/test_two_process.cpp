// Real processes: `kiln node` children joined to this test's root gateway over loopback.
#include <doctest/doctest.h>

#include <cstring>
#include <thread>

#include "child_process.hpp"
#include "../scratch.hpp"
#include "../test_util.hpp"
#include "helpers.hpp"
#include "messaging/gateway.hpp"

using namespace kiln::messaging;
using namespace std::chrono_literals;
using kiln::test::ChildProcess;

namespace {
std::string ipc(const std::string& tag) { return kiln::test::scratch_ipc("2p-" + tag); }

ChildProcess start_node(const std::string& name, const std::string& bind, const std::string& root) {
  return ChildProcess({KILN_EXE, "node", "--name", name, "--bind", bind, "--join", root, "--actor", "diag/0"});
}
}  // namespace

TEST_CASE("two processes exchange typed messages and a 64 MiB bf16 tensor, bytes intact") {
  for (std::string transport : {"ipc", "tcp"}) {
    CAPTURE(transport);
    Gateway root({"root", transport == "ipc" ? ipc("root") : "tcp://127.0.0.1:0"});
    auto node = start_node("worker-" + transport, transport == "ipc" ? ipc("worker") : "tcp://127.0.0.1:0",
                           root.endpoint());
    auto up = root.wait_for_actor("diag/0", 20s);
    REQUIRE_MESSAGE(up.has_value(), up.error().what());

    auto pong = root.request(make_envelope(Ping{"hi"}, Kind::request, "test", "diag/0"), 5s).get();
    REQUIRE_MESSAGE(pong.has_value(), pong.error().what());
    CHECK(payload_as<Pong>(*pong)->node == "worker-" + transport);
    CHECK(payload_as<Pong>(*pong)->note == "hi");

    std::mt19937_64 rng(64);
    auto big = Tensor::zeros("w_gate_up_EFD", DType::bfloat16, {32, 1024, 1024});  // 64 MiB
    auto* words = reinterpret_cast<uint64_t*>(big.mutable_data());
    for (std::size_t i = 0; i < big.nbytes / 8; ++i) words[i] = rng();
    auto env = make_envelope(DiagEcho{"big"}, Kind::request, "test", "diag/0");
    env.tensors.push_back(big);
    auto r = root.request(env, 30s).get();
    REQUIRE_MESSAGE(r.has_value(), r.error().what());
    auto res = payload_as<DiagEchoResult>(*r);
    REQUIRE(res.has_value());
    CHECK(res->nbytes.at(0) == 64ull << 20);
    CHECK(res->crc32.at(0) == crc32(big));  // the child saw exactly our bytes
    REQUIRE(r->tensors.size() == 1);
    const auto& back = r->tensors[0];
    CHECK(back.dtype == DType::bfloat16);
    CHECK(back.shape == big.shape);
    REQUIRE(back.nbytes == big.nbytes);
    CHECK(std::memcmp(back.data, big.data, big.nbytes) == 0);  // and we got them back
    node.signal(SIGTERM);
    int status = node.wait();
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }
}

TEST_CASE("killing a peer process fails the requests waiting on it within the timeout") {
  Gateway root({"root", ipc("kill-root")});
  auto node = start_node("doomed", ipc("kill-node"), root.endpoint());
  REQUIRE(root.wait_for_actor("diag/0", 20s).has_value());
  REQUIRE(root.request(make_envelope(Ping{}, Kind::request, "t", "diag/0"), 5s).get().has_value());
  auto t0 = kiln::test::Clock::now();
  auto pending = root.request(make_envelope(DiagSleep{60000}, Kind::request, "t", "diag/0"), 10s);
  std::this_thread::sleep_for(200ms);
  node.signal(SIGKILL);
  auto r = pending.get();
  auto waited = kiln::test::since(t0);
  REQUIRE_FALSE(r.has_value());
  CHECK(r.error().code == ErrorCode::peer_lost);
  CHECK(r.error().message.find("disconnected") != std::string::npos);
  CHECK(waited < 5s);  // reported at once, well inside the request's 10 s timeout
  // A request sent after the loss fails at once too, instead of waiting for its timeout.
  auto t1 = kiln::test::Clock::now();
  auto later = root.request(make_envelope(Ping{}, Kind::request, "t", "diag/0"), 30s).get();
  REQUIRE_FALSE(later.has_value());
  CHECK(later.error().code == ErrorCode::peer_lost);
  CHECK(later.error().message.find("disconnected earlier") != std::string::npos);
  CHECK(kiln::test::since(t1) < 2s);
}

TEST_CASE("a frozen peer (SIGSTOP) is detected by heartbeats, not waited on forever") {
  Gateway::Options o{"root", ipc("stop-root")};
  o.heartbeat_interval = 200ms;
  o.heartbeat_timeout = 1000ms;
  Gateway root(o);
  auto node = start_node("frozen", ipc("stop-node"), root.endpoint());
  REQUIRE(root.wait_for_actor("diag/0", 20s).has_value());
  REQUIRE(root.request(make_envelope(Ping{}, Kind::request, "t", "diag/0"), 5s).get().has_value());
  node.stop();
  auto t0 = kiln::test::Clock::now();
  auto r = root.request(make_envelope(Ping{}, Kind::request, "t", "diag/0"), 20s).get();
  auto waited = kiln::test::since(t0);
  REQUIRE_FALSE(r.has_value());
  CHECK(r.error().code == ErrorCode::peer_lost);
  CHECK(waited < 5s);
}

TEST_CASE("a node that cannot reach its root says so and exits with an error") {
  ChildProcess node({KILN_EXE, "node", "--name", "lonely", "--bind", ipc("lonely"), "--join", ipc("nobody-home"),
                     "--actor", "diag/0", "--join-timeout-ms", "500"});
  int status = node.wait();
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 2);
}

TEST_CASE("a node asked to host an unknown actor kind refuses by name") {
  ChildProcess node({KILN_EXE, "node", "--bind", ipc("bad-kind"), "--actor", "teleporter/0"});
  int status = node.wait();
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 2);
}

TEST_CASE("a node with a busy actor still stops soon after SIGTERM") {
  Gateway root({"root", ipc("busy-root")});
  auto node = start_node("busy", ipc("busy-node"), root.endpoint());
  REQUIRE(root.wait_for_actor("diag/0", 20s).has_value());
  auto pending = root.request(make_envelope(DiagSleep{60000}, Kind::request, "t", "diag/0"), 30s);
  std::this_thread::sleep_for(300ms);
  auto t0 = kiln::test::Clock::now();
  node.signal(SIGTERM);
  int status = node.wait();
  CHECK(kiln::test::since(t0) < 10s);
  CHECK(WIFEXITED(status));
}

TEST_CASE("malformed actor names are refused") {
  for (const char* bad : {"diag", "diag/x", "diag/0/1"}) {
    CAPTURE(bad);
    ChildProcess node({KILN_EXE, "node", "--bind", ipc("bad-name"), "--actor", bad});
    int status = node.wait();
    CHECK(WEXITSTATUS(status) == 2);
  }
  ChildProcess twice({KILN_EXE, "node", "--bind", ipc("twice"), "--actor", "diag/0", "--actor", "diag/0"});
  CHECK(WEXITSTATUS(twice.wait()) == 2);
}

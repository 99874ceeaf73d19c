// Weight sync over the messaging layer: buckets as tensor frames through two gateways
// (inproc: zero-copy), the commit's checksum check, and a corrupted tensor named.
#include <doctest/doctest.h>

#include <mutex>

#include "actors/weight_sync/service.hpp"
#include "messaging/schema.hpp"

using namespace kiln;
using namespace kiln::messaging;
using namespace std::chrono_literals;

namespace {
std::vector<Tensor> weights(int n) {
  std::vector<Tensor> ts;
  for (int i = 0; i < n; ++i) {
    auto t = Tensor::zeros("model.layers." + std::to_string(i / 2) + (i % 2 ? ".self_attn.q_a_proj.weight" : ".self_attn.kv_a_proj_with_mqa.weight"),
                           DType::bfloat16, {64, 32});
    for (std::size_t b = 0; b < t.nbytes; ++b) t.mutable_data()[b] = std::byte(uint8_t(i * 31 + b));
    ts.push_back(t);
  }
  return ts;
}

struct Host {
  static inline int counter = 0;
  Gateway rollout{{"rollout", "inproc://ws-test-" + std::to_string(++counter)}};
  Gateway trainer{{"trainer", ""}};
  std::mutex mu;
  std::vector<Tensor> applied;
  int64_t applied_version = -1;
  std::shared_ptr<weight_sync::ReceiverService> svc = std::make_shared<weight_sync::ReceiverService>(
      [this](std::vector<Tensor> t, int64_t v) {
        std::lock_guard<std::mutex> l(mu);
        applied = std::move(t);
        applied_version = v;
      });
  Host() {
    rollout.serve("weight_sync/0", [this](Envelope env) {
      auto r = svc->handle(env);
      if (r) rollout.reply(env, std::move(*r));
      else rollout.reply_error(env, r.error());
    });
    trainer.add_route("weight_sync/0", rollout.endpoint());
  }
};
}  // namespace

TEST_CASE("a version streams in buckets over ZeroMQ, zero-copy in one process, and is applied after the check") {
  Host h;
  auto ts = weights(6);
  auto r = weight_sync::send_weights(h.trainer, "weight_sync/0", ts, 3, 3 * 4096, 5s);
  REQUIRE_MESSAGE(r.has_value(), r.error().what());
  CHECK(*r == 6);
  std::lock_guard<std::mutex> l(h.mu);
  CHECK(h.applied_version == 3);
  REQUIRE(h.applied.size() == 6);
  for (const auto& t : h.applied) {
    auto it = std::find_if(ts.begin(), ts.end(), [&](const Tensor& s) { return s.name == t.name; });
    REQUIRE(it != ts.end());
    CHECK(t.data == it->data);  // inproc: the receiver holds the sender's bytes
  }
}

TEST_CASE("a tensor corrupted in transit fails the post-update check by name, and nothing is applied") {
  Host h;
  auto ts = weights(4);
  auto m = weight_sync::manifest(ts);
  auto buckets = weight_sync::plan_buckets(ts, 1 << 20, 9);
  REQUIRE(buckets.size() == 1);
  auto& victim = buckets[0].tensors[2];
  auto bad = Tensor::copy_of(victim.name, victim.dtype, victim.shape, victim.data, victim.nbytes);
  bad.mutable_data()[100] ^= std::byte(1);
  const std::string victim_name = victim.name;
  victim = bad;
  auto env = make_envelope(WeightSyncBucket{9, 0, 1}, Kind::request, "t", "weight_sync/0");
  env.tensors = buckets[0].tensors;
  REQUIRE(h.trainer.request(env, 5s).get().has_value());
  WeightSyncCommit commit{9, {}, {}};
  for (const auto& [name, crc] : m) {
    commit.names.push_back(name);
    commit.crc32.push_back(crc);
  }
  auto r = h.trainer.request(make_envelope(commit, Kind::request, "t", "weight_sync/0"), 5s).get();
  REQUIRE_FALSE(r.has_value());
  CHECK(r.error().message.find("'" + victim_name + "' (checksum differs)") != std::string::npos);
  std::lock_guard<std::mutex> l(h.mu);
  CHECK(h.applied_version == -1);
}

TEST_CASE("a commit before all buckets arrived is refused") {
  Host h;
  auto r = h.trainer.request(make_envelope(WeightSyncCommit{1, {}, {}}, Kind::request, "t", "weight_sync/0"), 5s).get();
  REQUIRE_FALSE(r.has_value());
  CHECK(r.error().message.find("before all its buckets arrived") != std::string::npos);
}

// The trainer actor (actors/trainer/trainer_service.hpp) driven through a gateway in one process:
// it builds the same seeded policy a one-process run builds, trains exactly as the Trainer
// class does, streams checked weights to a receiver, refuses bad input by name without
// touching its state, and writes checkpoints another trainer actor loads.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "actors/rollout/engine.hpp"
#include "actors/trainer/trainer.hpp"
#include "actors/trainer/trainer_service.hpp"
#include "actors/weight_sync/service.hpp"
#include "messaging/gateway.hpp"
#include "messaging/schema.hpp"
#include "messaging/torch_tensor.hpp"
#include "model/registry.hpp"
#include "tests/scratch.hpp"
#include "trainer_fixture.hpp"

using namespace kiln;
using namespace kiln::messaging;
using namespace std::chrono_literals;

namespace {
// A gateway hosting a trainer actor (trainer/0) and a weight-sync receiver (engine/0) that keeps
// the last version it verified.
struct Rig {
  Gateway gw{Gateway::Options{"trainer-test", ""}};
  std::shared_ptr<trainer::TrainerService> svc = std::make_shared<trainer::TrainerService>(gw, "trainer/0");
  std::mutex mu;
  std::vector<Tensor> received;
  int64_t received_version = -1;
  std::shared_ptr<weight_sync::ReceiverService> receiver =
      std::make_shared<weight_sync::ReceiverService>([this](std::vector<Tensor> t, int64_t v) {
        std::lock_guard<std::mutex> l(mu);
        received = std::move(t);
        received_version = v;
      });
  std::mutex workers_mu;
  std::vector<std::thread> workers;
  Rig() {
    // Off the gateway thread (handlers must not block it), as kiln node's detached actor does:
    // trainer.push_weights sends requests through this same gateway and waits for them.
    gw.serve("trainer/0", [this](Envelope env) {
      std::lock_guard<std::mutex> l(workers_mu);
      workers.emplace_back([this, env = std::move(env)] {
        auto r = svc->handle(env);
        if (r) gw.reply(env, std::move(*r));
        else gw.reply_error(env, r.error());
      });
    });
    gw.serve("engine/0", [this](Envelope env) {
      auto r = receiver->handle(env);
      if (r) gw.reply(env, std::move(*r));
      else gw.reply_error(env, r.error());
    });
  }
  ~Rig() {
    for (auto& w : workers) w.join();
  }
  template <class T>
  Expected<Envelope> ask(const T& msg, std::vector<Tensor> tensors = {}) {
    auto env = make_envelope(msg, Kind::request, "test", "trainer/0");
    env.tensors = std::move(tensors);
    return gw.request(std::move(env), 120s).get();
  }
};

TrainerInit debug_init(int64_t seed) {
  TrainerInit init;
  init.model.package = "glm4_moe_lite";
  init.model.flavor = "debug";
  init.seed = seed;
  init.trainer.lr = 5e-3;
  init.bucket_mib = 0.01;  // several buckets
  return init;
}

// Bitwise equality of two HF tensor sets (same names, same bytes; buckets may reorder them).
bool same_weights(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  if (a.size() != b.size()) return false;
  std::map<std::string, const Tensor*> by_name;
  for (const auto& t : b) by_name[t.name] = &t;
  for (const auto& t : a) {
    auto it = by_name.find(t.name);
    if (it == by_name.end() || it->second->nbytes != t.nbytes || std::memcmp(it->second->data, t.data, t.nbytes) != 0)
      return false;
  }
  return true;
}

// Completions of the debug policy with group-relative stand-in advantages.
std::vector<trainer::Sample> make_samples(std::shared_ptr<model::CausalLM> policy) {
  std::vector<rollout::GenerationRequest> reqs(6);
  for (int i = 0; i < 6; ++i) {
    reqs[std::size_t(i)].id = uint64_t(i);
    reqs[std::size_t(i)].prompt = {3, 4 + i % 3, 5};
    reqs[std::size_t(i)].sampling.max_new_tokens = 3;
    reqs[std::size_t(i)].sampling.seed = uint64_t(i);
  }
  return test::generate_samples(policy, reqs, 1.0f, -1.0f);
}

TrainerTrain to_message(const std::vector<trainer::Sample>& samples, std::vector<Tensor>& experts) {
  TrainerTrain q;
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const auto& s = samples[i];
    q.samples.push_back({uint64_t(i), s.prompt, s.completion, s.behavior_logprobs, s.ref_logprobs, s.advantage});
    experts.push_back(from_torch("routed_experts." + std::to_string(i), s.routed_experts.contiguous()));
  }
  return q;
}

std::string error_of(const Expected<Envelope>& r) { return r ? std::string("(no error)") : r.error().message; }
}  // namespace

TEST_CASE("trainer actor: the seeded policy, the Trainer's exact update, checked weight pushes, checkpoints") {
  Rig rig;
  auto early = rig.ask(TrainerPushWeights{{"engine/0"}});
  CHECK(error_of(early).find("trainer.push_weights before trainer.init") != std::string::npos);

  const auto init = debug_init(11);
  auto ready = rig.ask(init);
  REQUIRE_MESSAGE(ready.has_value(), error_of(ready));
  CHECK(payload_as<TrainerReady>(*ready)->policy_version == 0);

  // The same initial policy as a one-process run: manual_seed(seed), then the registry.
  torch::manual_seed(11);
  auto local = model::Registry::with_plugins().build("glm4_moe_lite", "debug", "");
  REQUIRE(rig.ask(TrainerPushWeights{{"engine/0"}}).has_value());
  CHECK(rig.received_version == 0);
  CHECK(same_weights(rig.received, local->hf_state_dict()));

  // One step through the actor == one step of the Trainer class on the same samples.
  auto samples = make_samples(local);
  trainer::Trainer direct(local, init.trainer);
  std::vector<Tensor> experts;
  auto q = to_message(samples, experts);
  auto stepped = rig.ask(q, experts);
  REQUIRE_MESSAGE(stepped.has_value(), error_of(stepped));
  auto got = payload_as<TrainerStepResult>(*stepped);
  REQUIRE(got.has_value());
  auto want = direct.train_step(samples);
  CHECK(got->policy_version == 1);
  CHECK(got->metrics.loss == want.loss);
  CHECK(got->metrics.grad_norm == want.grad_norm);
  CHECK(got->metrics.clip_fraction == want.clip_fraction);
  CHECK(got->metrics.tokens == want.tokens);
  CHECK(got->metrics.log_probs_time == 0);  // no separate pi_old pass unless asked
  REQUIRE(rig.ask(TrainerPushWeights{{"engine/0"}}).has_value());
  CHECK(rig.received_version == 1);
  CHECK(same_weights(rig.received, local->hf_state_dict()));

  SUBCASE("bad samples are refused by name and change nothing") {
    auto bad = q;
    bad.samples[2].behavior_logprobs.pop_back();
    CHECK(error_of(rig.ask(bad, experts)).find("sample 2 has 2 behaviour log-probs for 3 completion tokens") !=
          std::string::npos);
    bad = q;
    bad.samples[1].completion[0] = 1 << 20;
    CHECK(error_of(rig.ask(bad, experts)).find("sample 1 has token id 1048576 outside the vocabulary") !=
          std::string::npos);
    auto fewer = experts;
    fewer.pop_back();
    CHECK(error_of(rig.ask(q, fewer)).find("5 replay tensors for 6 samples (expected 0, 6 or 12)") != std::string::npos);
    auto wrong = experts;
    wrong[0] = from_torch("routed_experts.0", torch::zeros({2, 1, 1}, torch::kInt64));
    CHECK(error_of(rig.ask(q, wrong)).find("routed experts 'routed_experts.0' must be I64 [P + n - 1 = 5, L, K]") !=
          std::string::npos);
    CHECK(error_of(rig.ask(TrainerTrain{})).find("no samples") != std::string::npos);
    bad = q;
    bad.samples[4].advantage = std::nanf("");
    CHECK(error_of(rig.ask(bad, experts)).find("sample 4 has a non-finite advantage") != std::string::npos);
    bad = q;
    bad.samples[3].behavior_logprobs[1] = -INFINITY;
    CHECK(error_of(rig.ask(bad, experts)).find("sample 3 has a non-finite behaviour log-prob") != std::string::npos);
    REQUIRE(rig.ask(TrainerPushWeights{{"engine/0"}}).has_value());
    CHECK(rig.received_version == 1);
    CHECK(same_weights(rig.received, local->hf_state_dict()));
  }
  SUBCASE("a push to an unknown actor names it; the trainer keeps working") {
    auto r = rig.ask(TrainerPushWeights{{"engine/9"}});
    CHECK(error_of(r).find("weight sync of version 1 to engine/9") != std::string::npos);
    CHECK(rig.ask(q, experts).has_value());
  }
  SUBCASE("a checkpoint it writes loads into a fresh trainer actor: same weights, version and next update") {
    const auto dir = test::scratch_path("trainer-service-ck");
    REQUIRE(rig.ask(TrainerSave{dir, 1, "rng"}).has_value());
    Rig other;
    REQUIRE(other.ask(debug_init(99)).has_value());  // another seed: the load must replace it all
    auto loaded = other.ask(TrainerLoad{dir});
    REQUIRE_MESSAGE(loaded.has_value(), error_of(loaded));
    CHECK(payload_as<TrainerReady>(*loaded)->policy_version == 1);
    REQUIRE(other.ask(TrainerPushWeights{{"engine/0"}}).has_value());
    CHECK(same_weights(other.received, local->hf_state_dict()));
    auto a = rig.ask(q, experts), b = other.ask(q, experts);
    REQUIRE((a.has_value() && b.has_value()));
    CHECK(payload_as<TrainerStepResult>(*a)->metrics.loss == payload_as<TrainerStepResult>(*b)->metrics.loss);  // AdamW state too
    CHECK(payload_as<TrainerStepResult>(*a)->metrics.grad_norm == payload_as<TrainerStepResult>(*b)->metrics.grad_norm);
    CHECK(error_of(other.ask(TrainerLoad{test::scratch_path("no-such-checkpoint")})).find("no state.json") !=
          std::string::npos);
  }
}

TEST_CASE("trainer actor: bad settings are refused by name") {
  Rig rig;
  auto init = debug_init(1);
  init.trainer.lr = -1;
  CHECK(error_of(rig.ask(init)).find("trainer.init: trainer config: lr must be > 0") != std::string::npos);
  init = debug_init(1);
  init.model.dtype = "fp8";
  CHECK(error_of(rig.ask(init)).find("dtype must be fp32 or bf16, got 'fp8'") != std::string::npos);
  init = debug_init(1);
  init.trainer.loss.kl_estimator = "k9";
  CHECK(error_of(rig.ask(init)).find("trainer.init:") != std::string::npos);
  init = debug_init(1);
  init.model.package = "no_such_model";
  CHECK(error_of(rig.ask(init)).find("no_such_model") != std::string::npos);
  // Still usable after the refusals.
  CHECK(rig.ask(debug_init(1)).has_value());
  init = debug_init(1);
  init.trainer.loss.kl_coef = 0.1;  // the KL term needs the reference log-probs of every token
  REQUIRE(rig.ask(init).has_value());
  torch::manual_seed(1);
  auto samples = make_samples(model::Registry::with_plugins().build("glm4_moe_lite", "debug", ""));
  std::vector<Tensor> experts;
  auto q = to_message(samples, experts);
  CHECK(error_of(rig.ask(q, experts)).find("sample 0 has 0 reference log-probs for 3 completion tokens (the KL term") !=
        std::string::npos);
}

// The reference-logprob actor (actors/reference/ref_service.hpp) driven through a gateway in
// one process: refuses requests before its model and weights, loads the initial policy by
// weight sync, then answers exactly the log-probs the controller's own reference computes.
#include <doctest/doctest.h>

#include "actors/reference/ref_service.hpp"
#include "actors/rollout/engine.hpp"
#include "actors/trainer/trainer.hpp"
#include "actors/weight_sync/service.hpp"
#include "actors/reference/messages.hpp"
#include "messaging/torch_tensor.hpp"
#include "model/glm4_moe_lite/model.hpp"

using namespace kiln;
using namespace kiln::messaging;
using namespace std::chrono_literals;

TEST_CASE("reference actor: refuses early requests, loads weights by sync, answers the controller's log-probs") {
  Gateway gw({"ref-test", ""});
  auto svc = std::make_shared<reference::RefService>();
  gw.serve("ref/0", [&gw, svc](Envelope env) {
    auto r = svc->handle(env);
    if (r) gw.reply(env, std::move(*r));
    else gw.reply_error(env, r.error());
  });
  torch::manual_seed(5);
  auto policy = std::make_shared<model::glm4_moe_lite::Glm4MoeLiteModel>(model::glm4_moe_lite::flavors::debug());
  rollout::Engine engine(policy, rollout::EngineOptions{});
  std::vector<rollout::GenerationRequest> reqs(4);
  for (int i = 0; i < 4; ++i) {
    reqs[std::size_t(i)].id = uint64_t(i);
    reqs[std::size_t(i)].prompt = {3, 4 + i, 5};
    reqs[std::size_t(i)].sampling.max_new_tokens = 3;
    reqs[std::size_t(i)].sampling.seed = uint64_t(i);
  }
  auto completions = engine.generate(reqs);
  RefLogprobs q;
  std::vector<Tensor> experts;
  for (const auto& c : completions) {
    q.samples.push_back({c.id, c.prompt, c.tokens});
    experts.push_back(from_torch("routed_experts." + std::to_string(c.id), c.routed_experts.contiguous()));
  }
  auto ask = [&](std::vector<Tensor> tensors) {
    auto env = make_envelope(q, Kind::request, "test", "ref/0");
    env.tensors = std::move(tensors);
    return gw.request(std::move(env), 30s).get();
  };
  auto early = ask(experts);
  REQUIRE_FALSE(early.has_value());
  CHECK(early.error().message.find("before ref.init") != std::string::npos);
  RefInit init{{"glm4_moe_lite", "debug", ""}, {4096, true, 1.0}};
  REQUIRE(gw.request(make_envelope(init, Kind::request, "test", "ref/0"), 60s).get().has_value());
  auto no_weights = ask(experts);
  REQUIRE_FALSE(no_weights.has_value());
  CHECK(no_weights.error().message.find("before the reference weights arrived") != std::string::npos);
  REQUIRE(weight_sync::send_weights(gw, "ref/0", policy->hf_state_dict(), 0, 1 << 14, 30s).has_value());
  auto r = ask(experts);
  REQUIRE(r.has_value());
  auto got = payload_as<RefLogprobsResult>(*r);
  REQUIRE(got.has_value());
  std::vector<trainer::Sample> samples(completions.size());
  for (std::size_t i = 0; i < samples.size(); ++i) {
    samples[i].prompt = completions[i].prompt;
    samples[i].completion = completions[i].tokens;
    samples[i].routed_experts = completions[i].routed_experts;
  }
  auto want = trainer::completion_logprobs(*policy, samples, 4096, true);
  CHECK(got->logprobs == want);
  experts.pop_back();  // one routed-experts tensor short
  auto bad = ask(experts);
  REQUIRE_FALSE(bad.has_value());
  CHECK(bad.error().message.find("3 replay tensors for 4 samples (expected 0, 4 or 8)") != std::string::npos);
}

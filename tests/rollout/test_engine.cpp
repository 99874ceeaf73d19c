// The in-process rollout engine: exact behaviour log-probs and routed experts against the
// packed forward, cache vs full recompute, seeds, temperature, stops, the cache bound,
// cancelled requests, and weight updates between decode steps.
#include <doctest/doctest.h>

#include <limits>
#include <map>

#include "actors/rollout/engine.hpp"
#include "model/blocks/logprobs.hpp"
#include "model/glm4_moe_lite/model.hpp"
#include "model/glm4_moe_lite/state_dict_adapter.hpp"

using namespace kiln;
using namespace kiln::rollout;

namespace {
std::shared_ptr<model::glm4_moe_lite::Glm4MoeLiteModel> debug_model(uint64_t seed = 7) {
  torch::manual_seed(seed);
  auto m = std::make_shared<model::glm4_moe_lite::Glm4MoeLiteModel>(model::glm4_moe_lite::flavors::debug());
  // Sharper routing and logits than the 0.02 init, so that choices and samples are not ties.
  torch::NoGradGuard g;
  for (auto& p : m->named_parameters())
    if (p.key().find("router.weight") != std::string::npos || p.key() == "lm_head.weight") p.value().mul_(25.0);
  return m;
}

GenerationRequest request(uint64_t id, std::vector<int64_t> prompt, int64_t max_new, double temperature = 1.0,
                          uint64_t seed = 0) {
  GenerationRequest r;
  r.id = id;
  r.prompt = std::move(prompt);
  r.sampling.max_new_tokens = max_new;
  r.sampling.temperature = temperature;
  r.sampling.seed = seed;
  return r;
}

// A cache of `blocks` pages of 4 tokens, 8 sequences at once.
EngineOptions cache_of(int64_t blocks) {
  EngineOptions o;
  o.cache_blocks = blocks;
  o.block_size = 4;
  o.max_batch = 8;
  return o;
}

EngineOptions small_cache() { return cache_of(64); }
}  // namespace

TEST_CASE("sampled tokens' log-probs and routed experts equal the packed forward's (fp32)") {
  auto m = debug_model();
  Engine engine(m, small_cache());
  auto done = engine.generate({request(1, {5, 9, 13, 2}, 12, 1.0, 11), request(2, {40, 41}, 9, 1.0, 12),
                               request(3, {7, 8, 9, 10, 11, 12, 13}, 15, 1.0, 13)});
  REQUIRE(done.size() == 3);
  for (const auto& c : done) {
    CAPTURE(c.id);
    std::vector<int64_t> seq = c.prompt;
    seq.insert(seq.end(), c.tokens.begin(), c.tokens.end());
    auto batch = model::PackedBatch::from_documents({seq});
    model::ForwardOptions opts;
    opts.return_routed_experts = true;
    torch::NoGradGuard g;
    auto out = m->forward(batch, opts);
    auto lp = m->token_logprobs(out, model::next_token_targets(batch.input_ids, batch.cu_seqlens));
    const int64_t P = int64_t(c.prompt.size()), n = int64_t(c.tokens.size());
    double worst = 0;
    for (int64_t i = 0; i < n; ++i) worst = std::max(worst, std::abs(double(lp[P - 1 + i].item<float>()) - c.logprobs[i]));
    MESSAGE("request " << c.id << ": max |rollout - packed forward| log-prob = " << worst);
    CHECK(worst <= 1e-5);
    REQUIRE(c.routed_experts.size(0) == P + n - 1);
    CHECK(torch::equal(c.routed_experts, out.routed_experts.narrow(0, 0, P + n - 1)));
  }
}

TEST_CASE("greedy decoding with the cache equals full recomputation, with requests joining and leaving") {
  auto m = debug_model(3);
  Engine engine(m, small_cache());
  std::vector<GenerationRequest> all = {request(1, {3, 4, 5}, 6, 0.0), request(2, {9, 9, 9, 9, 9}, 14, 0.0),
                                        request(3, {17}, 3, 0.0), request(4, {21, 22, 23, 24}, 10, 0.0)};
  engine.submit(all[0]);
  engine.submit(all[1]);
  std::vector<Completion> done;
  for (int i = 0; i < 3; ++i)
    for (auto& c : engine.step()) done.push_back(c);
  engine.submit(all[2]);  // joins while 1 and 2 are decoding
  for (int i = 0; i < 2; ++i)
    for (auto& c : engine.step()) done.push_back(c);
  engine.submit(all[3]);
  while (engine.has_work())
    for (auto& c : engine.step()) done.push_back(c);
  REQUIRE(done.size() == 4);
  CHECK(done.back().id != 3);  // the shortest leaves before the long ones although it joined later
  auto ref = generate_without_cache(*m, all);
  for (const auto& c : done) {
    CAPTURE(c.id);
    CHECK(c.tokens == ref[c.id - 1].tokens);
    CHECK(torch::equal(c.routed_experts, ref[c.id - 1].routed_experts));
  }
}

TEST_CASE("a fixed seed gives the same samples twice, whatever else is in the batch") {
  auto m = debug_model();
  auto r = request(1, {3, 4, 5}, 20, 1.0, 1234);
  Engine a(m, small_cache());
  auto first = a.generate({r});
  Engine b(m, small_cache());
  auto second = b.generate({request(9, {30, 31}, 7, 1.0, 5), r, request(8, {1, 2, 3, 4}, 12, 1.0, 6)});
  const Completion* again = nullptr;
  for (const auto& c : second)
    if (c.id == 1) again = &c;
  REQUIRE(again);
  CHECK(first[0].tokens == again->tokens);
  // Log-probs agree up to float rounding (batched GEMMs of another shape sum in another order).
  for (std::size_t i = 0; i < first[0].logprobs.size(); ++i)
    CHECK(first[0].logprobs[i] == doctest::Approx(again->logprobs[i]).epsilon(1e-5));
  auto other = Engine(m, small_cache()).generate({request(1, {3, 4, 5}, 20, 1.0, 999)});
  CHECK(other[0].tokens != first[0].tokens);
}

TEST_CASE("temperature is applied to the logits and the log-prob follows it") {
  auto logits = torch::tensor({2.0f, 1.0f, 0.0f});
  SamplingParams p;
  p.temperature = 0.5;
  p.top_k = 1;  // forces token 0; the log-prob stays the untruncated tempered one
  auto t = sample_token(logits, p, 0);
  CHECK(t.token == 0);
  CHECK(t.logprob == doctest::Approx(-0.1429).epsilon(1e-3));  // not -0.4076 (T=1) nor -0.8152
  // entropy of softmax([4, 2, 0])
  auto q = torch::softmax(torch::tensor({4.0f, 2.0f, 0.0f}), 0);
  CHECK(t.entropy == doctest::Approx(-(q * q.log()).sum().item<float>()).epsilon(1e-5));
  p.temperature = 0;  // greedy: T = 1 log-prob
  CHECK(sample_token(logits, p, 1).logprob == doctest::Approx(-0.4076).epsilon(1e-3));
  p.temperature = 1.0;
  p.top_k = 0;
  p.top_p = 0.5;  // only token 0 (p = 0.665) survives
  for (int i = 0; i < 20; ++i) CHECK(sample_token(logits, p, i).token == 0);
  p.top_p = 1.5;
  CHECK_THROWS_AS(p.validate(), std::invalid_argument);
}

TEST_CASE("stops: any of several end ids finishes with 'stop' and keeps the token, and max_new_tokens gives 'length'") {
  auto m = debug_model(5);
  auto greedy = Engine(m, small_cache()).generate({request(1, {3, 4, 5}, 10, 0.0)})[0];
  REQUIRE(greedy.tokens.size() == 10);
  CHECK(greedy.finish_reason == FinishReason::length);
  const int64_t end = greedy.tokens[3];
  auto r = request(1, {3, 4, 5}, 10, 0.0);
  r.sampling.stop_token_ids = {95, end, 94};  // GLM models have several end ids
  auto stopped = Engine(m, small_cache()).generate({r})[0];
  auto first = std::find(greedy.tokens.begin(), greedy.tokens.end(), end) - greedy.tokens.begin();
  CHECK(stopped.finish_reason == FinishReason::stop);
  CHECK(int64_t(stopped.tokens.size()) == first + 1);
  CHECK(stopped.tokens.back() == end);  // kept: it is in the loss mask
  CHECK(stopped.logprobs.size() == stopped.tokens.size());
  auto s = request(1, {3, 4, 5}, 10, 0.0);
  s.sampling.stop_sequences = {{greedy.tokens[5], greedy.tokens[6]}};
  auto seq_stopped = Engine(m, small_cache()).generate({s})[0];
  CHECK(seq_stopped.finish_reason == FinishReason::stop);
  CHECK(seq_stopped.tokens.size() <= 7);
}

TEST_CASE("the cache bound queues requests, and a request that can never fit is refused by name") {
  auto m = debug_model();
  Engine engine(m, cache_of(4));
  // Each needs ceil((3 + 5) / 4) = 2 pages: two run, two wait.
  for (uint64_t i = 1; i <= 4; ++i) engine.submit(request(i, {3, 4, 5}, 5));
  engine.step();
  CHECK(engine.running() == 2);
  CHECK(engine.waiting() == 2);
  CHECK(engine.free_blocks() == 0);
  std::vector<Completion> done;
  while (engine.has_work())
    for (auto& c : engine.step()) done.push_back(c);
  CHECK(done.size() == 4);
  CHECK(engine.free_blocks() == 4);
  CHECK_THROWS_WITH_AS(engine.submit(request(9, std::vector<int64_t>(10, 3), 10)),
                       doctest::Contains("prompt 10 + max_new_tokens 10 tokens do not fit the whole cache"),
                       std::invalid_argument);
  // A max_new_tokens whose sum with the prompt overflows int64 (it once passed, and the sequence
  // ran with no pages: a segfault).
  for (int64_t m : {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max() - 2})
    CHECK_THROWS_WITH_AS(engine.submit(request(12, {3, 4, 5}, m)), doctest::Contains("do not fit the whole cache"),
                         std::invalid_argument);
  CHECK(engine.waiting() == 0);
  // max_batch past the pages: as many sequences decode as there are pages (rollout.max_batch =
  // 2^63 - 1 once filled host memory with slots before failing on std::bad_alloc).
  auto huge = cache_of(4);
  huge.max_batch = std::numeric_limits<int64_t>::max();
  CHECK(decode_slots(huge) == 4);
  CHECK(Engine(m, huge).options().max_batch == 4);
  CHECK_THROWS_WITH_AS(engine.submit(request(10, {}, 4)), doctest::Contains("empty prompt"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(engine.submit(request(11, {3, 4000}, 4)), doctest::Contains("outside the vocabulary"),
                       std::invalid_argument);
}

TEST_CASE("a cancelled request frees its pages and never finishes, and progress shows a running one's tokens") {
  auto m = debug_model();
  Engine engine(m, cache_of(4));
  for (uint64_t i = 1; i <= 3; ++i) engine.submit(request(i, {3, 4, 5}, 5));  // 2 pages each: two run, one waits
  engine.step();
  engine.step();
  REQUIRE(engine.progress(1) != nullptr);
  CHECK(engine.progress(1)->tokens.size() == 2);
  CHECK(engine.progress(3) == nullptr);  // waiting
  CHECK(engine.cancel(1));               // running: its pages are free again
  CHECK(engine.free_blocks() == 2);
  CHECK(engine.cancel(3));  // waiting
  CHECK_FALSE(engine.cancel(3));
  CHECK(engine.running() == 1);
  CHECK(engine.waiting() == 0);
  std::vector<uint64_t> done;
  while (engine.has_work())
    for (auto& c : engine.step()) done.push_back(c.id);
  CHECK(done == std::vector<uint64_t>{2});
  CHECK(engine.free_blocks() == 4);
}

TEST_CASE("weights are updated between decode steps, and tokens carry the version that made them") {
  auto m = debug_model(1);
  Engine engine(m, small_cache());
  engine.submit(request(1, {3, 4, 5}, 8, 0.0));
  engine.step();
  engine.step();
  auto other = debug_model(2);
  auto weights = model::glm4_moe_lite::to_hf_state_dict(*other);
  CHECK_THROWS_AS(engine.update_weights(weights, 1), std::logic_error);  // not paused
  engine.pause();
  CHECK(engine.step().empty());  // paused: no progress
  engine.update_weights(weights, 1);
  engine.resume();
  std::vector<Completion> done;
  while (engine.has_work())
    for (auto& c : engine.step()) done.push_back(c);
  REQUIRE(done.size() == 1);
  CHECK(done[0].policy_versions == std::vector<int64_t>{0, 0, 1, 1, 1, 1, 1, 1});
  CHECK(engine.policy_version() == 1);
  // New requests now decode with the new weights.
  auto fresh = engine.generate({request(2, {3, 4, 5}, 6, 0.0)})[0];
  auto ref = Engine(other, small_cache()).generate({request(2, {3, 4, 5}, 6, 0.0)})[0];
  CHECK(fresh.tokens == ref.tokens);
}

namespace {
// Completions by request id.
std::map<uint64_t, Completion> by_id(std::vector<Completion> v) {
  std::map<uint64_t, Completion> out;
  for (auto& c : v) out[c.id] = std::move(c);
  return out;
}

void check_same_outputs(const std::map<uint64_t, Completion>& got, const std::map<uint64_t, Completion>& want) {
  REQUIRE(got.size() == want.size());
  for (const auto& [id, w] : want) {
    const auto& g = got.at(id);
    CHECK_MESSAGE(g.tokens == w.tokens, "request " << id);
    REQUIRE(g.logprobs.size() == w.logprobs.size());
    for (std::size_t i = 0; i < w.logprobs.size(); ++i) CHECK(g.logprobs[i] == doctest::Approx(w.logprobs[i]).epsilon(1e-5));
    CHECK(torch::equal(g.routed_experts, w.routed_experts));
  }
}
}  // namespace

TEST_CASE("a GRPO group of 8 samples of a 2048-token prompt prefills it once, and the outputs equal the unshared run's") {
  auto m = debug_model();
  std::vector<int64_t> prompt;
  for (int64_t i = 0; i < 2048; ++i) prompt.push_back(3 + (i * 7919) % (m->vocab_size() - 3));
  prompt.push_back(5);  // 2049 tokens: the last page is partial (copied per sample)
  std::vector<GenerationRequest> group;
  for (uint64_t i = 0; i < 8; ++i) group.push_back(request(i, prompt, 12, 1.0, 100 + i));
  EngineOptions o;
  o.cache_blocks = 8 * 130 + 8;
  o.block_size = 16;
  o.max_batch = 8;
  o.max_prefill_tokens = 4 * 2049;
  o.share_prompts = false;
  Engine unshared(m, o);
  const auto want = by_id(unshared.generate(group));
  CHECK(unshared.prefilled_tokens() == 8 * 2049);
  CHECK(unshared.shared_prompts() == 0);
  o.share_prompts = true;
  Engine shared(m, o);
  const auto got = by_id(shared.generate(group));
  CHECK(shared.prefilled_tokens() == 2049);  // once
  CHECK(shared.shared_prompts() == 7);
  check_same_outputs(got, want);
  CHECK(shared.free_blocks() == o.cache_blocks);  // every shared page freed once, by its last holder
  // The samples differ from each other (their own seeds), or sharing would prove little.
  CHECK(got.at(0).tokens != got.at(1).tokens);
}

TEST_CASE("a group split over steps shares the prompt of a running sequence and a weight update stops the sharing") {
  auto m = debug_model();
  std::vector<int64_t> prompt{3, 4, 5, 6, 7, 8, 9};  // 7 tokens: one full page of 4, one partial
  EngineOptions o = small_cache();
  o.max_batch = 2;  // 2 at a time: the later ones join while the first decode
  std::vector<GenerationRequest> group;
  for (uint64_t i = 0; i < 5; ++i) group.push_back(request(i, prompt, 6 + int64_t(i), 1.0, 7 + i));
  o.share_prompts = false;
  const auto want = by_id(Engine(m, o).generate(group));
  o.share_prompts = true;
  Engine shared(m, o);
  const auto got = by_id(shared.generate(group));
  CHECK(shared.prefilled_tokens() == 7);
  CHECK(shared.shared_prompts() == 4);
  check_same_outputs(got, want);
  CHECK(shared.free_blocks() == o.cache_blocks);

  // The holder of a shared prompt cancelled mid-run: the others finish, every page is freed once.
  {
    Engine e(m, o);
    for (auto r : group) e.submit(r);
    (void)e.step();
    (void)e.step();
    REQUIRE(e.cancel(0));
    std::vector<Completion> rest;
    while (e.has_work())
      for (auto& c : e.step()) rest.push_back(std::move(c));
    CHECK(rest.size() == group.size() - 1);
    CHECK(e.free_blocks() == o.cache_blocks);
  }

  // After a weight update the cached prompt is of the old weights: the next request prefills.
  Engine e(m, o);
  e.submit(request(1, prompt, 20, 1.0, 1));
  (void)e.step();  // prefilled at version 0, decoding
  e.pause();
  e.update_weights(m->hf_state_dict(), 1);
  e.resume();
  e.submit(request(2, prompt, 4, 1.0, 2));
  while (e.has_work()) (void)e.step();
  CHECK(e.prefilled_tokens() == 14);
  CHECK(e.shared_prompts() == 0);
  CHECK(e.free_blocks() == o.cache_blocks);
}

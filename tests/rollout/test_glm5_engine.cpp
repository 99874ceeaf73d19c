// The in-process rollout engine on glm5_next (the debug flavor through the registry): its
// decode cache (KDA states in slots, sparse layers' latents and indexer key entries in pages)
// gives the packed forward's log-probs, expert and indexer choices; sequences joining and
// leaving mid-decode, and prompts shared in a group, do not change anyone's output.
#include <doctest/doctest.h>

#include <map>

#include "actors/rollout/engine.hpp"
#include "model/blocks/logprobs.hpp"
#include "model/registry.hpp"

using namespace kiln;
using namespace kiln::rollout;

namespace {
std::shared_ptr<model::CausalLM> glm5_debug(uint64_t seed) {
  torch::manual_seed(int64_t(seed));
  auto m = model::Registry::with_builtins().build(model::ModelSpec{"glm5_next", "debug", "", "cpu", "fp32"});
  // Sharper routing and logits than the 0.02 init, so that choices and samples are not ties.
  torch::NoGradGuard g;
  for (auto& p : m->named_parameters())
    if (p.key().find("router.weight") != std::string::npos || p.key() == "lm_head.weight") p.value().mul_(25.0);
  return m;
}

GenerationRequest request(uint64_t id, std::vector<int64_t> prompt, int64_t max_new, double temperature, uint64_t seed) {
  GenerationRequest r;
  r.id = id;
  r.prompt = std::move(prompt);
  r.sampling.max_new_tokens = max_new;
  r.sampling.temperature = temperature;
  r.sampling.seed = seed;
  return r;
}

// Pages of 4 tokens (a prompt and its decode span several), `batch` sequences at once.
EngineOptions options(int64_t batch, bool share_prompts = false) {
  EngineOptions o;
  o.cache_blocks = 64;
  o.block_size = 4;
  o.max_batch = batch;
  o.share_prompts = share_prompts;
  return o;
}

std::map<uint64_t, Completion> by_id(std::vector<Completion> cs) {
  std::map<uint64_t, Completion> m;
  for (auto& c : cs) m[c.id] = std::move(c);
  return m;
}

// Each query's selected positions, sorted: a selection is a set.
torch::Tensor as_sets(const torch::Tensor& t) { return std::get<0>(t.sort(-1)); }

// Same tokens; log-probs within 1e-5; the same expert and indexer choices.
void check_same(const Completion& a, const Completion& b) {
  CAPTURE(a.id);
  CHECK(a.tokens == b.tokens);
  REQUIRE(a.logprobs.size() == b.logprobs.size());
  for (std::size_t i = 0; i < a.logprobs.size(); ++i) CHECK(std::abs(a.logprobs[i] - b.logprobs[i]) <= 1e-5);
  CHECK(torch::equal(a.routed_experts, b.routed_experts));
  CHECK(torch::equal(as_sets(a.topk_indices), as_sets(b.topk_indices)));
}
}  // namespace

TEST_CASE("glm5_next engine: log-probs, routed experts and indexer selections of sequences of different lengths decoded together equal the packed forward's (fp32)") {
  auto m = glm5_debug(5);
  Engine engine(m, options(8));
  // Prompts of 1 to 11 tokens, 6 to 14 new ones: past the indexer's top-k (4 tokens, pools of
  // 2) and across pages of 4, the shorter ones leaving while the longer ones decode.
  auto done = engine.generate({request(1, {5, 9, 13, 2}, 12, 1.0, 11), request(2, {40}, 9, 1.0, 12),
                               request(3, {7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17}, 14, 1.0, 13),
                               request(4, {60, 61, 62}, 6, 1.0, 14)});
  REQUIRE(done.size() == 4);
  for (const auto& c : done) {
    CAPTURE(c.id);
    std::vector<int64_t> seq = c.prompt;
    seq.insert(seq.end(), c.tokens.begin(), c.tokens.end());
    auto batch = model::PackedBatch::from_documents({seq});
    model::ForwardOptions opts;
    opts.return_routed_experts = true;
    opts.return_topk_indices = true;
    torch::NoGradGuard g;
    auto out = m->forward(batch, opts);
    auto lp = m->token_logprobs(out, model::next_token_targets(batch.input_ids, batch.cu_seqlens));
    const int64_t P = int64_t(c.prompt.size()), n = int64_t(c.tokens.size());
    double worst = 0;
    for (int64_t i = 0; i < n; ++i) worst = std::max(worst, std::abs(double(lp[P - 1 + i].item<float>()) - c.logprobs[i]));
    MESSAGE("request " << c.id << " (" << P << " + " << n << " tokens): max |rollout - packed forward| log-prob = " << worst);
    CHECK(worst <= 1e-5);
    REQUIRE(c.routed_experts.size(0) == P + n - 1);
    CHECK(torch::equal(c.routed_experts, out.routed_experts.narrow(0, 0, P + n - 1)));
    REQUIRE(c.topk_indices.defined());
    REQUIRE(c.topk_indices.sizes() == torch::IntArrayRef({P + n - 1, 2, 5}));  // 2 sparse layers, W = 4 + 1
    CHECK(torch::equal(as_sets(c.topk_indices), as_sets(out.topk_indices.narrow(0, 0, P + n - 1))));
  }
  // The reference generation without a cache (the packed forward each step) samples the same.
  auto ref = by_id(generate_without_cache(*m, {request(1, {5, 9, 13, 2}, 12, 1.0, 11), request(2, {40}, 9, 1.0, 12),
                                               request(3, {7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17}, 14, 1.0, 13),
                                               request(4, {60, 61, 62}, 6, 1.0, 14)}));
  for (const auto& c : done) check_same(c, ref.at(c.id));
}

TEST_CASE("glm5_next engine: sequences joining and leaving mid-decode do not disturb each other") {
  auto m = glm5_debug(8);
  std::vector<GenerationRequest> all = {request(1, {3, 4, 5}, 7, 1.0, 21), request(2, {9, 9, 9, 9, 9}, 14, 1.0, 22),
                                        request(3, {17}, 3, 1.0, 23), request(4, {21, 22, 23, 24, 25, 26}, 10, 1.0, 24),
                                        request(5, {30, 31}, 5, 1.0, 25)};
  // Each alone in an engine of its own.
  std::map<uint64_t, Completion> alone;
  for (const auto& r : all) {
    Engine e(m, options(1));
    alone[r.id] = e.generate({r}).front();
  }
  // Together, 3 slots: 1 and 2 start, 3 joins while they decode, 4 and 5 wait for slots that
  // finished sequences free (their slots are reused).
  Engine engine(m, options(3));
  engine.submit(all[0]);
  engine.submit(all[1]);
  std::vector<Completion> done;
  for (int i = 0; i < 3; ++i)
    for (auto& c : engine.step()) done.push_back(c);
  engine.submit(all[2]);
  for (int i = 0; i < 2; ++i)
    for (auto& c : engine.step()) done.push_back(c);
  engine.submit(all[3]);
  engine.submit(all[4]);
  CHECK(engine.waiting() >= 1);  // no slot for one of them yet
  while (engine.has_work())
    for (auto& c : engine.step()) done.push_back(c);
  REQUIRE(done.size() == 5);
  CHECK(done.back().id != 3);  // the shortest leaves before the long ones although it joined later
  for (const auto& c : done) check_same(c, alone.at(c.id));
}

TEST_CASE("glm5_next engine: a shared prompt copies the holder's KDA states and the outputs equal the unshared run's") {
  auto m = glm5_debug(9);
  std::vector<GenerationRequest> group;
  for (uint64_t i = 0; i < 4; ++i) group.push_back(request(10 + i, {5, 6, 7, 8, 9, 10, 11}, 8, 1.0, 100 + i));
  Engine unshared(m, options(8, false)), shared(m, options(8, true));
  auto a = by_id(unshared.generate(group));
  auto b = by_id(shared.generate(group));
  CHECK(shared.shared_prompts() == 3);
  CHECK(shared.prefilled_tokens() == 7);
  for (const auto& [id, c] : a) check_same(b.at(id), c);
  // Split over two steps the second half cannot share: the first half's states moved on.
  Engine later(m, options(8, true));
  later.submit(group[0]);
  later.submit(group[1]);
  std::vector<Completion> done;
  for (auto& c : later.step()) done.push_back(c);
  later.submit(group[2]);
  later.submit(group[3]);
  while (later.has_work())
    for (auto& c : later.step()) done.push_back(c);
  CHECK(later.shared_prompts() == 2);  // 2 shares 1's; 4 shares 3's prefill (same step)
  for (const auto& c : done) check_same(c, a.at(c.id));
}

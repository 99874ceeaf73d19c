// One rank of the lockstep rollout test (tests/parallel/run_workers.py WORKER run --world W --
// CASE EP starts W of them on 127.0.0.1). The world is a "dp" x "ep" mesh (dp = W / EP). Every
// rank builds the seeded debug model (8 experts, top-2, 2 MoE layers) twice: whole, for a
// one-rank engine (the reference, run on every rank over all requests), and expert-parallel
// over its ep group (each rank 8/EP experts), for the engine under test, which generates only
// this rank's share of the requests (rollout::generate_in_lockstep; rank r of the world gets
// 3r requests, so world rank 0 has none and idles from the start). Requests have random
// prompts of 2-9 tokens, max_new_tokens 1-12 and a stop id, so the ranks run out of work at
// different steps. Checks, for this rank's share:
//   - the same completion ids; tokens, finish reasons and routed experts equal the one-rank
//     engine's; log-probs within 1e-5 (fp32: an expert's rows are summed in another grouping);
//   - the engine's forwards: a rank with no requests ran none (it only served the others).
// Cases:
//   plain          the default engine options
//   max_batch      max_batch 2: ranks with more requests take more steps (the others idle)
//   share_prompts  share_prompts on, requests in groups of 4 with equal prompts: steps that take
//                  only shared prompts run no forward on that rank
//   refusal        the last rank's share holds a token outside the vocabulary: every rank of
//                  its ep group throws std::invalid_argument (the refusing rank naming the token, the others
//                  the group), nothing is generated, and a second call with valid requests
//                  then runs as in plain
//   colocated      rollout::ColocatedEngine (the engine over the rank's own policy, the
//                  completions at the version given)
// Prints "rank R: X of Y checks passed"; exit 0 when every check passed, 1 otherwise.
#include <algorithm>
#include <iostream>
#include <map>
#include <random>
#include <string>

#include "actors/rollout/lockstep.hpp"
#include "model/glm4_moe_lite/model.hpp"
#include "parallel/process_group.hpp"
#include "../trainer/rank_checks.hpp"

using namespace kiln;
using namespace kiln::rollout;
using namespace kiln::test::rank_checks;

namespace {

std::shared_ptr<model::glm4_moe_lite::Glm4MoeLiteModel> debug_model() {
  torch::manual_seed(7);
  return std::make_shared<model::glm4_moe_lite::Glm4MoeLiteModel>(model::glm4_moe_lite::flavors::debug());
}

// The requests of every world rank, the same on every rank: rank r's are shares[r] (3r of them).
std::vector<std::vector<GenerationRequest>> make_shares(int world, int64_t vocab, int group) {
  std::mt19937_64 rng(2024);
  auto integer = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  std::vector<std::vector<GenerationRequest>> shares(static_cast<std::size_t>(world));
  uint64_t id = 0;
  for (int r = 0; r < world; ++r)
    for (int k = 0; k < 3 * r; ++k) {
      GenerationRequest q;
      q.id = id++;
      if (k % group == 0 || shares[std::size_t(r)].empty())
        for (int64_t n = integer(2, 9); n > 0; --n) q.prompt.push_back(integer(2, vocab - 1));
      else
        q.prompt = shares[std::size_t(r)].back().prompt;  // a group: the same prompt
      q.sampling.max_new_tokens = integer(1, 12);
      q.sampling.seed = 1000 + q.id;
      q.sampling.stop_token_ids = {integer(2, vocab - 1)};
      shares[std::size_t(r)].push_back(std::move(q));
    }
  return shares;
}

void compare(const std::vector<Completion>& got, const std::map<uint64_t, Completion>& want,
             const std::vector<GenerationRequest>& asked, const std::string& at) {
  expect(got.size() == asked.size(), at + ": " + std::to_string(got.size()) + " completions for " +
                                         std::to_string(asked.size()) + " requests");
  for (const auto& c : got) {
    const std::string who = at + ": request " + std::to_string(c.id);
    auto it = want.find(c.id);
    expect(it != want.end() && std::any_of(asked.begin(), asked.end(), [&](const auto& q) { return q.id == c.id; }),
           who + " was not asked of this rank");
    if (it == want.end()) continue;
    const auto& w = it->second;
    expect(c.tokens == w.tokens, who + ": tokens differ from the one-rank engine's");
    expect(c.finish_reason == w.finish_reason, who + ": finish reason differs");
    expect(c.routed_experts.defined() && torch::equal(c.routed_experts, w.routed_experts),
           who + ": routed experts differ");
    if (c.logprobs.size() != w.logprobs.size()) continue;
    double worst = 0;
    for (std::size_t i = 0; i < c.logprobs.size(); ++i) worst = std::max(worst, double(std::abs(c.logprobs[i] - w.logprobs[i])));
    expect(worst <= 1e-5, who + ": log-prob differs by " + std::to_string(worst));
  }
}

void run_case(parallel::ProcessGroups& groups, const std::string& name) {
  const int world = groups.world().size(), me = groups.world().rank();
  EngineOptions options;
  if (name == "max_batch") options.max_batch = 2;
  if (name == "share_prompts") options.share_prompts = true;
  auto whole = debug_model();
  auto sliced = debug_model();
  sliced->set_expert_parallel(&groups.along("ep"));
  auto shares = make_shares(world, whole->vocab_size(), name == "share_prompts" ? 4 : 1);
  const auto mine = shares[std::size_t(me)];

  std::map<uint64_t, Completion> want;  // the one-rank engine over every rank's requests
  {
    Engine one(whole, options);
    std::vector<GenerationRequest> all;
    for (const auto& s : shares) all.insert(all.end(), s.begin(), s.end());
    for (auto& c : one.generate(all)) want[c.id] = std::move(c);
  }
  const std::string at = "rank " + std::to_string(me) + " " + name;
  if (name == "colocated") {
    ColocatedEngine engine(sliced, options);
    auto got = engine.generate(mine, /*version=*/3);
    compare(got, want, mine, at);
    for (const auto& c : got)
      expect(std::all_of(c.policy_versions.begin(), c.policy_versions.end(), [](int64_t v) { return v == 3; }),
             at + ": request " + std::to_string(c.id) + " not at version 3");
    return;
  }
  Engine engine(sliced, options);
  const auto& ep_ranks = groups.along("ep").world_ranks();
  if (name == "refusal" && std::find(ep_ranks.begin(), ep_ranks.end(), world - 1) != ep_ranks.end()) {
    auto bad = mine;  // the ep group of the last rank, which refuses
    if (me == world - 1) bad.back().prompt.push_back(whole->vocab_size());  // one past the vocabulary
    std::string error;
    try {
      generate_in_lockstep(engine, bad);
    } catch (const std::invalid_argument& e) {
      error = e.what();
    }
    const bool named = me == world - 1 ? error.find(std::to_string(whole->vocab_size())) != std::string::npos
                                       : error.find("another rank of ep group") != std::string::npos;
    expect(named, at + ": the refusal reads '" + error + "'");
    expect(!engine.has_work() && engine.forwards() == 0, at + ": the refused call left work or ran a forward");
  }
  auto got = generate_in_lockstep(engine, mine);
  compare(got, want, mine, at);
  if (mine.empty()) expect(engine.forwards() == 0, at + ": a rank without requests ran a forward of its own");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: kiln_rollout_lockstep_worker plain|max_batch|share_prompts|refusal|colocated EP" << std::endl;
    return 2;
  }
  try {
    torch::set_num_threads(1);
    auto groups = dp_ep_groups(argv[2]);
    run_case(*groups, argv[1]);
    std::cout << "rank " << rank << ": " << checks - failures << " of " << checks << " checks passed" << std::endl;
    return failures ? 1 : 0;
  } catch (const std::exception& e) {
    std::cerr << "rank " << rank << ": error: " << e.what() << std::endl;
    return 3;
  }
}

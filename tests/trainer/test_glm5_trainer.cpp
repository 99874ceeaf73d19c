// The trainer on glm5_next (GLM-5.3-Flash's debug flavor, built through the registry): a step's
// gradients are the packed forward's autograd of the RL loss, the update changes the weights
// but never the frozen KPool indexers', and the rollout's expert and indexer choices are
// replayed.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <memory>

#include "actors/trainer/trainer.hpp"
#include "model/blocks/logprobs.hpp"
#include "model/glm5_next/model.hpp"
#include "model/registry.hpp"
#include "trainer_fixture.hpp"

using namespace kiln;
using model::glm5_next::Glm5NextModelImpl;

namespace {
std::shared_ptr<Glm5NextModelImpl> glm5_debug(uint64_t seed) {
  torch::manual_seed(int64_t(seed));
  auto m = model::Registry::with_builtins().build(model::ModelSpec{"glm5_next", "debug", "", "cpu", "fp32"});
  auto g = std::dynamic_pointer_cast<Glm5NextModelImpl>(m);
  REQUIRE(g);
  return g;
}

// Samples with the model's own expert and indexer choices for the P + n - 1 fed tokens (what a
// rollout of this model records).
std::vector<trainer::Sample> samples_with_choices(model::CausalLM& m, uint64_t seed, int count) {
  auto samples = test::random_samples(seed, count, m.vocab_size());
  torch::NoGradGuard no_grad;
  model::ForwardOptions ask;
  ask.return_routed_experts = true;
  ask.return_topk_indices = true;
  for (auto& s : samples) {
    std::vector<int64_t> doc = s.prompt;
    doc.insert(doc.end(), s.completion.begin(), s.completion.end());
    auto out = m.forward(model::PackedBatch::from_documents({doc}), ask);
    const int64_t rows = int64_t(doc.size()) - 1;
    s.routed_experts = out.routed_experts.narrow(0, 0, rows).clone();
    s.topk_indices = out.topk_indices.narrow(0, 0, rows).clone();
  }
  return samples;
}

double max_rel(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(1e-12, b.abs().max().item<double>());
}
}  // namespace

TEST_CASE("glm5_next: a train step's gradients are the packed forward's autograd of the RL loss, and the update changes the weights but never the indexers'") {
  auto ref = glm5_debug(7), policy = glm5_debug(7);  // equal weights
  auto samples = samples_with_choices(*ref, 11, 5);

  // The reference: one packed forward of every sample, the PPO loss at ratio 1 by hand
  // (token_mean, TIS weight min(exp(old - behaviour), 2) detached; old = the forward's own).
  std::vector<std::vector<int64_t>> docs;
  std::vector<int64_t> rows;
  std::vector<float> adv, behaviour;
  int64_t offset = 0;
  for (const auto& s : samples) {
    std::vector<int64_t> doc = s.prompt;
    doc.insert(doc.end(), s.completion.begin(), s.completion.end());
    for (std::size_t j = 0; j < s.completion.size(); ++j) {
      rows.push_back(offset + int64_t(s.prompt.size()) - 1 + int64_t(j));
      adv.push_back(s.advantage);
      behaviour.push_back(s.behavior_logprobs[j]);
    }
    offset += int64_t(doc.size());
    docs.push_back(doc);
  }
  auto batch = model::PackedBatch::from_documents(docs);
  auto lp = ref->token_logprobs(ref->forward(batch), model::next_token_targets(batch.input_ids, batch.cu_seqlens))
                .index_select(0, torch::tensor(rows));
  auto w = torch::clamp_max(torch::exp(lp.detach() - torch::tensor(behaviour)), 2.0);
  auto ref_loss = -(w * torch::tensor(adv) * torch::exp(lp - lp.detach())).sum() / double(rows.size());
  ref_loss.backward();

  trainer::TrainerConfig c;
  c.grad_clip = 0;  // the raw gradient stays in .grad()
  c.lr = 1e-2;
  trainer::Trainer t(policy, c);
  auto before = test::snapshot(t);
  auto m = t.train_step(samples);
  CHECK(std::isfinite(m.loss));
  const double want_loss = ref_loss.item<double>();
  CHECK(m.loss == doctest::Approx(want_loss).epsilon(1e-5));
  CHECK_FALSE(m.skipped_nonfinite);

  auto ref_named = ref->named_parameters();
  auto pol_named = policy->named_parameters();
  int64_t compared = 0, changed = 0;
  for (std::size_t i = 0; i < pol_named.size(); ++i) {
    const auto& name = pol_named[i].key();
    CAPTURE(name);
    const auto& g = pol_named[i].value().grad();
    const auto& g_ref = ref_named[i].value().grad();
    REQUIRE(g.defined() == g_ref.defined());
    if (!g.defined()) continue;
    CHECK(max_rel(g, g_ref) < 1e-4);
    ++compared;
    changed += !torch::equal(pol_named[i].value(), before.params[i]);
  }
  MESSAGE(compared << " parameters with gradients, " << changed << " changed by the update");
  CHECK(compared > 40);
  CHECK(changed == compared);
  // The indexers: frozen, no gradient, bit for bit as before.
  auto indexer = policy->indexer_parameters();
  REQUIRE(indexer.size() == 7);  // one full indexer (layer 1): wq_b, wk, k_norm weight and bias, weights_proj, compress_ape, compress_gate
  for (const auto& p : indexer) {
    CHECK_FALSE(p.requires_grad());
    CHECK_FALSE(p.grad().defined());
  }
  for (std::size_t i = 0; i < pol_named.size(); ++i)
    if (pol_named[i].key().find(".indexer.") != std::string::npos)
      CHECK(torch::equal(pol_named[i].value(), before.params[i]));
}

TEST_CASE("glm5_next: activation checkpointing gives the same loss and gradients, with and without replayed selections") {
  for (const bool replay_topk : {true, false}) {
  CAPTURE(replay_topk);
  auto plain = glm5_debug(4), ckpt = glm5_debug(4);
  auto samples = samples_with_choices(*plain, 6, 4);
  if (!replay_topk)  // the indexers choose, and a shared layer takes its full layer's selection
    for (auto& s : samples) s.topk_indices = torch::Tensor();
  trainer::TrainerConfig c;
  c.grad_clip = 0;
  trainer::Trainer a(plain, c);
  c.activation_checkpointing = true;
  trainer::Trainer b(ckpt, c);
  auto ma = a.train_step(samples), mb = b.train_step(samples);
  CHECK(mb.loss == doctest::Approx(ma.loss).epsilon(1e-6));
  auto pa = plain->named_parameters(), pb = ckpt->named_parameters();
  int64_t compared = 0;
  for (std::size_t i = 0; i < pa.size(); ++i) {
    CAPTURE(pa[i].key());
    REQUIRE(pa[i].value().grad().defined() == pb[i].value().grad().defined());
    if (!pa[i].value().grad().defined()) continue;
    CHECK(max_rel(pb[i].value().grad(), pa[i].value().grad()) < 1e-5);
    ++compared;
  }
  CHECK(compared > 40);
  }
}

TEST_CASE("glm5_next: the trainer replays the rollout's indexer selections and routed experts") {
  auto m = glm5_debug(3);
  auto samples = samples_with_choices(*m, 5, 4);
  auto own = trainer::completion_logprobs(*m, samples, 4096, /*routing_replay=*/true);
  auto fresh = trainer::completion_logprobs(*m, samples, 4096, /*routing_replay=*/false);
  for (std::size_t i = 0; i < samples.size(); ++i)  // replaying the model's own choices changes nothing
    for (std::size_t j = 0; j < own[i].size(); ++j) CHECK(own[i][j] == doctest::Approx(fresh[i][j]).epsilon(1e-6));
  // Other selections (each query sees only itself) and other experts: replayed, they change the
  // log-probs to those of a forward given the same choices.
  double moved = 0;
  for (auto& s : samples) {
    auto& k = s.topk_indices;
    auto own_pos = torch::arange(k.size(0), torch::kInt64).view({-1, 1});
    k.fill_(-1);
    k.select(2, 0).copy_(own_pos.expand({k.size(0), k.size(1)}));
    s.routed_experts = (s.routed_experts + 1).remainder(8);  // 8 experts; still distinct per token
  }
  auto replayed = trainer::completion_logprobs(*m, samples, 4096, /*routing_replay=*/true);
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const auto& s = samples[i];
    std::vector<int64_t> doc = s.prompt;
    doc.insert(doc.end(), s.completion.begin(), s.completion.end());
    auto b = model::PackedBatch::from_documents({doc});
    const int64_t rows = int64_t(doc.size()) - 1;
    model::ForwardOptions o;
    o.replay_topk_indices = torch::cat({s.topk_indices, s.topk_indices.narrow(0, rows - 1, 1)}, 0);
    o.replay_routed_experts = torch::cat({s.routed_experts, s.routed_experts.narrow(0, rows - 1, 1)}, 0);
    auto lp = m->token_logprobs(m->forward(b, o), model::next_token_targets(b.input_ids, b.cu_seqlens));
    const int64_t P = int64_t(s.prompt.size());
    for (std::size_t j = 0; j < replayed[i].size(); ++j) {
      const float want = lp[P - 1 + int64_t(j)].item<float>();
      CHECK(replayed[i][j] == doctest::Approx(want).epsilon(1e-5));
      moved = std::max(moved, std::abs(double(replayed[i][j]) - double(own[i][j])));
    }
  }
  CHECK(moved > 1e-3);
}

TEST_CASE("glm5_next: a trainer config that asks to train the indexer is refused by name") {
  trainer::TrainerConfig c;
  c.train_indexer = true;
  CHECK_THROWS_WITH_AS(trainer::Trainer(glm5_debug(1), c),
                       doctest::Contains("trainer config: train_indexer must be false: the RL loss does not train"),
                       std::invalid_argument);
}

TEST_CASE("glm5_next: algorithm.mtp_loss_weight adds the MTP loss to the step and trains the MTP layer, weight 0 leaves it untouched") {
  auto config = model::glm5_next::flavors::debug();
  config.num_nextn_predict_layers = 1;
  torch::manual_seed(21);
  auto with = std::make_shared<Glm5NextModelImpl>(config, /*random_init=*/true);
  torch::manual_seed(21);
  auto without = std::make_shared<Glm5NextModelImpl>(config, /*random_init=*/true);
  auto samples = test::random_samples(13, 6, with->vocab_size());
  std::map<std::string, torch::Tensor> before;
  for (auto& p : with->named_parameters()) before[p.key()] = p.value().detach().clone();

  trainer::TrainerConfig on, off;
  on.mtp_loss_weight = 0.5;
  on.mtp_depths = 2;
  trainer::Trainer a(with, on), b(without, off);
  auto ma = a.train_step(samples), mb = b.train_step(samples);
  CHECK(mb.mtp_loss == 0);
  CHECK(ma.mtp_ce > 0);
  CHECK(ma.mtp_loss > 0);
  // The policy loss is the same (same weights, same batch); the MTP term comes on top.
  CHECK(ma.loss == doctest::Approx(mb.loss + ma.mtp_loss).epsilon(1e-5));
  int64_t mtp_changed = 0;
  for (auto& p : with->named_parameters()) {
    if (p.key().rfind("mtp.", 0) != 0) continue;
    const bool indexer = p.key().find(".indexer.") != std::string::npos;
    CAPTURE(p.key());
    if (indexer) CHECK(torch::equal(p.value(), before[p.key()]));  // frozen, MTP layer's too
    else mtp_changed += !torch::equal(p.value(), before[p.key()]);
  }
  CHECK(mtp_changed > 5);
  for (auto& p : without->named_parameters())
    if (p.key().rfind("mtp.", 0) == 0) CHECK(torch::equal(p.value(), before[p.key()]));  // no MTP loss: untouched
}

TEST_CASE("glm5_next: mtp_loss_weight > 0 is refused by name for a model without an MTP layer, bad values by name") {
  trainer::TrainerConfig c;
  c.mtp_loss_weight = 0.3;
  CHECK_THROWS_WITH_AS(trainer::Trainer(glm5_debug(1), c),
                       doctest::Contains("mtp_loss_weight 0.300000 (experiment key algorithm.mtp_loss_weight) needs a "
                                         "policy with a multi-token-prediction layer"),
                       std::invalid_argument);
  c.mtp_loss_weight = -1;
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("trainer config: mtp_loss_weight must be finite and >= 0"),
                       std::invalid_argument);
  c.mtp_loss_weight = 0;
  c.mtp_depths = 0;
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("trainer config: mtp_depths must be in [1, 16]"), std::invalid_argument);
}

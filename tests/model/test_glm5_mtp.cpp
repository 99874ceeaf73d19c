// glm5_next's multi-token prediction: each depth's logits against the MTP layer run by hand,
// document by document (depths 1 and 7, packed documents: no depth crosses a boundary); the
// shared layer's gradient against copies of it, one per depth; the loss of a micro-batch with
// nothing supervised; the adapter's layers.{num_hidden_layers} keys.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "../scratch.hpp"
#include "messaging/torch_tensor.hpp"
#include "model/glm5_next/model.hpp"
#include "model/glm5_next/state_dict_adapter.hpp"

using namespace kiln::model;
using namespace kiln::model::glm5_next;

namespace {
Glm5NextConfig mtp_config() {
  auto c = flavors::debug();
  c.num_nextn_predict_layers = 1;
  return c;
}

Glm5NextModel random_model(uint64_t seed) {
  torch::manual_seed(seed);
  return Glm5NextModel(mtp_config(), /*random_init=*/true);
}

// Documents of 12, 5 and 9 tokens: at depth 7 only the first (4 rows) and the last (1 row) remain.
std::vector<std::vector<int64_t>> documents() {
  torch::manual_seed(11);
  std::vector<std::vector<int64_t>> docs;
  for (int64_t n : {12, 5, 9}) {
    auto t = torch::randint(0, 96, {n}, torch::kInt64);
    docs.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
  }
  return docs;
}

// The reference: one document alone, depth by depth, slicing by hand. `layer_for(d)` is the
// model whose MTP layer runs depth d (the same model for all depths, or one copy per depth).
// Returns each depth's [n - d - 1, V] logits (depths with rows only).
template <class LayerFor>
std::vector<torch::Tensor> by_hand(Glm5NextModelImpl& main, LayerFor layer_for, const std::vector<int64_t>& doc,
                                   int64_t depths) {
  const int64_t n = int64_t(doc.size());
  auto ids = torch::tensor(doc, torch::kInt64);
  auto previous = main.forward(PackedBatch::from_documents({doc})).hidden;  // [n, D]
  std::vector<torch::Tensor> logits;
  for (int64_t d = 1; d <= depths && n - d - 1 > 0; ++d) {
    const int64_t m = n - d - 1;
    Glm5NextModelImpl& owner = layer_for(d);
    auto e = owner.embed(ids.slice(0, d, d + m));  // tokens t+d, t < m
    auto x = owner.mtp[0](e, previous.slice(0, 0, m), torch::tensor({int64_t(0), m}));
    logits.push_back(torch::nn::functional::linear(owner.mtp[0]->head_norm(x), owner.lm_head->weight));
    previous = x;
  }
  return logits;
}

void check_depths_against_hand(int64_t depths) {
  auto model = random_model(1);
  const auto docs = documents();
  auto batch = PackedBatch::from_documents(docs);
  auto out = model->mtp_forward(batch, model->forward(batch).hidden, depths);
  std::vector<std::vector<torch::Tensor>> hand;
  for (const auto& doc : docs)
    hand.push_back(by_hand(*model, [&](int64_t) -> Glm5NextModelImpl& { return *model; }, doc, depths));
  int64_t deepest = 0;
  for (const auto& h : hand) deepest = std::max<int64_t>(deepest, int64_t(h.size()));
  REQUIRE(int64_t(out.size()) == std::min<int64_t>(depths, deepest));
  const auto cu = batch.cu_seqlens;
  for (const auto& depth : out) {
    const int64_t d = depth.depth;
    CAPTURE(d);
    int64_t at = 0;
    for (std::size_t k = 0; k < docs.size(); ++k) {
      const int64_t start = cu[int64_t(k)].item<int64_t>(), end = cu[int64_t(k) + 1].item<int64_t>();
      const int64_t n_rows = end - start - d - 1;
      if (n_rows <= 0) continue;
      // Document k's rows, and every target inside it: no depth crosses a boundary.
      auto rows = depth.rows.slice(0, at, at + n_rows);
      CHECK(torch::equal(rows, torch::arange(start, start + n_rows, torch::kInt64)));
      CHECK((rows + d + 1).max().item<int64_t>() < end);
      CHECK(torch::equal(depth.targets.slice(0, at, at + n_rows), batch.input_ids.slice(0, start + d + 1, end)));
      auto logits = torch::nn::functional::linear(depth.hidden.slice(0, at, at + n_rows), model->lm_head->weight);
      const auto& ref = hand[k][std::size_t(d - 1)];
      CAPTURE(k);
      CHECK((logits - ref).abs().max().item<double>() < 1e-5);
      at += n_rows;
    }
    CHECK(at == depth.rows.size(0));
  }
}
}  // namespace

TEST_CASE("MTP at depth 1: the logits equal the MTP layer run by hand on each document alone") {
  check_depths_against_hand(1);
}

TEST_CASE("MTP at 7 depths, one shared layer: each depth's logits equal the layer run by hand, no depth crosses a document boundary") {
  check_depths_against_hand(7);
}

TEST_CASE("MTP: the shared layer's gradient is the sum of its copies' gradients, one copy per depth") {
  const int64_t depths = 3;
  auto shared = random_model(2);
  std::vector<Glm5NextModel> copies;  // copies[d-1] runs depth d
  for (int64_t d = 1; d <= depths; ++d) {
    copies.push_back(random_model(99 + uint64_t(d)));
    torch::NoGradGuard ng;
    auto from = shared->named_parameters();
    for (auto& p : copies.back()->named_parameters()) p.value().copy_(from[p.key()]);
  }
  const auto docs = documents();
  auto batch = PackedBatch::from_documents(docs);
  const int64_t T = batch.input_ids.size(0);
  auto supervised = torch::ones({T}, torch::kBool);
  const double weight = 0.3, normalizer = 7;
  auto hidden = shared->forward(batch).hidden.detach();  // the main model's part is not compared
  auto r = mtp_loss(*shared, batch, hidden, supervised, depths, weight, normalizer, /*chunk=*/5);
  CHECK((r.loss.scalar_type() == torch::kFloat32));
  r.loss.backward();
  std::map<std::string, torch::Tensor> shared_grad;  // the shared layer's, over all depths
  for (auto& p : shared->mtp[0]->named_parameters())
    if (p.value().requires_grad()) shared_grad[p.key()] = p.value().grad().clone();

  // By hand: each depth on its own copy, cross-entropy from full logits (no chunking), summed.
  torch::Tensor loss = torch::zeros({});
  int64_t tokens = 0;
  for (const auto& doc : docs) {
    auto ids = torch::tensor(doc, torch::kInt64);
    auto logits = by_hand(*shared, [&](int64_t d) -> Glm5NextModelImpl& { return *copies[std::size_t(d - 1)]; }, doc, depths);
    for (std::size_t i = 0; i < logits.size(); ++i) {
      const int64_t d = int64_t(i) + 1, n_rows = logits[i].size(0);
      auto targets = ids.slice(0, d + 1, d + 1 + n_rows);
      loss = loss + torch::nn::functional::cross_entropy(logits[i], targets,
                                                         torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
      tokens += n_rows;
    }
  }
  loss = loss * (weight / double(depths) / normalizer);
  CHECK(r.tokens == tokens);
  CHECK(r.loss.item<double>() == doctest::Approx(loss.item<double>()).epsilon(1e-5));
  loss.backward();
  REQUIRE(!shared_grad.empty());
  for (const auto& [name, g] : shared_grad) {
    CAPTURE(name);
    torch::Tensor sum = torch::zeros_like(g);
    for (auto& c : copies) {
      auto cg = c->mtp[0]->named_parameters()[name].grad();
      REQUIRE(cg.defined());
      sum = sum + cg;
    }
    const double scale = std::max(sum.abs().max().item<double>(), 1e-12);
    CHECK((g - sum).abs().max().item<double>() / scale < 1e-5);
    // Each depth contributes (the sum is not one copy's gradient alone).
    if (name == "eh_proj.weight")
      for (auto& c : copies) CHECK(c->mtp[0]->eh_proj->weight.grad().abs().max().item<double>() > 0);
  }
}

TEST_CASE("MTP: an empty supervision shard yields an fp32 zero loss with gradient edges (zero gradients, not none)") {
  auto model = random_model(3);
  model->to_dtype(torch::kBFloat16);
  const auto docs = documents();
  auto batch = PackedBatch::from_documents(docs);
  const int64_t T = batch.input_ids.size(0);
  SUBCASE("rows at every depth, none supervised") {
    auto r = mtp_loss(*model, batch, model->forward(batch).hidden, torch::zeros({T}, torch::kBool), 7, 0.5, 10);
    CHECK((r.loss.scalar_type() == torch::kFloat32));
    CHECK(r.loss.requires_grad());
    CHECK(r.loss.item<double>() == 0.0);
    CHECK(r.tokens == 0);
    r.loss.backward();
  }
  SUBCASE("documents too short for depth 1: no rows at all") {
    auto short_batch = PackedBatch::from_documents({{1, 2}, {3}});
    auto r = mtp_loss(*model, short_batch, model->forward(short_batch).hidden, torch::ones({3}, torch::kBool), 2, 0.5, 10);
    CHECK((r.loss.scalar_type() == torch::kFloat32));
    CHECK(r.loss.requires_grad());
    CHECK(r.loss.item<double>() == 0.0);
    r.loss.backward();
  }
  for (auto& p : model->mtp[0]->named_parameters()) {
    if (!p.value().requires_grad()) continue;
    CAPTURE(p.key());
    REQUIRE(p.value().grad().defined());
    CHECK(p.value().grad().abs().max().item<double>() == 0.0);
  }
}

TEST_CASE("MTP: refused without an MTP layer, for depths < 1 and a hidden of the wrong shape") {
  torch::manual_seed(4);
  Glm5NextModel plain(flavors::debug(), true);
  auto batch = PackedBatch::from_documents(documents());
  auto hidden = plain->forward(batch).hidden;
  CHECK_THROWS_WITH_AS(plain->mtp_forward(batch, hidden, 1), doctest::Contains("num_nextn_predict_layers 0"),
                       std::invalid_argument);
  auto model = random_model(4);
  CHECK_THROWS_WITH_AS(model->mtp_forward(batch, hidden, 0), doctest::Contains("depths must be >= 1"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(model->mtp_forward(batch, hidden.slice(0, 1), 1), doctest::Contains("hidden must be [T, D]"),
                       std::invalid_argument);
}

TEST_CASE("MTP adapter: the layer is HF layers.{num_hidden_layers}, saved and loaded back equal, missing and unexpected keys named") {
  namespace fs = std::filesystem;
  auto model = random_model(5);
  const std::string L4 = "model.language_model.layers.4.";
  std::map<std::string, torch::Tensor> hf;
  for (auto& t : model->hf_state_dict()) hf[t.name] = kiln::messaging::to_torch(t);
  for (const auto* k : {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_a_proj.weight",
                        "self_attn.kv_b_proj.weight", "self_attn.indexer.wk.weight", "mlp.gate.weight",
                        "mlp.gate.e_score_correction_bias", "mlp.experts.7.down_proj.weight", "mlp.shared_experts.up_proj.weight"}) {
    CAPTURE(k);
    CHECK(hf.count(L4 + k) == 1);
  }
  for (const auto& [k, t] : hf) CHECK(k.find("layers.4.hc_") == std::string::npos);  // no hyper-connections
  CHECK(torch::equal(hf[L4 + "eh_proj.weight"], model->mtp[0]->eh_proj->weight));

  const fs::path dir = kiln::test::scratch_path("glm5-mtp-save");
  fs::remove_all(dir);
  model->save_hf_checkpoint(dir.string(), 1 << 20);
  auto loaded = from_hf_dir(dir.string());
  REQUIRE(loaded->mtp_layers() == 1);
  auto mine = model->named_parameters();
  for (auto& p : loaded->named_parameters()) {
    CAPTURE(p.key());
    CHECK(torch::equal(p.value(), mine[p.key()]));
  }

  std::vector<kiln::messaging::Tensor> tensors = model->hf_state_dict();
  auto without = [&](const std::string& name) {
    std::vector<kiln::messaging::Tensor> out;
    for (const auto& t : tensors)
      if (t.name != name) out.push_back(t);
    return out;
  };
  Glm5NextModel target(mtp_config());
  CHECK_THROWS_WITH_AS(load_hf_state_dict(*target, without(L4 + "hnorm.weight")),
                       doctest::Contains(("missing 1 key(s): " + L4 + "hnorm.weight").c_str()), kiln::checkpoint::CheckpointError);
  auto extra = tensors;
  extra.push_back(kiln::messaging::from_torch(L4 + "hc_attn_fn", torch::zeros({24, 256})));
  CHECK_THROWS_WITH_AS(load_hf_state_dict(*target, extra), doctest::Contains(("unexpected 1 key(s): " + L4 + "hc_attn_fn").c_str()),
                       kiln::checkpoint::CheckpointError);
  // The MTP layer's copies of the embedding and head: taken when equal to the main ones, refused when not.
  auto copies = tensors;
  copies.push_back(kiln::messaging::from_torch(L4 + "embed_tokens.weight", model->embed->weight.detach().clone()));
  copies.push_back(kiln::messaging::from_torch(L4 + "shared_head.head.weight", model->lm_head->weight.detach().clone()));
  load_hf_state_dict(*target, copies);
  CHECK(torch::equal(target->mtp[0]->eh_proj->weight, model->mtp[0]->eh_proj->weight));
  copies.back() = kiln::messaging::from_torch(L4 + "shared_head.head.weight", model->lm_head->weight.detach() + 1);
  CHECK_THROWS_WITH_AS(load_hf_state_dict(*target, copies),
                       doctest::Contains(("'" + L4 + "shared_head.head.weight' differs from 'lm_head.weight'").c_str()),
                       kiln::checkpoint::CheckpointError);
}

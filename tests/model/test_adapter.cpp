// The glm4_moe_lite state-dict adapter on the transformers fixture checkpoint: coverage of
// every key, MTP layer never read, missing/unexpected keys listed, wrong dtype or shape named,
// save -> load round trips, and the loads of one expert-parallel rank (its own experts only).
#include <doctest/doctest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "fixture.hpp"
#include "messaging/torch_tensor.hpp"
#include "model/glm4_moe_lite/model.hpp"
#include "model/glm4_moe_lite/state_dict_adapter.hpp"
#include "model/key_table.hpp"

using namespace kiln;
using namespace kiln::model;
namespace fs = std::filesystem;

namespace {
nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}
void write_json(const std::string& path, const nlohmann::json& j) { std::ofstream(path) << j.dump(2); }

std::string load_error(const std::string& dir) {
  try {
    glm4_moe_lite::from_hf_dir(dir);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("the adapter covers every key of the transformers checkpoint, and nothing else") {
  auto index = read_json(test::fixture_dir() + "/model.safetensors.index.json");
  std::set<std::string> in_checkpoint;
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) in_checkpoint.insert(it.key());
  auto model = glm4_moe_lite::from_hf_dir(test::fixture_dir());
  auto required = glm4_moe_lite::required_hf_keys(*model);
  std::set<std::string> needed(required.begin(), required.end());
  CHECK(needed.size() == required.size());  // no key read twice
  CHECK(needed == in_checkpoint);
  // Every table rule is used by some layer of the fixture except the q_lora = null one.
  for (const auto& rule : glm4_moe_lite::kKeyTable) {
    std::string pattern = rule.hf;
    if (pattern == "model.layers.{}.self_attn.q_proj.weight") continue;
    bool used = false;
    for (const auto& k : needed) {
      auto p = pattern.find("{}");
      if (p == std::string::npos ? k == pattern
                                 : k.compare(0, p, pattern, 0, p) == 0 &&
                                       k.size() > pattern.size() - 2 &&
                                       k.compare(k.size() - (pattern.size() - p - 2), std::string::npos, pattern, p + 2) == 0)
        used = true;
    }
    CHECK_MESSAGE(used, "rule not exercised by the fixture: " << pattern);
  }
}

TEST_CASE("an MTP layer in the checkpoint is skipped unread") {
  auto dir = test::fixture_copy("mtp");
  auto index = read_json(dir + "/model.safetensors.index.json");
  // Layer 3 (= num_hidden_layers) is the MTP layer; its shard does not even exist, so any
  // attempt to read it would fail.
  for (const char* k : {"model.layers.3.eh_proj.weight", "model.layers.3.self_attn.q_a_proj.weight",
                        "model.layers.3.mlp.experts.0.gate_proj.weight", "model.layers.3.shared_head.head.weight"})
    index["weight_map"][k] = "model-mtp.safetensors";
  write_json(dir + "/model.safetensors.index.json", index);
  auto model = std::make_shared<glm4_moe_lite::Glm4MoeLiteModel>(glm4_moe_lite::flavors::debug());
  auto ckpt = checkpoint::Checkpoint::open(dir);
  CHECK_NOTHROW(glm4_moe_lite::load_hf_state_dict(*model, ckpt));
  for (const auto& f : ckpt.opened_files()) CHECK(f != "model-mtp.safetensors");
}

TEST_CASE("missing and unexpected keys are all listed in one error") {
  auto dir = test::fixture_copy("keys");
  auto index = read_json(dir + "/model.safetensors.index.json");
  index["weight_map"].erase("model.layers.1.self_attn.kv_b_proj.weight");
  index["weight_map"].erase("model.layers.2.mlp.experts.5.up_proj.weight");
  index["weight_map"]["model.layers.0.self_attn.rotary_emb.inv_freq"] = "model-00001-of-00004.safetensors";
  write_json(dir + "/model.safetensors.index.json", index);
  auto err = load_error(dir);
  CHECK(err.find("missing 2 key(s)") != std::string::npos);
  CHECK(err.find("model.layers.1.self_attn.kv_b_proj.weight") != std::string::npos);
  CHECK(err.find("model.layers.2.mlp.experts.5.up_proj.weight") != std::string::npos);
  CHECK(err.find("unexpected 1 key(s): model.layers.0.self_attn.rotary_emb.inv_freq") != std::string::npos);
}

TEST_CASE("a checkpoint of another model: each list of keys is cut to its first 32, with the count") {
  std::vector<std::string> missing, unexpected{"extra.weight"};
  for (int i = 0; i < 300; ++i) missing.push_back("model.layers." + std::to_string(i) + ".w");
  std::string err;
  try {
    throw_if_misfit("ckpt", "a model", missing, unexpected);
  } catch (const checkpoint::CheckpointError& e) {
    err = e.what();
  }
  CHECK(err.find("missing 300 key(s): model.layers.0.w") != std::string::npos);
  CHECK(err.find("model.layers.31.w ... (268 more);") != std::string::npos);
  CHECK(err.find("model.layers.32.w") == std::string::npos);
  CHECK(err.find("unexpected 1 key(s): extra.weight") != std::string::npos);
  CHECK(err.size() < 1000);
}

TEST_CASE("a tensor of the wrong dtype or shape for its key is named") {
  auto dir = test::fixture_copy("dtype");
  auto index = read_json(dir + "/model.safetensors.index.json");
  // Replace the final norm with an int64 tensor and lm_head with a wrong shape, in a new shard.
  auto bad_norm = messaging::Tensor::zeros("model.norm.weight", messaging::DType::int64, {64});
  auto bad_head = messaging::Tensor::zeros("lm_head.weight", messaging::DType::float32, {96, 63});
  checkpoint::write_safetensors(dir + "/bad.safetensors", {bad_norm});
  index["weight_map"]["model.norm.weight"] = "bad.safetensors";
  write_json(dir + "/model.safetensors.index.json", index);
  CHECK(load_error(dir).find("'model.norm.weight' has integer dtype") != std::string::npos);
  checkpoint::write_safetensors(dir + "/bad.safetensors", {bad_head});
  index["weight_map"].erase("model.norm.weight");
  index["weight_map"]["model.norm.weight"] = read_json(test::fixture_dir() + "/model.safetensors.index.json")["weight_map"]["model.norm.weight"];
  index["weight_map"]["lm_head.weight"] = "bad.safetensors";
  write_json(dir + "/model.safetensors.index.json", index);
  auto err = load_error(dir);
  CHECK(err.find("'lm_head.weight' has shape [96, 63], the model needs [96, 64]") != std::string::npos);
}

TEST_CASE("a missing shard is an error naming the file") {
  auto dir = test::fixture_copy("shard");
  fs::remove(dir + "/model-00002-of-00004.safetensors");
  auto err = load_error(dir);
  CHECK(err.find("model-00002-of-00004.safetensors") != std::string::npos);
  CHECK(err.find("missing") != std::string::npos);
}

TEST_CASE("kiln saves the fixture in HF layout and loads it back bit for bit") {
  auto model = glm4_moe_lite::from_hf_dir(test::fixture_dir());
  auto dir = test::scratch_dir("resave");
  model->save_hf_checkpoint(dir, 100 * 1024);
  auto saved = read_json(dir + "/model.safetensors.index.json");
  auto original = read_json(test::fixture_dir() + "/model.safetensors.index.json");
  std::set<std::string> a, b;
  for (auto it = saved["weight_map"].begin(); it != saved["weight_map"].end(); ++it) a.insert(it.key());
  for (auto it = original["weight_map"].begin(); it != original["weight_map"].end(); ++it) b.insert(it.key());
  CHECK(a == b);
  int shards = 0;
  for (const auto& e : fs::directory_iterator(dir)) shards += e.path().extension() == ".safetensors";
  CHECK(shards >= 2);  // really sharded
  auto again = glm4_moe_lite::from_hf_dir(dir);
  auto p1 = model->named_parameters(), p2 = again->named_parameters();
  for (const auto& p : p1) CHECK_MESSAGE(torch::equal(p.value(), p2[p.key()]), p.key());
  // The config survives too.
  auto c1 = model->config().to_hf_json(), c2 = again->config().to_hf_json();
  CHECK(c1 == c2);
}

TEST_CASE("the package declares which tensors weight sync keeps in one bucket, under HF and kiln names") {
  auto model = glm4_moe_lite::from_hf_dir(test::fixture_dir());
  // Engines fuse a layer's q_a_proj with kv_a_proj_with_mqa (SGLang's fused_qkv_a_proj_with_mqa).
  const std::vector<std::vector<std::string>> hf = {
      {"model.layers.{}.self_attn.q_a_proj.weight", "model.layers.{}.self_attn.kv_a_proj_with_mqa.weight"}};
  CHECK(model->weight_sync_groups() == hf);
  CHECK(model->weight_sync_groups(/*hf_names=*/false) ==
        std::vector<std::vector<std::string>>{{"layers.{}.attn.q_a.weight", "layers.{}.attn.kv_a.weight"}});
  // Every pattern names real tensors of the model, under either naming.
  std::set<std::string> hf_names, kiln_names;
  for (const auto& t : model->hf_state_dict()) hf_names.insert(t.name);
  for (const auto& p : model->named_parameters()) kiln_names.insert(p.key());
  for (bool as_hf : {true, false})
    for (const auto& group : model->weight_sync_groups(as_hf))
      for (auto pattern : group) {
        const auto at = pattern.find("{}");
        REQUIRE(at != std::string::npos);
        pattern.replace(at, 2, "0");
        CHECK_MESSAGE((as_hf ? hf_names : kiln_names).count(pattern), pattern);
      }
}

namespace {
// Every parameter of `sliced` (rank `rank` of `ranks`' experts) equals `whole`'s: dense ones
// as they are, grouped experts as their rows [rank*E/ranks, (rank+1)*E/ranks).
void check_slice_of(glm4_moe_lite::Glm4MoeLiteModel& sliced, glm4_moe_lite::Glm4MoeLiteModel& whole, int64_t rank,
                    int64_t ranks) {
  const auto experts = whole.routed_expert_parameters(), mine = sliced.routed_expert_parameters();
  REQUIRE(experts.size() == mine.size());
  const int64_t El = whole.config().moe.num_experts / ranks;
  for (std::size_t i = 0; i < experts.size(); ++i) {
    REQUIRE(mine[i].size(0) == El);
    CHECK(torch::equal(mine[i], experts[i].narrow(0, rank * El, El)));
  }
  auto w = whole.named_parameters();
  for (const auto& p : sliced.named_parameters())
    if (p.key().find(".moe.experts.") == std::string::npos) CHECK_MESSAGE(torch::equal(p.value(), w[p.key()]), p.key());
  CHECK(sliced.expert_slice().rank == rank);
  CHECK(sliced.expert_slice().ranks == ranks);
}
}  // namespace

TEST_CASE("an expert-parallel rank's load holds and reads only its own experts, from per-expert or grouped keys") {
  auto whole = glm4_moe_lite::from_hf_dir(test::fixture_dir());  // 8 experts, per-expert HF keys
  for (int64_t ranks : {2, 4, 8})
    for (int64_t rank = 0; rank < ranks; ++rank) {
      auto sliced = glm4_moe_lite::from_hf_dir(test::fixture_dir(), ExpertSlice{rank, ranks});
      check_slice_of(*sliced, *whole, rank, ranks);
    }
  // transformers' grouped layout: mlp.experts.gate_up_proj [E, 2F, D], mlp.experts.down_proj [E, D, F]
  auto dir = test::scratch_dir("grouped_experts");
  std::vector<messaging::Tensor> tensors;
  for (const auto& t : whole->hf_state_dict())
    if (t.name.find(".mlp.experts.") == std::string::npos) tensors.push_back(t);
  const auto& layers = whole->layers;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    if (!layers[l]->is_moe()) continue;
    const auto prefix = "model.layers." + std::to_string(l) + ".mlp.experts.";
    tensors.push_back(messaging::from_torch(prefix + "gate_up_proj", layers[l]->moe->experts->w_gate_up_EFD.detach().clone()));
    tensors.push_back(messaging::from_torch(prefix + "down_proj", layers[l]->moe->experts->w_down_EDF.detach().clone()));
  }
  checkpoint::write_checkpoint(dir, tensors, 64 * 1024);
  fs::copy_file(fs::path(test::fixture_dir()) / "config.json", fs::path(dir) / "config.json");
  for (int64_t rank = 0; rank < 4; ++rank) {
    auto sliced = glm4_moe_lite::from_hf_dir(dir, ExpertSlice{rank, 4});
    check_slice_of(*sliced, *whole, rank, 4);
  }
  CHECK_THROWS_WITH_AS(glm4_moe_lite::from_hf_dir(dir, ExpertSlice{0, 3}),
                       doctest::Contains("8 experts do not split over 3 expert-parallel ranks"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(glm4_moe_lite::from_hf_dir(dir, ExpertSlice{2, 2}),
                       doctest::Contains("expert slice rank 2 of 2 ranks"), std::invalid_argument);
  // A slice cannot give the whole HF state without an ep group to gather the others over.
  auto sliced = glm4_moe_lite::from_hf_dir(dir, ExpertSlice{1, 2});
  CHECK_THROWS_WITH_AS(sliced->hf_state_dict(), doctest::Contains("rank 1 of 2 only"), std::logic_error);
}

TEST_CASE("hf_targets covers every HF key once, per-expert and grouped, and writing them loads the weights") {
  auto src = glm4_moe_lite::from_hf_dir(test::fixture_dir());
  torch::manual_seed(3);
  glm4_moe_lite::Glm4MoeLiteModel dst(src->config());  // other random weights
  auto targets = dst.hf_targets();
  const auto hf = src->hf_state_dict();  // per-expert names
  std::set<std::string> grouped;
  for (const auto& [name, view] : targets)
    if (name.ends_with(".mlp.experts.gate_up_proj") || name.ends_with(".mlp.experts.down_proj")) grouped.insert(name);
  CHECK(targets.size() == hf.size() + grouped.size());
  CHECK(grouped.size() == 2 * std::size_t(src->num_moe_layers()));
  torch::NoGradGuard no_grad;
  for (const auto& t : hf) {
    REQUIRE_MESSAGE(targets.count(t.name), t.name);
    auto value = messaging::to_torch(t);
    REQUIRE(targets[t.name].sizes() == value.sizes());
    targets[t.name].copy_(value);
  }
  auto p1 = src->named_parameters(), p2 = dst.named_parameters();
  for (const auto& p : p1) CHECK_MESSAGE(torch::equal(p.value(), p2[p.key()]), p.key());
  // The grouped name writes the same tensor as its experts' names.
  for (const auto& name : grouped) {
    const auto layer = std::to_string(layer_of(name, "model.layers."));
    const auto kiln_name = "layers." + layer + ".moe.experts." + (name.ends_with("gate_up_proj") ? "w_gate_up_EFD" : "w_down_EDF");
    CHECK_MESSAGE(targets[name].data_ptr() == dst.named_parameters()[kiln_name].data_ptr(), name);
  }
  CHECK(dst.hf_key_skipped("model.layers." + std::to_string(src->config().num_hidden_layers) + ".eh_proj.weight"));
  CHECK_FALSE(dst.hf_key_skipped("model.layers.0.self_attn.o_proj.weight"));
  CHECK_FALSE(dst.hf_key_skipped("lm_head.weight"));
  auto sliced = glm4_moe_lite::from_hf_dir(test::fixture_dir(), ExpertSlice{1, 2});
  CHECK_THROWS_WITH_AS(sliced->hf_targets(), doctest::Contains("ep rank 1 of 2 only"), std::invalid_argument);
}

// glm5_next's cached decoding at the model level: forward_cached over its decode cache against
// the packed forward (hidden states, expert and indexer choices), and the KDA slot states a
// token-by-token decode ends in against the chunked prefill's final state.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include "model/glm5_next/model.hpp"

using namespace kiln::model;
using namespace kiln::model::glm5_next;

namespace {
std::shared_ptr<Glm5NextModelImpl> random_debug(uint64_t seed) {
  torch::manual_seed(int64_t(seed));
  return std::make_shared<Glm5NextModelImpl>(flavors::debug(), /*random_init=*/true);
}

std::vector<int64_t> pages(int64_t first, int64_t count) {
  std::vector<int64_t> p;
  for (int64_t i = 0; i < count; ++i) p.push_back(first + i);
  return p;
}
}  // namespace

TEST_CASE("forward_cached: a prefill then one token at a time gives the packed forward's hidden states and choices, and the KDA slot states equal the chunked prefill's final state") {
  auto m = random_debug(4);
  torch::NoGradGuard no_grad;
  const std::vector<int64_t> seq = {3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43};  // 13 tokens
  const int64_t T = int64_t(seq.size()), P = 5;
  auto ids = torch::tensor(seq, torch::kInt64);
  ForwardOptions ask;
  ask.return_routed_experts = true;
  ask.return_topk_indices = true;
  auto full = m->forward(PackedBatch::from_documents({seq}), ask);

  const DecodeCacheShape shape{8, 4, 3};  // pages of 4 tokens, 3 slots
  auto step_cache = m->make_decode_cache(shape, torch::TensorOptions(torch::kFloat));
  auto table = pages(2, 4);  // pages 2..5 hold the 13 tokens
  std::vector<torch::Tensor> hidden, experts, topk;
  auto run = [&](DecodeCache& cache, int64_t from, int64_t count) {
    std::vector<CachedSlice> slices{{0, count, from, &table, /*slot=*/1}};
    auto out = m->forward_cached(ids.narrow(0, from, count), torch::arange(from, from + count, torch::kInt64), slices,
                                 cache, /*want_routing=*/true);
    hidden.push_back(out.hidden);
    experts.push_back(out.routed_experts);
    topk.push_back(out.topk_indices);
  };
  run(*step_cache, 0, P);
  for (int64_t t = P; t < T; ++t) run(*step_cache, t, 1);
  auto h = torch::cat(hidden, 0);
  const double d = (h - full.hidden).abs().max().item<double>();
  MESSAGE("max |cached - packed| hidden = " << d);
  CHECK(d < 1e-5);
  CHECK(torch::equal(torch::cat(experts, 0), full.routed_experts));
  CHECK(torch::equal(std::get<0>(torch::cat(topk, 0).sort(-1)), std::get<0>(full.topk_indices.sort(-1))));  // as sets

  // The whole sequence prefilled at once (chunked form) ends in the states the steps reached.
  auto prefill_cache = m->make_decode_cache(shape, torch::TensorOptions(torch::kFloat));
  hidden.clear();
  run(*prefill_cache, 0, T);
  auto& a = dynamic_cast<Glm5NextDecodeCache&>(*step_cache);
  auto& b = dynamic_cast<Glm5NextDecodeCache&>(*prefill_cache);
  int kda_layers = 0;
  for (std::size_t l = 0; l < a.layers.size(); ++l) {
    if (!a.layers[l].kda.recurrent.defined()) continue;
    CAPTURE(l);
    ++kda_layers;
    const auto& sa = a.layers[l].kda, &sb = b.layers[l].kda;
    const double dr = (sa.recurrent[1] - sb.recurrent[1]).abs().max().item<double>();
    MESSAGE("layer " << l << ": max |decoded - prefilled| recurrent state = " << dr);
    CHECK(dr < 1e-5);
    CHECK(sb.recurrent[1].abs().max().item<double>() > 1e-3);  // a state, not zeros
    CHECK((sa.conv[1] - sb.conv[1]).abs().max().item<double>() < 1e-6);
    CHECK(sa.recurrent[0].abs().max().item<double>() == 0);  // other slots untouched
  }
  CHECK(kda_layers == 2);
  // The sparse layers' pages hold the same latents and indexer entries either way.
  for (std::size_t l = 0; l < a.layers.size(); ++l)
    for (auto [x, y] : {std::pair{a.layers[l].latent, b.layers[l].latent}, std::pair{a.layers[l].index, b.layers[l].index}})
      if (x.defined()) CHECK((x - y).abs().max().item<double>() < 1e-5);
}

TEST_CASE("forward_cached refuses another model's cache and a slice without a slot, by name") {
  auto m = random_debug(1);
  torch::NoGradGuard no_grad;
  PagedCache wrong(4, 32, {4, 4, 2}, torch::TensorOptions(torch::kFloat));
  std::vector<int64_t> table{0};
  std::vector<CachedSlice> slices{{0, 2, 0, &table, 0}};
  auto ids = torch::tensor({3, 4}, torch::kInt64), pos = torch::arange(2, torch::kInt64);
  CHECK_THROWS_WITH_AS(m->forward_cached(ids, pos, slices, wrong, false), doctest::Contains("the cache is not this model's"),
                       std::invalid_argument);
  auto cache = m->make_decode_cache({4, 4, 2}, torch::TensorOptions(torch::kFloat));
  slices[0].slot = 2;
  CHECK_THROWS_WITH_AS(m->forward_cached(ids, pos, slices, *cache, false), doctest::Contains("has slot 2, the cache has slots [0, 2)"),
                       std::invalid_argument);
  CHECK(m->decode_cache_bytes({4, 4, 2}, torch::kFloat) ==
        // 2 KDA layers: conv 2 x (3*32 x 3) + recurrent 2 x (2 x 16 x 16); 2 sparse layers: latents
        // 16 tokens x 32, the full-indexer layer also 16 x 2*16 — all 4 bytes each
        4 * (2 * 2 * (96 * 3 + 2 * 16 * 16) + 2 * 16 * 32 + 16 * 32));
}

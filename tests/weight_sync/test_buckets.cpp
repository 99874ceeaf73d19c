// Weight-sync buckets: sizes, the q_a_proj / kv_a_proj_with_mqa pairing, and the post-update
// checksum check (torch-free; also under the sanitizers).
#include <doctest/doctest.h>

#include "actors/weight_sync/buckets.hpp"

using namespace kiln;
using namespace kiln::weight_sync;

namespace {
messaging::Tensor t(const std::string& name, int64_t floats, uint8_t fill = 1) {
  auto x = messaging::Tensor::zeros(name, messaging::DType::float32, {floats});
  for (std::size_t i = 0; i < x.nbytes; ++i) x.mutable_data()[i] = std::byte(fill + i % 7);
  x.name = name;
  return x;
}
// What glm4_moe_lite declares (its test checks that it does: tests/model/test_adapter.cpp).
const TravelGroups kMla = {{"model.layers.{}.self_attn.q_a_proj.weight", "model.layers.{}.self_attn.kv_a_proj_with_mqa.weight"}};
}  // namespace

TEST_CASE("buckets respect the size and keep q_a_proj with kv_a_proj_with_mqa") {
  // 100-byte tensors; a 250-byte bucket would cut between q_a_proj (3rd) and kv_a (4th).
  std::vector<messaging::Tensor> ts = {
      t("model.layers.0.input_layernorm.weight", 25), t("model.layers.0.self_attn.o_proj.weight", 25),
      t("model.layers.0.self_attn.q_a_proj.weight", 25), t("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", 25),
      t("model.layers.0.mlp.gate.weight", 25)};
  auto buckets = plan_buckets(ts, 250, 7, kMla);
  REQUIRE(buckets.size() == 3);  // [norm, o_proj] [q_a, kv_a] [gate]: the pair is not split
  CHECK(buckets[0].tensors.size() == 2);
  REQUIRE(buckets[1].tensors.size() == 2);
  CHECK(buckets[1].tensors[0].name == "model.layers.0.self_attn.q_a_proj.weight");
  CHECK(buckets[1].tensors[1].name == "model.layers.0.self_attn.kv_a_proj_with_mqa.weight");
  for (const auto& b : buckets) {
    CHECK(b.version == 7);
    CHECK(b.count == 3);
    CHECK(b.bytes() <= 250);
  }
  // A partner far away in the list is moved next to its pair.
  std::vector<messaging::Tensor> far = {t("model.layers.3.self_attn.kv_a_proj_with_mqa.weight", 10), t("a", 10),
                                        t("b", 10), t("model.layers.3.self_attn.q_a_proj.weight", 10)};
  auto fb = plan_buckets(far, 80, 1, kMla);
  CHECK(fb[0].tensors[1].name == "model.layers.3.self_attn.q_a_proj.weight");
  // Members of one group instance share the layer index; other names stay alone.
  auto units = travel_units({"model.layers.12.self_attn.q_a_proj.weight", "model.layers.12.self_attn.q_b_proj.weight",
                             "model.layers.2.self_attn.kv_a_proj_with_mqa.weight",
                             "model.layers.12.self_attn.kv_a_proj_with_mqa.weight"},
                            kMla);
  CHECK(units == std::vector<std::vector<std::size_t>>{{0, 3}, {1}, {2}});
  // Without declared groups nothing is paired.
  CHECK(plan_buckets(far, 20, 1).size() == 4);
}

TEST_CASE("the receiver verifies checksums and names a tensor corrupted in transit") {
  std::vector<messaging::Tensor> ts = {t("w1", 64, 1), t("w2", 64, 2), t("w3", 64, 3)};
  auto expected = manifest(ts);
  auto buckets = plan_buckets(ts, 600, 4);  // [w1, w2] [w3]
  REQUIRE(buckets.size() == 2);
  SUBCASE("intact") {
    Receiver r;
    for (auto& b : buckets) r.accept(b);
    CHECK(r.complete());
    CHECK(r.verified(expected).size() == 3);
  }
  SUBCASE("one byte flipped in w2") {
    auto bad = messaging::Tensor::copy_of("w2", messaging::DType::float32, {64}, buckets[0].tensors[1].data, 256);
    bad.mutable_data()[17] ^= std::byte(0x40);
    buckets[0].tensors[1] = bad;
    Receiver r;
    for (auto& b : buckets) r.accept(b);
    CHECK_THROWS_WITH_AS(r.verified(expected), doctest::Contains("'w2' (checksum differs)"), std::runtime_error);
  }
  SUBCASE("wrong version, repeated bucket") {
    Receiver r;
    r.accept(buckets[0]);
    CHECK_THROWS_AS(r.accept(buckets[0]), std::invalid_argument);
    auto other = buckets[1];
    other.version = 5;
    CHECK_THROWS_WITH_AS(r.accept(other), doctest::Contains("version 5"), std::invalid_argument);
    CHECK_FALSE(r.complete());
  }
}

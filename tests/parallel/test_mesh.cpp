// The device mesh: row-major layout of world ranks, the groups along each dimension, and bad
// meshes refused by name.
#include "parallel/mesh.hpp"

#include <doctest/doctest.h>

#include <stdexcept>

using namespace kiln::parallel;

TEST_CASE("mesh: ranks are laid out row-major and each dimension's group varies only that coordinate") {
  const Mesh mesh({{"dp", 2}, {"ep", 2}}, 4);
  CHECK(mesh.describe() == "dp2xep2");
  CHECK(mesh.coords(0) == std::vector<int>{0, 0});
  CHECK(mesh.coords(1) == std::vector<int>{0, 1});
  CHECK(mesh.coords(2) == std::vector<int>{1, 0});
  CHECK(mesh.coords(3) == std::vector<int>{1, 1});
  const auto dp = mesh.dim_index("dp"), ep = mesh.dim_index("ep");
  CHECK(mesh.group_along(ep, 3) == std::vector<int>{2, 3});
  CHECK(mesh.group_along(ep, 0) == std::vector<int>{0, 1});
  CHECK(mesh.group_along(dp, 3) == std::vector<int>{1, 3});
  CHECK(mesh.group_along(dp, 0) == std::vector<int>{0, 2});

  const Mesh three({{"pp", 2}, {"dp", 3}, {"ep", 2}}, 12);
  CHECK(three.coords(11) == std::vector<int>{1, 2, 1});
  CHECK(three.group_along(three.dim_index("dp"), 7) == std::vector<int>{7, 9, 11});
  CHECK(three.group_along(three.dim_index("dp"), 6) == std::vector<int>{6, 8, 10});
  CHECK(three.group_along(three.dim_index("pp"), 7) == std::vector<int>{1, 7});
  CHECK(Mesh({}, 4).describe() == "world");
}

TEST_CASE("mesh: a bad mesh is refused naming its dimensions") {
  const auto refused = [](std::vector<MeshDim> dims, int world) {
    try {
      Mesh m(std::move(dims), world);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  CHECK(refused({{"dp", 2}, {"ep", 2}}, 8) == "mesh dp=2 x ep=2 spans 4 ranks (or more), but the world size is 8");
  CHECK(refused({{"dp", 3}, {"ep", 2}}, 4) == "mesh dp=3 x ep=2 spans 6 ranks (or more), but the world size is 4");
  CHECK(refused({{"dp", 2}, {"dp", 2}}, 4) == "mesh dp=2 x dp=2: dimension 'dp' appears twice");
  CHECK(refused({{"", 4}}, 4) == "mesh =4: a dimension has no name");
  CHECK(refused({{"dp", 0}}, 4) == "mesh dp=0: dimension 'dp' has size 0 (must be >= 1)");
  CHECK_THROWS_WITH_AS(Mesh({{"dp", 4}}, 4).dim_index("ep"), "mesh dp=4 has no dimension 'ep'", std::invalid_argument);
}

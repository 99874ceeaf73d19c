#pragma once
// The device mesh: world ranks laid out row-major over named dimensions (e.g. dp x ep), and
// the sub-groups along each dimension. No LibTorch: process_group.hpp builds c10d groups from it.
#include <string>
#include <vector>

namespace kiln::parallel {

/// One named mesh dimension ("dp", "ep", ...) and how many ranks it spans.
struct MeshDim {
  std::string name;
  int size = 1;
};

/// Ranks laid out row-major over `dims`: the last dimension varies fastest, so for dp=2 x ep=2
/// world rank 3 sits at (dp 1, ep 1) and its ep group is world ranks {2, 3}, its dp group {1, 3}.
class Mesh {
 public:
  /// Throws std::invalid_argument when a name is empty or repeated, a size is < 1, or the sizes'
  /// product is not `world_size` (names every dimension and the world size).
  Mesh(std::vector<MeshDim> dims, int world_size);

  const std::vector<MeshDim>& dims() const { return dims_; }
  int world_size() const { return world_size_; }

  /// Index of the dimension called `name`; throws std::invalid_argument naming the known ones.
  std::size_t dim_index(const std::string& name) const;

  /// The coordinate of world `rank` along every dimension (one entry per dim).
  std::vector<int> coords(int rank) const;

  /// The world ranks of `rank`'s group along dimension `dim`, ascending; the group rank of a
  /// member is its position in this list (= its coordinate along `dim`).
  std::vector<int> group_along(std::size_t dim, int rank) const;

  /// "dp2xep2" (empty mesh: "world"): names the layout in store keys and messages.
  std::string describe() const;

 private:
  std::vector<MeshDim> dims_;
  int world_size_;
};

}  // namespace kiln::parallel

#include "parallel/mesh.hpp"

#include <cassert>
#include <set>
#include <stdexcept>

namespace kiln::parallel {

namespace {
std::string dims_text(const std::vector<MeshDim>& dims) {
  std::string s;
  for (const auto& d : dims) s += (s.empty() ? "" : " x ") + d.name + "=" + std::to_string(d.size);
  return s.empty() ? "(no dimensions)" : s;
}
}  // namespace

Mesh::Mesh(std::vector<MeshDim> dims, int world_size) : dims_(std::move(dims)), world_size_(world_size) {
  std::set<std::string> seen;
  long long product = 1;
  for (const auto& d : dims_) {
    if (d.name.empty()) throw std::invalid_argument("mesh " + dims_text(dims_) + ": a dimension has no name");
    if (!seen.insert(d.name).second)
      throw std::invalid_argument("mesh " + dims_text(dims_) + ": dimension '" + d.name + "' appears twice");
    if (d.size < 1)
      throw std::invalid_argument("mesh " + dims_text(dims_) + ": dimension '" + d.name + "' has size " +
                                  std::to_string(d.size) + " (must be >= 1)");
    product *= d.size;
    if (product > world_size_) break;
  }
  if (!dims_.empty() && product != world_size_)
    throw std::invalid_argument("mesh " + dims_text(dims_) + " spans " + std::to_string(product) +
                                " ranks (or more), but the world size is " + std::to_string(world_size_));
}

std::size_t Mesh::dim_index(const std::string& name) const {
  for (std::size_t i = 0; i < dims_.size(); ++i)
    if (dims_[i].name == name) return i;
  throw std::invalid_argument("mesh " + dims_text(dims_) + " has no dimension '" + name + "'");
}

std::vector<int> Mesh::coords(int rank) const {
  assert(rank >= 0 && rank < world_size_);  // callers pass their own validated rank
  std::vector<int> c(dims_.size());
  for (std::size_t i = dims_.size(); i-- > 0;) {
    c[i] = rank % dims_[i].size;
    rank /= dims_[i].size;
  }
  return c;
}

std::vector<int> Mesh::group_along(std::size_t dim, int rank) const {
  assert(dim < dims_.size());  // dim comes from dim_index
  int stride = 1;
  for (std::size_t i = dim + 1; i < dims_.size(); ++i) stride *= dims_[i].size;
  const int first = rank - coords(rank)[dim] * stride;
  std::vector<int> ranks(dims_[dim].size);
  for (int k = 0; k < dims_[dim].size; ++k) ranks[k] = first + k * stride;
  return ranks;
}

std::string Mesh::describe() const {
  std::string s;
  for (const auto& d : dims_) s += (s.empty() ? "" : "x") + d.name + std::to_string(d.size);
  return s.empty() ? "world" : s;
}

}  // namespace kiln::parallel

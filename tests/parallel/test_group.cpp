// Process groups in one process (world 1, Gloo): the store, the mesh's groups, and bad
// arguments refused with the group and the values named. The multi-process behaviour is in
// run_workers.py.
#include "parallel/process_group.hpp"

#include <doctest/doctest.h>

#include <stdexcept>

using namespace kiln::parallel;

namespace {
// What `f` throws as std::invalid_argument ("" when it does not throw).
template <class F>
std::string refusal(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}
bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }
}  // namespace

TEST_CASE("process groups of one process: world and mesh groups work and the store holds keys") {
  ProcessGroups groups(LaunchInfo{}, torch::kCPU, {{"dp", 1}, {"ep", 1}});
  CHECK(groups.world().name() == "world");
  CHECK(groups.world().size() == 1);
  CHECK(groups.along("ep").name() == "ep[0]");
  CHECK(groups.along("dp").world_ranks() == std::vector<int>{0});
  auto t = torch::arange(5, torch::kFloat);
  groups.along("ep").all_reduce(t);
  CHECK(torch::equal(t, torch::arange(5, torch::kFloat)));
  groups.store().set("zmq/0", std::vector<uint8_t>{'o', 'k'});
  CHECK(groups.store().get("zmq/0") == std::vector<uint8_t>{'o', 'k'});
  CHECK(has(refusal([&] { groups.along("tp"); }), "mesh dp=1 x ep=1 has no dimension 'tp'"));
}

TEST_CASE("process groups refuse a mesh that does not span the world and a device they cannot serve") {
  CHECK(has(refusal([] { ProcessGroups(LaunchInfo{}, torch::kCPU, {{"dp", 2}}); }),
            "mesh dp=2 spans 2 ranks (or more), but the world size is 1"));
  CHECK(has(refusal([] { ProcessGroups(LaunchInfo{}, torch::Device(torch::kMeta)); }),
            "only CPU (Gloo) and CUDA (NCCL) are supported"));
}

TEST_CASE("collectives refuse bad shapes dtypes counts devices and roots naming the group") {
  ProcessGroups groups(LaunchInfo{}, torch::kCPU);
  Group& g = groups.world();
  auto out = torch::zeros({2, 3});
  CHECK(refusal([&] { g.reduce_scatter(out, torch::zeros({3, 3})); }) ==
        "reduce_scatter on group 'world' (rank 0 of 1, world rank 0): input [3, 3] Float must be [1*N, ...] of "
        "output [2, 3] Float");
  CHECK(has(refusal([&] { g.reduce_scatter(out, torch::zeros({2, 3}, torch::kLong)); }), "input [2, 3] Long"));
  CHECK(has(refusal([&] { g.all_gather_into_tensor(out, torch::zeros({2, 4})); }),
            "all_gather_into_tensor on group 'world' (rank 0 of 1, world rank 0): output [2, 3] Float must be"));
  CHECK(has(refusal([&] { g.all_to_all(out, torch::zeros({2, 3}), {2, 0}, {2}); }),
            "output_rows [2, 0] has 2 entries, not 1"));
  CHECK(has(refusal([&] { g.all_to_all(out, torch::zeros({2, 3}), {-1}, {2}); }), "output_rows [-1] has a negative count"));
  CHECK(has(refusal([&] { g.all_to_all(out, torch::zeros({3, 3}), {2}, {2}); }),
            "input_rows [2] do not sum to input's 3 rows"));
  CHECK(has(refusal([&] { g.all_to_all(out, torch::zeros({2, 4}), {2}, {2}); }), "input [2, 4] and output [2, 3] differ after dim 0"));
  CHECK(has(refusal([&] { g.broadcast(out, 1); }), "broadcast on group 'world' (rank 0 of 1, world rank 0): root 1 is not a rank of it"));
  auto strided = torch::zeros({3, 3}).t();
  CHECK(has(refusal([&] { g.all_reduce(strided); }), "all_reduce on group 'world' (rank 0 of 1, world rank 0): tensor [3, 3] is not contiguous"));
  auto meta = torch::zeros({3}, torch::Device(torch::kMeta));
  CHECK(has(refusal([&] { g.all_reduce(meta); }), "tensor is on meta, the group on cpu"));
  torch::Tensor undefined;
  CHECK(has(refusal([&] { g.all_reduce(undefined); }), "tensor is undefined"));
}

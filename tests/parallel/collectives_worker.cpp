// One rank of a multi-process test of parallel/ (run_workers.py starts W of them, or torchrun
// does). It reads its place from the launcher's environment, builds the process groups on CPU
// (Gloo) and then either
//   collectives: checks every collective of Group exactly (float32, float64 and int64; 0, 1, 7 and
//                87382x3 elements, the last over 1 MiB) on the world group and on this rank's
//                group along each mesh dimension; exit 0 when every check passed, 1 otherwise;
//   loop:        all-reduces 1 MiB on the world group until a collective fails (run_workers.py
//                kills one rank meanwhile); exit 3 with the error;
//   abort:       (world 2) rank 0 all-reduces while rank 1 stays out, as a lost peer would, and
//                another thread calls ProcessGroups::abort 300 ms later: the wait must end then
//                (not at the 60 s timeout) with a CollectiveError naming the reason, the groups
//                must say failed() and refuse the next collective at once; then rank 1 joins
//                the left collective (Gloo: so that Gloo's worker thread ends) and both exit
//                0 with "rank R: X of Y checks passed".
// Usage: kiln_parallel_worker collectives|loop|abort [--mesh dp=2,ep=2] [--timeout-ms 10000]
//        [--device cuda]  (tensors on GPU LOCAL_RANK, NCCL; collectives also times a 1 GiB all-reduce)
#include "parallel/process_group.hpp"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <numeric>
#include <string>
#include <thread>

using namespace kiln::parallel;

namespace {

int checks = 0, failures = 0;
torch::Device g_device = torch::kCPU;  // --device cuda: tensors on this rank's GPU, NCCL

torch::Tensor D(const torch::Tensor& t) { return t.to(g_device).contiguous(); }

void expect_equal(const torch::Tensor& got_anywhere, const torch::Tensor& want, const std::string& what) {
  const auto got = got_anywhere.cpu();
  ++checks;
  if (got.sizes() == want.sizes() && got.scalar_type() == want.scalar_type() && torch::equal(got, want)) return;
  ++failures;
  std::cerr << "MISMATCH " << what << ": got " << got.sizes() << " " << got.scalar_type() << ", want " << want.sizes()
            << " " << want.scalar_type();
  if (got.sizes() == want.sizes()) {
    const auto bad = torch::nonzero((got.flatten() != want.flatten())).flatten();
    if (bad.numel() > 0) {
      const auto i = bad[0].item<int64_t>();
      std::cerr << "; " << bad.numel() << " elements differ, first at flat index " << i << ": got "
                << got.flatten()[i].item<double>() << ", want " << want.flatten()[i].item<double>();
    }
  }
  std::cerr << std::endl;
}

// [rows, 3]: element j (row-major) is j % 97.
torch::Tensor pattern(int64_t rows, torch::ScalarType dtype) {
  return (torch::arange(rows * 3, torch::kLong) % 97).reshape({rows, 3}).to(dtype);
}

// The rows rank s sends to rank p in the all-to-all test: [k, 3], unique per (s, p) pair.
torch::Tensor block(int s, int p, int64_t k, torch::ScalarType dtype) {
  return ((torch::arange(k * 3, torch::kLong) % 1000) * 16 + s * 4 + p).reshape({k, 3}).to(dtype);
}

// Rows s sends to p: zero for a third of the pairs, so every rank sends and receives nothing
// from someone (and with scale 0 every count is zero).
int64_t count(int s, int p, int64_t scale) { return ((s + 2 * p + 1) % 3) * scale; }

void check_group(Group& g) {
  const int r = g.rank(), w = g.size();
  const std::string at = g.name() + " rank " + std::to_string(r);

  // Membership: every rank's world rank, gathered, is the group's list.
  auto me = D(torch::full({1}, int64_t{g.world_ranks()[r]}, torch::kLong));
  auto members = D(torch::empty({w}, torch::kLong));
  g.all_gather_into_tensor(members, me);
  expect_equal(members, torch::tensor(std::vector<int64_t>(g.world_ranks().begin(), g.world_ranks().end())),
               at + " members");

  for (auto dtype : {torch::kFloat, torch::kDouble, torch::kLong}) {
    for (int64_t rows : {0, 1, 7, 87382}) {
      const std::string tag = at + " " + c10::toString(dtype) + " rows " + std::to_string(rows) + " ";
      const auto base = pattern(rows, dtype);

      auto sum = D(base + r);
      g.all_reduce(sum, ReduceOp::sum);
      expect_equal(sum, base * w + w * (w - 1) / 2, tag + "all_reduce sum");
      auto max = D(base + r);
      g.all_reduce(max, ReduceOp::max);
      expect_equal(max, base + (w - 1), tag + "all_reduce max");
      auto min = D(base + r);
      g.all_reduce(min, ReduceOp::min);
      expect_equal(min, base, tag + "all_reduce min");

      for (int root : {0, w - 1}) {
        auto t = D(r == root ? (base + 5).contiguous() : torch::full({rows, 3}, -1, dtype));
        g.broadcast(t, root);
        expect_equal(t, base + 5, tag + "broadcast from " + std::to_string(root));
      }
      {  // two broadcasts in flight at once (start_broadcast), finished in order
        auto a = D(r == 0 ? (base + 7).contiguous() : torch::full({rows, 3}, -1, dtype));
        auto b = D(r == w - 1 ? (base + 9).contiguous() : torch::full({rows, 3}, -1, dtype));
        auto wa = g.start_broadcast(a, 0);
        auto wb = g.start_broadcast(b, w - 1);
        g.finish(wa, "broadcast");
        g.finish(wb, "broadcast");
        expect_equal(a, base + 7, tag + "start_broadcast from 0");
        expect_equal(b, base + 9, tag + "start_broadcast from " + std::to_string(w - 1) + " queued behind it");
      }

      auto gathered = D(torch::full({w * rows, 3}, -7, dtype));
      g.all_gather_into_tensor(gathered, D(base + 1000 * r));
      std::vector<torch::Tensor> want_gathered;
      for (int s = 0; s < w; ++s) want_gathered.push_back(base + 1000 * s);
      expect_equal(gathered, torch::cat(want_gathered), tag + "all_gather_into_tensor");

      const auto full = pattern(w * rows, dtype);
      auto scattered = D(torch::full({rows, 3}, -7, dtype));
      g.reduce_scatter(scattered, D(full + r));
      expect_equal(scattered, full.slice(0, r * rows, (r + 1) * rows) * w + w * (w - 1) / 2, tag + "reduce_scatter");
    }
    for (int64_t scale : {0, 1, 5, 50000}) {
      std::vector<int64_t> in_rows(w), out_rows(w);
      std::vector<torch::Tensor> send, want;
      for (int p = 0; p < w; ++p) {
        in_rows[p] = count(r, p, scale);
        out_rows[p] = count(p, r, scale);
        send.push_back(block(r, p, in_rows[p], dtype));
        want.push_back(block(p, r, out_rows[p], dtype));
      }
      const auto want_rows = std::accumulate(out_rows.begin(), out_rows.end(), int64_t{0});
      auto received = D(torch::full({want_rows, 3}, -7, dtype));
      g.all_to_all(received, D(torch::cat(send)), out_rows, in_rows);
      expect_equal(received, torch::cat(want),
                   at + " " + c10::toString(dtype) + " all_to_all scale " + std::to_string(scale));
    }
  }
  g.barrier();
}

void expect(bool ok, const std::string& what) {
  ++checks;
  if (ok) return;
  ++failures;
  std::cerr << "MISMATCH " << what << std::endl;
}

int abort_scenario(ProcessGroups& groups, int rank) {
  auto t = D(torch::ones({1024}, torch::kFloat));
  const std::string left_key = "abort_test/left";
  if (rank == 0) {
    const auto t0 = std::chrono::steady_clock::now();
    std::thread aborter([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      groups.abort("test: rank 1 is lost");
    });
    std::string error;
    try {
      groups.world().all_reduce(t);
    } catch (const CollectiveError& e) {
      error = e.what();
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    aborter.join();
    std::cout << "rank 0: the wait ended after " << waited << " s: " << error << std::endl;
    expect(!error.empty(), "the all_reduce rank 1 never joined throws CollectiveError");
    expect(waited >= 0.25 && waited < 5, "... once abort() is called (after " + std::to_string(waited) + " s), not at the timeout");
    expect(error.find("all_reduce") != std::string::npos && error.find("group 'world'") != std::string::npos,
           "... naming the operation and the group: " + error);
    expect(error.find("test: rank 1 is lost") != std::string::npos, "... and abort()'s reason: " + error);
    expect(groups.failed() && groups.world().failed(), "the groups say failed()");
    for (auto* g : {&groups.world(), &groups.along("x")}) {
      const auto t1 = std::chrono::steady_clock::now();
      std::string again;
      try {
        g->all_reduce(t);
      } catch (const CollectiveError& e) {
        again = e.what();
      }
      const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
      expect(again.find("failed before") != std::string::npos && again.find("test: rank 1 is lost") != std::string::npos &&
                 took < 0.5,
             "a later all_reduce on group '" + g->name() + "' throws at once naming the first failure (" +
                 std::to_string(took) + " s): " + again);
    }
    groups.store().set(left_key, "1");
  } else {
    groups.store().wait({left_key}, std::chrono::seconds(60));
    // Gloo: the collective rank 0 left is still queued on its worker thread; joining it lets
    // the thread end (the groups' destructors wait for it). NCCL: rank 0's communicators are
    // aborted, so there is nothing to join.
    if (!g_device.is_cuda()) {
      groups.world().all_reduce(t);
      expect(torch::equal(t.cpu(), torch::full({1024}, 2.0f)), "rank 1 completes the collective rank 0 left");
    } else {
      expect(true, "rank 1 stayed out of the aborted collective");
    }
  }
  std::cout << "rank " << rank << ": " << checks - failures << " of " << checks << " checks passed" << std::endl;
  return failures ? 1 : 0;
}

std::vector<MeshDim> parse_mesh(const std::string& text) {  // "dp=2,ep=2"
  std::vector<MeshDim> dims;
  std::size_t start = 0;
  while (start < text.size()) {
    auto comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    const auto item = text.substr(start, comma - start);
    const auto eq = item.find('=');
    if (eq == std::string::npos) throw std::invalid_argument("--mesh item '" + item + "' is not NAME=SIZE");
    dims.push_back({item.substr(0, eq), std::stoi(item.substr(eq + 1))});
    start = comma + 1;
  }
  return dims;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: kiln_parallel_worker collectives|loop [--mesh dp=2,ep=2] [--timeout-ms N]" << std::endl;
    return 2;
  }
  const std::string scenario = argv[1];
  std::vector<MeshDim> mesh;
  GroupOptions options;
  options.store_timeout = std::chrono::seconds(60);
  options.collective_timeout = std::chrono::seconds(10);
  for (int i = 2; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--mesh")) mesh = parse_mesh(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--device")) g_device = torch::Device(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--timeout-ms")) options.collective_timeout = std::chrono::milliseconds(std::stoll(argv[i + 1]));
    else { std::cerr << "unknown argument " << argv[i] << std::endl; return 2; }
  }
  int rank = -1;
  try {
    const auto info = read_launch_from_environment();
    rank = info.rank;
    if (g_device.is_cuda()) g_device = torch::Device(torch::kCUDA, int8_t(info.local_rank));
    ProcessGroups groups(info, g_device, mesh, options);
    std::cout << "rank " << rank << " launcher " << launcher_name(info.launcher) << " world " << info.world_size
              << " local " << info.local_rank << "/" << info.local_world_size << " agent_store "
              << info.use_agent_store << std::endl;
    if (scenario == "collectives") {
      check_group(groups.world());
      for (const auto& dim : groups.mesh().dims()) check_group(groups.along(dim.name));
      std::cout << "rank " << rank << ": " << checks - failures << " of " << checks << " checks passed" << std::endl;
      if (g_device.is_cuda()) {  // bus bandwidth of a 1 GiB fp32 all-reduce (NCCL's busbw: 2(w-1)/w x bytes / time)
        auto big = torch::ones({int64_t(1) << 28}, torch::TensorOptions().device(g_device).dtype(torch::kFloat));
        for (int i = 0; i < 3; ++i) groups.world().all_reduce(big);
        torch::cuda::synchronize();
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < 10; ++i) groups.world().all_reduce(big);
        torch::cuda::synchronize();
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 10;
        const double w = groups.world().size();
        std::cout << "rank " << rank << ": 1 GiB fp32 all_reduce " << s * 1e3 << " ms, bus bandwidth "
                  << 2 * (w - 1) / w * double(big.numel()) * 4 / s / 1e9 << " GB/s" << std::endl;
      }
      return failures ? 1 : 0;
    }
    if (scenario == "abort") return abort_scenario(groups, rank);
    if (scenario == "loop") {
      auto t = torch::ones({262144}, torch::kFloat);  // 1 MiB
      groups.world().all_reduce(t);
      std::cout << "rank " << rank << " looping" << std::endl;
      for (;;) groups.world().all_reduce(t);
    }
    std::cerr << "unknown scenario " << scenario << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "rank " << rank << ": error: " << e.what() << std::endl;
    return 3;
  }
}

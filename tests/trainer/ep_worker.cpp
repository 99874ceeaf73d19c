// One rank of the expert-parallel trainer test (tests/parallel/run_workers.py WORKER run --world W
// -- CASE EP starts W of them on 127.0.0.1). The world is a "dp" x "ep" mesh (dp = W / EP). Every
// rank builds the seeded debug model (8 experts, top-2, 2 MoE layers) twice: a one-rank Trainer
// (the reference, computed on every rank from the same batch) and an expert-parallel Trainer
// (batch split over all W ranks, experts split over ep, expert gradients over dp), feeds both
// the same deterministic random batches and checks, after every step:
//   - the metrics are equal on every rank, bit for bit, and equal to the reference's;
//   - the whole gradient (Trainer::whole_gradient: every rank's shards summed into the whole
//     model's flat index) equals the reference's;
//   - the whole parameters (dense ones as held; experts gathered over ep, gather_experts) are
//     equal on every rank, bit for bit, and equal the reference's;
//   - after the last step, policy().hf_state_dict() (collective over ep) equals the
//     reference's, name for name;
// (relative error = ||got - want|| / ||want|| <= 1e-5, fp32). Cases:
//   token_mean   KL (k3) and entropy terms, old log-probs given, the router's own choice
//   replay       routing replay of random given expert ids (distinct per token)
//   skewed       replay of experts {0, 1} only: every other ep rank's experts get zero rows
//   clip         gradient-norm clipping active on every step (one norm over dense + experts)
//   no_samples   W - 1 samples a step: a rank trains on none (padding micro-batches)
//   recompute    pi_old from the separate no-grad pass (each rank its share, padded), replayed
//   checkpoint   after 2 steps a checkpoint (each rank its part, no gather): resumed at one rank,
//                at the same mesh and data-parallel over the world, its weights (and its HF
//                export's) equal the trainer's; step 3 equals the continued trainer's (the same
//                mesh: bit for bit)
//   fsdp_CASE    CASE with the decoder layers' dense parameters fully sharded over the world
//                (parallel.fsdp; the experts stay split over ep), checked to gather by layer
//   hf_load      an HF checkpoint (the seeded model, written by rank 0) read per rank, each rank
//                building and reading only its ep rank's experts (model::Registry::build with
//                expert_slice_of), gives the trainer the same parameters, bit for bit, as the
//                whole model read and then sliced, and the same first step
// Prints "rank R: X of Y checks passed"; exit 0 when every check passed, 1 otherwise.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <iostream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>

#include "actors/trainer/checkpoint.hpp"
#include "actors/trainer/trainer.hpp"
#include "messaging/torch_tensor.hpp"
#include "model/blocks/moe_ep.hpp"
#include "model/registry.hpp"
#include "parallel/process_group.hpp"
#include "rank_checks.hpp"
#include "trainer_fixture.hpp"

using namespace kiln;
using namespace kiln::trainer;
using namespace kiln::test::rank_checks;

namespace {

struct Groups {
  parallel::Group &world, &dp, &ep;
};

// Deterministic random samples, the same on every rank. routing: "" none, "random" distinct
// random experts per token and layer, "skewed" experts {0, 1} only.
std::vector<Sample> make_batch(uint64_t seed, int count, const model::CausalLM& m, bool with_old,
                               const std::string& routing) {
  std::mt19937_64 rng(seed);
  auto integer = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  const int64_t vocab = m.vocab_size(), L = m.num_moe_layers(), K = m.experts_per_token(), E = 8;
  std::vector<Sample> out;
  for (int i = 0; i < count; ++i) {
    auto& s = out.emplace_back(random_sample(rng, vocab, with_old));
    if (routing.empty()) continue;
    const int64_t rows = s.tokens() - 1;  // [P + n - 1, L, K]
    s.routed_experts = torch::empty({rows, L, K}, torch::kInt64);
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t l = 0; l < L; ++l) {
        std::vector<int64_t> ids(static_cast<std::size_t>(E));
        std::iota(ids.begin(), ids.end(), int64_t{0});
        if (routing == "random") std::shuffle(ids.begin(), ids.end(), rng);
        else std::swap(ids[0], ids[std::size_t(integer(0, 1))]);  // {0, 1} in either order
        for (int64_t k = 0; k < K; ++k) s.routed_experts[t][l][k] = ids[std::size_t(k)];
      }
  }
  return out;
}

bool contains(const std::vector<torch::Tensor>& v, const torch::Tensor& t) {
  return std::any_of(v.begin(), v.end(), [&](const torch::Tensor& x) { return x.is_same(t); });
}

// [N] fp32: `pick` of every parameter of the reference, dense ones then experts, each in
// parameters() order (the EP trainer's two flat indices, experts whole).
template <typename Pick>
torch::Tensor reference_flat(Trainer& one, Pick pick) {
  auto experts = one.policy().routed_expert_parameters();
  std::vector<torch::Tensor> dense, expert;
  const auto params = one.policy().parameters();
  const auto& masters = one.master_parameters();  // fp32 policy: the parameters themselves
  for (std::size_t i = 0; i < params.size(); ++i) {
    auto v = pick(masters[i]);
    auto f = v.defined() ? v.detach().to(torch::kFloat32).reshape({-1}) : torch::zeros({params[i].numel()});
    (contains(experts, params[i]) ? expert : dense).push_back(f);
  }
  dense.insert(dense.end(), expert.begin(), expert.end());
  return torch::cat(dense);
}

// The EP trainer's whole parameters, as reference_flat lays them out (experts: gather_experts).
torch::Tensor whole_parameters(Groups& g, Trainer& t) {
  auto experts = t.policy().routed_expert_parameters();
  std::vector<torch::Tensor> dense, expert;
  for (const auto& p : t.policy().parameters()) {
    if (contains(experts, p)) expert.push_back(model::gather_experts(p, g.ep).to(torch::kFloat32).reshape({-1}));
    else dense.push_back(p.detach().to(torch::kFloat32).reshape({-1}));
  }
  dense.insert(dense.end(), expert.begin(), expert.end());
  return torch::cat(dense);
}

// grad_tolerance: the gradient's bound (the parameters' stays kTolerance).
void check_step(Groups& g, Trainer& one, Trainer& ep, const StepMetrics& got, const StepMetrics& want,
                const std::string& at, double grad_tolerance = kTolerance) {
  expect_step_metrics(g.world, got, want, at);
  expect(!got.skipped_nonfinite && !want.skipped_nonfinite, at + "a step was skipped");

  // Both in the whole model's flat index (Trainer::whole_gradient: every rank's shards, dense,
  // layers and expert slices, each at its place in the unsplit model's parameters).
  const double grad_err = relative_error(ep.whole_gradient(), one.whole_gradient());
  const auto params = whole_parameters(g, ep);
  auto all = gather_rows(g.world, params);
  for (int r = 1; r < g.world.size(); ++r)
    expect(torch::equal(all[r], all[0]), at + "parameters of rank " + std::to_string(r) + " differ from rank 0's");
  const double param_err = relative_error(params, reference_flat(one, [](const torch::Tensor& t) { return t; }));
  if (rank == 0)
    std::cout << "measured " << at << "loss " << got.loss << " grad_norm " << got.grad_norm << " micro_batches "
              << got.micro_batches << ": gradient relative error " << grad_err << ", parameter relative error "
              << param_err << std::endl;
  expect(grad_err <= grad_tolerance, at + "gradient relative error " + std::to_string(grad_err));
  expect(param_err <= kTolerance, at + "parameter relative error " + std::to_string(param_err));
}

// The HF weights (weight sync's source): collective over ep, the full experts on every rank.
void check_hf_state(model::CausalLM& ep_model, model::CausalLM& one_model) {
  const auto got = ep_model.hf_state_dict(), want = one_model.hf_state_dict();
  expect(got.size() == want.size(), "hf_state_dict has " + std::to_string(got.size()) + " tensors, one rank's " +
                                        std::to_string(want.size()));
  std::vector<torch::Tensor> a, b;
  for (std::size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    expect(got[i].name == want[i].name, "hf_state_dict tensor " + std::to_string(i) + " is '" + got[i].name +
                                            "', one rank's '" + want[i].name + "'");
    a.push_back(messaging::to_torch(got[i]).to(torch::kFloat32).reshape({-1}));
    b.push_back(messaging::to_torch(want[i]).to(torch::kFloat32).reshape({-1}));
  }
  const double err = relative_error(torch::cat(a), torch::cat(b));
  if (rank == 0) std::cout << "measured hf_state_dict relative error " << err << std::endl;
  expect(err <= kTolerance, "hf_state_dict relative error " + std::to_string(err));
}

bool fsdp = false;  // the fsdp_ prefix of the case

TrainerConfig config_for(const std::string& name) {
  TrainerConfig c;
  c.fsdp = fsdp;  // (no effect on the one-rank reference)
  c.lr = 1e-3;
  c.grad_clip = 0;
  c.logprobs.max_tokens_per_microbatch = 24;  // several micro-batches per rank
  if (name == "token_mean") {
    c.loss.kl_coef = 0.05;
    c.loss.entropy_coef = 0.01;
  } else if (name == "replay" || name == "skewed") {
    c.logprobs.routing_replay = true;
  } else if (name == "clip") {
    c.grad_clip = 0.05;
  } else if (name == "recompute") {
    c.recompute_old_logprobs = true;
    // Replayed: without replay, at world 4 ep 4 step 2's gradient differs by 1.1e-5, traced to
    // AdamW's first step on an embedding element whose gradient (1.4e-8) is near AdamW's eps,
    // where fp32 noise of 4e-10 moves the update by 3% (the dp trainer measures 2.8e-6 there).
    c.logprobs.routing_replay = true;
  } else if (name == "checkpoint") {
    c.logprobs.routing_replay = true;
  } else if (name != "no_samples") {
    throw std::invalid_argument("unknown case '" + name + "'");
  }
  return c;
}

// The policy's parameters, dense ones then experts, each in parameters() order (reference_flat's
// layout) for a trainer whose policy holds all of them (one rank, data parallel).
torch::Tensor whole_policy(model::CausalLM& m) {
  auto experts = m.routed_expert_parameters();
  std::vector<torch::Tensor> dense, expert;
  for (const auto& p : m.parameters())
    (contains(experts, p) ? expert : dense).push_back(p.detach().to(torch::kFloat32).reshape({-1}));
  dense.insert(dense.end(), expert.begin(), expert.end());
  return torch::cat(dense);
}

// Two steps of the expert-parallel trainer, a checkpoint (every rank writes its part: its HF
// experts, its optimizer parts), then step 3 four ways: the trainer continued, and trainers of
// other weights resumed from the checkpoint at one rank, at the same mesh, and data-parallel
// over the whole world.
void run_checkpoint(Groups& g, const TrainerConfig& c) {
  namespace fs = std::filesystem;
  auto ep_model = test::debug_model(7);
  Trainer ep(ep_model, c, g.world, ExpertParallel{&g.ep, &g.dp});
  std::vector<std::vector<Sample>> batches;
  for (int s = 0; s < 3; ++s) batches.push_back(make_batch(uint64_t(10 * s + 1), 7, *ep_model, true, "random"));
  for (int s = 0; s < 2; ++s) (void)ep.step(batches[std::size_t(s)]);
  const char* port = std::getenv("MASTER_PORT");
  const fs::path dir = fs::temp_directory_path() / ("kiln_ep_checkpoint_" + std::string(port ? port : "0"));
  save_checkpoint(dir, *ep_model, ep, CheckpointState{2, ep.version(), "rng", ""});
  const auto saved = whole_parameters(g, ep);

  auto one_model = test::debug_model(99), same_model = test::debug_model(99), dp_model = test::debug_model(99);
  Trainer one(one_model, c), same(same_model, c, g.world, ExpertParallel{&g.ep, &g.dp}), dp(dp_model, c, &g.world);
  for (auto* t : {&one, &same, &dp}) {
    const auto st = load_checkpoint(dir, t->policy(), *t);
    expect(st.step == 2 && t->version() == ep.version(), "checkpoint: step or version not resumed");
  }
  expect(torch::equal(whole_policy(*one_model), saved), "checkpoint: one rank's resumed weights differ");
  expect(torch::equal(whole_policy(*dp_model), saved), "checkpoint: the data-parallel resumed weights differ");
  expect(torch::equal(whole_parameters(g, same), saved), "checkpoint: the same mesh's resumed weights differ");
  {  // the HF export alone (model-0000k-of-0000P.safetensors, one per ep rank, and its index)
    auto hf = test::debug_model(99);
    hf->load_hf_checkpoint(dir.string());
    expect(torch::equal(whole_policy(*hf), saved), "checkpoint: the HF export's weights differ");
  }

  const auto want = one.step(batches[2]);
  const auto got = ep.step(batches[2]);
  check_step(g, one, ep, got, want, "checkpoint: step 3 continued vs resumed at one rank: ");
  const auto again = same.step(batches[2]);
  expect(again.loss == got.loss && again.grad_norm == got.grad_norm && again.entropy == got.entropy,
         "checkpoint: step 3 resumed at the same mesh differs from the continued one");
  expect(torch::equal(whole_parameters(g, same), whole_parameters(g, ep)),
         "checkpoint: parameters after step 3 resumed at the same mesh differ from the continued ones");
  const auto dpm = dp.step(batches[2]);
  expect_close(dpm.loss, want.loss, "checkpoint: step 3 resumed data-parallel: loss");
  expect_close(dpm.grad_norm, want.grad_norm, "checkpoint: step 3 resumed data-parallel: grad_norm");
  const double err = relative_error(whole_policy(*dp_model), whole_policy(*one_model));
  if (rank == 0) std::cout << "measured checkpoint: parameters after step 3 resumed data-parallel vs one rank: relative error " << err << std::endl;
  expect(err <= kTolerance, "checkpoint: parameters after step 3 resumed data-parallel: relative error " + std::to_string(err));
  // Damaged copies: every rank refuses at once, naming what is wrong (no rank left waiting in a
  // collective), and the copy is left as it was.
  auto refused = [&](const std::string& what, const std::function<void(const fs::path&)>& damage,
                     const std::string& named) {
    const fs::path bad = dir.string() + "_" + what;
    if (rank == 0) {
      fs::remove_all(bad);
      fs::copy(dir, bad, fs::copy_options::recursive);
      damage(bad);
    }
    g.world.barrier();
    auto t = test::debug_model(99);
    Trainer fresh(t, c, g.world, ExpertParallel{&g.ep, &g.dp});
    std::string error;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      (void)load_checkpoint(bad, *t, fresh);
    } catch (const std::exception& e) {
      error = e.what();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rank == 0) std::cout << "refused (" << what << ", " << s << " s): " << error << std::endl;
    expect(!error.empty() && s < 20, "checkpoint " + what + ": not refused within 20 s (" + std::to_string(s) + " s)");
    expect(error.find(named) != std::string::npos || error.find("could not read its part") != std::string::npos,
           "checkpoint " + what + ": the error does not name '" + named + "': " + error);
    g.world.barrier();
    if (rank == 0) fs::remove_all(bad);
  };
  const auto shard0 = std::string("optimizer_shard_00000_of_") + (g.world.size() == 2 ? "00002" : "00004");
  refused("truncated", [&](const fs::path& d) { fs::resize_file(d / (shard0 + ".pt"), 300); }, shard0 + ".pt");
  refused("no_ranges", [&](const fs::path& d) { fs::remove(d / (shard0 + ".json")); }, shard0 + ".json");
  refused("no_buffers", [&](const fs::path& d) { fs::remove(d / "buffers.pt"); }, "buffers.pt");
  refused("other_ranges", [&](const fs::path& d) {
    std::ifstream in(d / (shard0 + ".json"));
    std::string text((std::istreambuf_iterator<char>(in)), {});
    in.close();
    const auto at = text.find("[[0,");
    text.replace(at, 4, "[[1,");
    std::ofstream(d / (shard0 + ".json")) << text;
  }, shard0 + ".json");
  g.world.barrier();
  if (rank == 0) fs::remove_all(dir);
}

// Parameters by name, bit for bit (experts: this rank's slices).
void expect_same_parameters(model::CausalLM& got, model::CausalLM& want, const std::string& at) {
  auto w = want.named_parameters();
  for (const auto& p : got.named_parameters()) {
    const auto* other = w.find(p.key());
    expect(other && other->sizes() == p.value().sizes() && torch::equal(*other, p.value()),
           at + "parameter '" + p.key() + "' differs from the whole model's, read then sliced");
  }
  expect(got.named_parameters().size() == w.size(), at + "the parameter counts differ");
}

void run_hf_load(Groups& g, parallel::ProcessGroups& groups) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("kiln_ep_hf_load_" + std::string(std::getenv("MASTER_PORT") ? std::getenv("MASTER_PORT") : "0"));
  if (rank == 0) {
    std::filesystem::remove_all(dir);
    test::debug_model(7)->save_hf_checkpoint(dir.string(), 1 << 14);  // several shards
  }
  g.world.barrier();
  const auto c = config_for("replay");
  model::ModelSpec spec;
  spec.checkpoint = dir.string();
  const auto registry = model::Registry::with_builtins();
  auto whole = registry.build(spec);
  auto sliced = registry.build(spec, expert_slice_of(&groups));
  const int64_t E = 8, El = E / g.ep.size();
  expect(whole->routed_expert_parameters().front().size(0) == E, "the whole model does not hold all 8 experts");
  expect(sliced->routed_expert_parameters().front().size(0) == El &&
             sliced->expert_slice().rank == g.ep.rank() && sliced->expert_slice().ranks == g.ep.size(),
         "the model read per rank does not hold ep rank " + std::to_string(g.ep.rank()) + "'s " + std::to_string(El) +
             " experts");
  Trainer from_whole(whole, c, g.world, ExpertParallel{&g.ep, &g.dp});
  Trainer from_slice(sliced, c, g.world, ExpertParallel{&g.ep, &g.dp});
  expect_same_parameters(*sliced, *whole, "hf_load at start: ");
  const auto batch = make_batch(11, 7, *whole, true, "random");
  const auto want = from_whole.step(batch);
  const auto got = from_slice.step(batch);
  expect(got.loss == want.loss && got.grad_norm == want.grad_norm,
         "hf_load step 1: loss/grad norm " + std::to_string(got.loss) + "/" + std::to_string(got.grad_norm) +
             " differ from the whole model's " + std::to_string(want.loss) + "/" + std::to_string(want.grad_norm));
  expect_same_parameters(*sliced, *whole, "hf_load after step 1: ");
  g.world.barrier();
  if (rank == 0) std::filesystem::remove_all(dir);
}

void run_case(Groups& g, const std::string& name) {
  const auto c = config_for(name);
  if (name == "checkpoint") return run_checkpoint(g, c);
  auto one_model = test::debug_model(7), ep_model = test::debug_model(7);
  Trainer one(one_model, c), ep(ep_model, c, g.world, ExpertParallel{&g.ep, &g.dp});
  const int64_t E = one_model->config().moe.num_experts;
  expect(ep_model->routed_expert_parameters().front().size(0) == E / g.ep.size(),
         "the expert slices are not E / ep = " + std::to_string(E / g.ep.size()) + " experts");
  const int count = name == "no_samples" ? g.world.size() - 1 : 7;
  const bool with_old = name != "recompute";
  const std::string routing = name == "replay" || name == "recompute" ? "random" : name == "skewed" ? "skewed" : "";
  for (int s = 0; s < 3; ++s) {
    const auto at = name + " step " + std::to_string(s + 1) + ": ";
    const auto batch = make_batch(uint64_t(10 * s + 1), count, *one_model, with_old, routing);
    const auto want = one.step(batch);
    const int64_t gathers = ep.fully_sharded() ? ep.fully_sharded()->layer_gathers() : 0;
    const auto got = ep.step(batch);
    // skewed: every token on experts 0 and 1, so those two experts' gradients sum the whole
    // batch's rows; after step 1's update (parameters within 8.8e-7 of one rank's) step 2's
    // gradient differs by 1.46e-5 on the AMD EPYC CI machine (2026-12-02; the same value with
    // the model code of 59b7459, so not a change of the model), 7e-8 at step 1. The parameters
    // keep kTolerance.
    check_step(g, one, ep, got, want, at, name == "skewed" && s > 0 ? 5e-5 : kTolerance);
    expect(fsdp == (ep.fully_sharded() != nullptr), at + "fully sharded is not as asked");
    if (fsdp)
      expect(ep.fully_sharded()->layer_gathers() - gathers >=
                 got.micro_batches / g.world.size() * (2 * ep_model->num_layers() - 1),
             at + "the layers were not gathered for every micro-batch's forward and backward");
    if (name == "clip")
      expect(want.grad_norm > c.grad_clip, at + "clipping is not active (grad norm " + std::to_string(want.grad_norm) +
                                               " <= clip " + std::to_string(c.grad_clip) + "): the case tests nothing");
  }
  expect(ep.version() == one.version(), name + ": version differs");
  check_hf_state(*ep_model, *one_model);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: kiln_trainer_ep_worker [fsdp_]token_mean|replay|skewed|clip|no_samples|recompute|checkpoint|hf_load EP"
              << std::endl;
    return 2;
  }
  try {
    torch::set_num_threads(1);
    auto owned = dp_ep_groups(argv[2]);
    auto& groups = *owned;
    Groups g{groups.world(), groups.along("dp"), groups.along("ep")};
    std::string name = argv[1];
    if (name.rfind("fsdp_", 0) == 0) {
      fsdp = true;
      name = name.substr(5);
    }
    if (name == "hf_load") run_hf_load(g, groups);
    else run_case(g, name);
    std::cout << "rank " << rank << ": " << checks - failures << " of " << checks << " checks passed" << std::endl;
    return failures ? 1 : 0;
  } catch (const std::exception& e) {
    std::cerr << "rank " << rank << ": error: " << e.what() << std::endl;
    return 3;
  }
}

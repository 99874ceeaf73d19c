// One rank of the data-parallel trainer test (tests/parallel/run_workers.py WORKER run --world W
// -- CASE starts W of them on 127.0.0.1). Every rank builds the seeded debug model twice: a
// one-rank Trainer (the world-1 reference, computed on every rank from the same batch) and a
// Trainer over the dp group (dp = world), feeds both the same deterministic random batches and
// checks, after every step:
//   - the metrics are equal on every rank, bit for bit, and equal to the reference's;
//   - the whole gradient (this rank's shard, all-gathered) equals the reference's;
//   - every rank's parameters are equal, bit for bit, and equal the reference's;
// (relative error = ||got - want|| / ||want|| <= 1e-5, fp32; a later step's gradient within
// 1e-5 + 20x how far apart the parameters were before it, parameters_apart). Cases:
//   token_mean     KL (k3) and entropy terms, old log-probs given, no clipping, 3 steps
//   sequence_mean  pi_old from the forward (ratio 1), TIS weights, no clipping, 3 steps
//   clip           gradient-norm clipping active on every step (checked), 3 steps
//   few_samples    3 samples per step (at world 4 a rank trains on none), 3 steps
//   recompute      pi_old from the separate no-grad pass (Trainer::step; with dp each rank
//                  computes its share), 3 steps
//   bf16           a bf16 policy (fp32 masters), 3 steps; equal within 1e-5 at world 1 only (at
//                  more ranks the one-rank trainer's bf16 gradient sums differ ~3e-3)
//   nonfinite      a NaN behaviour log-prob: every rank refuses the batch and nothing changes;
//                  a sample whose loss overflows (-inf), trained by one rank only: every rank
//                  skips the step and nothing changes anywhere; then 2 more steps stay equal
//   refusals       ranks given different batches all refuse the step, naming the difference,
//                  and nothing changes (the next step, on equal batches, equals one rank's)
//   checkpoint     (even world, mesh x=2 by dp=W/2) sharded checkpoints saved at dp W and
//                  loaded at dp W/2 and one rank, saved at dp W/2 and one rank and loaded at
//                  dp W: the next step equals the reference's; a shard missing is refused by name
//   checkpoint_bf16  a bf16 policy's sharded checkpoint, reloaded at the same ranks and via a
//                  one-rank trainer's checkpoint: the next step bit for bit as without them
//   activation_checkpointing  token_mean with activation checkpointing per layer (both trainers)
//   reduce_bf16    token_mean with the dp trainer's gradients reduce-scattered in bf16
//                  (parallel.reduce_dtype): one step; loss and metrics within 1e-5; at world > 1
//                  the whole gradient differs from one rank's by bf16 rounding (1e-5 < error <=
//                  1e-2: above fp32 noise, so the reduction is shown to run in bf16), the
//                  grad_norm metric within 1e-3 and the parameters within 1e-3; at world 1
//                  nothing is reduced (within 1e-5)
//   fsdp_keep_CASE CASE with the dp trainers' layers kept whole through the step, each layer's
//                  gradients reduced as its backward ends (parallel.reshard_after_forward false)
//   fsdp_CASE      CASE with the dp trainers fully sharded (parallel.fsdp: the decoder layers
//                  gathered layer by layer in the forward and backward; checked to happen, every
//                  step); checkpoint: the dp-W/2 trainers are not sharded so (checkpoints move
//                  between the two layouts)
// Prints "rank R: X of Y checks passed"; exit 0 when every check passed, 1 otherwise.
#include <cmath>
#include <filesystem>
#include <iostream>
#include <limits>
#include <random>
#include <sstream>
#include <string>

#include "actors/trainer/checkpoint.hpp"
#include "actors/trainer/trainer.hpp"
#include "parallel/process_group.hpp"
#include "rank_checks.hpp"
#include "trainer_fixture.hpp"

using namespace kiln;
using namespace kiln::trainer;
using namespace kiln::test::rank_checks;

namespace {

// Deterministic random samples, the same on every rank: lengths vary, ids in [2, vocab).
std::vector<Sample> make_batch(uint64_t seed, int count, int64_t vocab, bool with_old) {
  std::mt19937_64 rng(seed);
  std::vector<Sample> out;
  for (int i = 0; i < count; ++i) out.push_back(random_sample(rng, vocab, with_old));
  return out;
}

// [N] fp32: `pick(i)` of every parameter or master i, flattened in order (zeros where undefined).
template <typename Pick>
torch::Tensor flat(const std::vector<torch::Tensor>& tensors, Pick pick) {
  std::vector<torch::Tensor> parts;
  for (const auto& t : tensors) {
    auto v = pick(t);
    parts.push_back(v.defined() ? v.detach().to(torch::kFloat32).reshape({-1}) : torch::zeros({t.numel()}));
  }
  return torch::cat(parts);
}

struct Pair {
  parallel::Group& dp;
  Trainer& one;      // one rank (the reference)
  Trainer& sharded;  // over dp
};

bool reduce_bf16 = false;  // the reduce_bf16 case at world > 1: bf16 rounding allowed (and required)
// How far apart the two trainers' parameters were after the last step (check_parameters). From the
// second step on both gradients are taken at parameters that differ by the first steps' rounding,
// so the gradient may differ by that much times the loss's conditioning: the sequence_mean case
// measured 1.44e-5 at step 2 after 2.17e-6 apart (x6.6; AMD EPYC, 2026-12-07), over 1e-5. The
// gradient's tolerance is kTolerance + kConditioning * parameters_apart; a lost or doubled rank's
// share stays ~1e-1.
double parameters_apart = 0;
constexpr double kConditioning = 20;

void check_metrics(Pair& p, const StepMetrics& got, const StepMetrics& want_, const std::string& at) {
  auto want = want_;
  if (reduce_bf16) {  // the norm of a bf16-reduced gradient: within bf16 rounding, the rest as always
    const double err = std::abs(got.grad_norm - want.grad_norm) / std::abs(want.grad_norm);
    expect(err <= 1e-3, at + "grad_norm relative error " + std::to_string(err) + " of a bf16 reduction");
    want.grad_norm = got.grad_norm;
  }
  expect_step_metrics(p.dp, got, want, at);
  expect(got.skipped_nonfinite == want.skipped_nonfinite, at + "skip decision differs from one rank's");
}

// The whole gradient: shards all-gathered, against the reference's master gradients.
void check_gradient(Pair& p, const std::string& at) {
  const auto full = p.sharded.whole_gradient();
  const auto want = flat(p.one.master_parameters(), [](const torch::Tensor& t) { return t.grad(); });
  const double err = relative_error(full, want);
  if (rank == 0) std::cout << "measured " << at << "gradient relative error " << err << std::endl;
  if (reduce_bf16)
    expect(err > kTolerance && err <= 1e-2,
           at + "gradient relative error " + std::to_string(err) + " of a bf16 reduction, not in (1e-5, 1e-2]");
  else
    expect(err <= kTolerance + kConditioning * parameters_apart,
           at + "gradient relative error " + std::to_string(err) + " (parameters " + std::to_string(parameters_apart) +
               " apart before the step)");
}

void check_parameters(Pair& p, const std::string& at) {
  auto get = [](const torch::Tensor& t) { return t; };
  const auto mine = flat(p.sharded.policy().parameters(), get);
  auto rows = gather_rows(p.dp, mine);
  for (int r = 1; r < p.dp.size(); ++r)
    expect(torch::equal(rows[r], rows[0]), at + "parameters of rank " + std::to_string(r) + " differ from rank 0's");
  const double err = relative_error(mine, flat(p.one.policy().parameters(), get));
  if (rank == 0) std::cout << "measured " << at << "parameter relative error " << err << std::endl;
  expect(err <= (reduce_bf16 ? 1e-3 : kTolerance), at + "parameter relative error " + std::to_string(err));
  parameters_apart = err;
}

bool fsdp = false;  // the fsdp_ prefix of the case: dp trainers fully sharded
bool keep = false;  // the fsdp_keep_ prefix: reshard_after_forward = false

TrainerConfig config_for(const std::string& name) {
  TrainerConfig c;
  c.fsdp = fsdp;  // (no effect on the one-rank reference)
  c.reshard_after_forward = !keep;
  c.lr = 1e-3;
  c.grad_clip = 0;
  c.logprobs.max_tokens_per_microbatch = 24;  // several micro-batches per rank
  if (name == "token_mean" || name == "nonfinite") {
    c.loss.kl_coef = 0.05;
    c.loss.entropy_coef = 0.01;
  } else if (name == "sequence_mean") {
    c.loss.aggregation = "sequence_mean";
  } else if (name == "clip") {
    c.grad_clip = 0.05;
  } else if (name == "recompute") {
    c.recompute_old_logprobs = true;
  } else if (name == "reduce_bf16") {
    c.loss.kl_coef = 0.05;
    c.reduce_dtype = "bf16";
  } else if (name == "activation_checkpointing") {
    c.loss.kl_coef = 0.05;
    c.activation_checkpointing = true;
  } else if (name != "few_samples" && name != "refusals" && name != "bf16") {
    throw std::invalid_argument("unknown case '" + name + "'");
  }
  return c;
}

// A step already taken by both trainers, every check.
void check_after_load(Pair& p, const StepMetrics& got, const StepMetrics& want, const std::string& at) {
  check_metrics(p, got, want, at);
  check_gradient(p, at);
  check_parameters(p, at);
}

// One step on both trainers (Trainer::step, which runs the separate pi_old pass when the
// config asks for it, else train_step), every check.
StepMetrics step_both(Pair& p, const std::vector<Sample>& batch, const std::string& at) {
  const auto want = p.one.step(batch);
  const auto* layers = p.sharded.fully_sharded();
  expect(fsdp == (layers != nullptr), at + (fsdp ? "the trainer is not fully sharded" : "the trainer is fully sharded"));
  const int64_t gathers = layers ? layers->layer_gathers() : 0, reductions = layers ? layers->layer_reductions() : 0;
  const auto got = p.sharded.step(batch);
  if (layers) {  // every micro-batch gathered every layer (and the head) for its forward and its backward
    const int64_t layer_count = int64_t(p.sharded.policy().decoder_layer_parameters().size()), done = layers->layer_gathers() - gathers,
                  head = p.sharded.policy().head_parameters().empty() ? 0 : 1,
                  mine = got.micro_batches / p.dp.size();  // at least what this rank ran
    expect(head == 1, at + "the debug model lists no head parameters: the head unit is not tested");
    if (keep) expect(done == 0, at + std::to_string(done) + " layer gathers inside a step that keeps the layers whole");
    else
      expect(done >= mine * (2 * layer_count - 1 + head),
             at + std::to_string(done) + " layer gathers in a step of " + std::to_string(got.micro_batches) +
                 " micro-batches over " + std::to_string(layer_count) + " layers and the head");
    expect(layers->layer_reductions() - reductions >= mine * (layer_count + head),
           at + "not every micro-batch's backward reduced every layer's and the head's gradients");
  }
  check_metrics(p, got, want, at);
  if (!got.skipped_nonfinite) check_gradient(p, at);
  check_parameters(p, at);
  return want;
}

// Checkpoints of a bf16 policy (fp32 masters): a dp-W trainer trains 2 steps and saves; a
// one-rank trainer loads it and saves in the one-rank format (optimizer.pt, master_weights.pt);
// a dp-W trainer loads that and another the sharded one, each from another initialisation.
// Both must take step 3 bit for bit as the uninterrupted trainer does (the same ranks, the same
// packing: every value is copied, none recomputed).
void run_checkpoint_bf16(parallel::Group& dp) {
  const auto c = config_for("token_mean");
  const char* port = std::getenv("MASTER_PORT");
  const auto root =
      std::filesystem::temp_directory_path() / ("kiln_dp_checkpoint_bf16_" + std::string(port ? port : "0"));
  auto bf16_model = [](uint64_t seed) {
    auto m = test::debug_model(seed);
    m->to_dtype(torch::kBFloat16);
    return m;
  };
  auto a_model = bf16_model(7);
  Trainer a(a_model, c, &dp);
  const int64_t vocab = a_model->vocab_size();
  for (int s = 0; s < 2; ++s) a.step(make_batch(uint64_t(10 * s + 1), 7, vocab, true));
  save_checkpoint(root / "sharded", *a_model, a, CheckpointState{2, a.version(), "rng"});
  if (dp.rank() == 0) {
    auto one_model = bf16_model(99);
    Trainer one(one_model, c);
    load_checkpoint(root / "sharded", *one_model, one);
    expect(one.uses_master_weights(), "the bf16 one-rank trainer has no fp32 masters");
    save_checkpoint(root / "one", *one_model, one, CheckpointState{2, one.version(), "rng"});
    expect(std::filesystem::exists(root / "one" / "master_weights.pt"), "the one-rank save wrote no master_weights.pt");
  }
  dp.barrier();
  auto b_model = bf16_model(99), e_model = bf16_model(99);
  Trainer b(b_model, c, &dp), e(e_model, c, &dp);
  load_checkpoint(root / "sharded", *b_model, b);
  load_checkpoint(root / "one", *e_model, e);
  const auto batch = make_batch(21, 7, vocab, true);
  const auto want = a.step(batch);
  auto get = [](const torch::Tensor& t) { return t; };
  const auto want_params = flat(a.policy().parameters(), get);
  const auto want_masters = flat(a.master_parameters(), get);
  const std::vector<std::pair<std::string, Trainer*>> loaded{{"sharded -> same ranks", &b},
                                                              {"sharded -> one rank -> dp", &e}};
  for (const auto& [name, t] : loaded) {
    const auto got = t->step(batch);
    const std::string at = "bf16 " + name + " then step 3: ";
    expect(got.loss == want.loss && got.grad_norm == want.grad_norm,
           at + "loss " + std::to_string(got.loss) + " / grad_norm " + std::to_string(got.grad_norm) +
               " differ from the uninterrupted " + std::to_string(want.loss) + " / " + std::to_string(want.grad_norm));
    expect(torch::equal(flat(t->policy().parameters(), get), want_params), at + "parameters differ (bit for bit)");
    expect(torch::equal(flat(t->master_parameters(), get), want_masters), at + "fp32 masters differ (bit for bit)");
  }
  dp.barrier();
  if (rank == 0) std::filesystem::remove_all(root);
}

// Checkpoints between world sizes, on a 2 x W/2 mesh ("x" by "dp"): a dp-W trainer (the world)
// trains 2 steps and saves; a dp-W/2 trainer (each "dp" group) and a one-rank trainer, both
// from another initialisation, load it (W -> W/2, W -> 1); step 3 of each equals the one-rank
// reference's. The dp-W/2 trainers save (one checkpoint per dp group) and the reference saves
// in the one-rank format; dp-W trainers load each (W/2 -> W, 1 -> W); step 4 equals the
// reference's.
void run_checkpoint(parallel::ProcessGroups& groups) {
  auto& world = groups.world();
  auto& half = groups.along("dp");
  const std::string w = "dp" + std::to_string(world.size()), h = "dp" + std::to_string(half.size());
  const auto c = config_for("token_mean");
  const char* port = std::getenv("MASTER_PORT");  // one directory for the job, another per job
  const auto root = std::filesystem::temp_directory_path() / ("kiln_dp_checkpoint_" + std::string(port ? port : "0"));
  auto ref_model = test::debug_model(7);
  const int64_t vocab = ref_model->vocab_size();
  auto batch = [&](int s) { return make_batch(uint64_t(10 * s + 1), 7, vocab, true); };
  Trainer ref(ref_model, c);
  auto a_model = test::debug_model(7);
  Trainer a(a_model, c, &world);
  for (int s = 0; s < 2; ++s) {
    const auto b = batch(s);
    ref.step(b);
    a.step(b);
  }
  save_checkpoint(root / "dp4", *a_model, a, CheckpointState{2, a.version(), "rng"});

  auto b_model = test::debug_model(99), c_model = test::debug_model(99);
  auto half_config = c;
  half_config.fsdp = false;  // with fsdp_: checkpoints move between the fully sharded layout and not
  Trainer b(b_model, half_config, &half), one(c_model, c);
  const auto loaded_b = load_checkpoint(root / "dp4", *b_model, b);
  load_checkpoint(root / "dp4", *c_model, one);
  expect(loaded_b.step == 2 && b.version() == 2 && one.version() == 2,
         w + " -> " + h + ", " + w + " -> one rank: step or version not restored");
  const auto b3 = batch(2);
  const auto want3 = ref.step(b3);
  Pair pb{half, ref, b};
  check_after_load(pb, b.step(b3), want3, w + " -> " + h + " then step 3: ");
  const auto got3 = one.step(b3);
  expect_close(got3.loss, want3.loss, w + " -> one rank then step 3: loss");
  expect_close(got3.grad_norm, want3.grad_norm, w + " -> one rank then step 3: grad_norm");
  auto get = [](const torch::Tensor& t) { return t; };
  const double err = relative_error(flat(one.policy().parameters(), get), flat(ref.policy().parameters(), get));
  if (rank == 0)
    std::cout << "measured " << w << " -> one rank then step 3: parameter relative error " << err << std::endl;
  expect(err <= kTolerance, w + " -> one rank then step 3: parameter relative error " + std::to_string(err));

  const auto x = std::to_string(groups.mesh().coords(rank)[0]);
  save_checkpoint(root / ("dp2_x" + x), *b_model, b, CheckpointState{3, b.version(), "rng"});
  if (rank == 0) save_checkpoint(root / "one", *ref_model, ref, CheckpointState{3, ref.version(), "rng"});
  world.barrier();
  auto d_model = test::debug_model(99), e_model = test::debug_model(99);
  Trainer d(d_model, c, &world), e(e_model, c, &world);
  load_checkpoint(root / "dp2_x0", *d_model, d);
  load_checkpoint(root / "one", *e_model, e);
  const auto b4 = batch(3);
  const auto want4 = ref.step(b4);
  Pair pd{world, ref, d}, pe{world, ref, e};
  check_after_load(pd, d.step(b4), want4, h + " -> " + w + " then step 4: ");
  check_after_load(pe, e.step(b4), want4, "one rank -> " + w + " then step 4: ");
  if (rank == 0) {  // the world's checkpoint without the shard of rank 1: refused by name
    namespace fs = std::filesystem;
    fs::copy(root / "dp4", root / "broken");
    char missing[64];
    std::snprintf(missing, sizeof missing, "optimizer_shard_00001_of_%05d.pt", world.size());
    fs::remove(root / "broken" / missing);
    auto f_model = test::debug_model(99);
    Trainer f(f_model, c);
    std::string error;
    try {
      load_checkpoint(root / "broken", *f_model, f);
    } catch (const std::invalid_argument& ex) {
      error = ex.what();
    }
    std::cout << "refused: " << error << std::endl;
    expect(error.find(std::string("lacks ") + missing) != std::string::npos,
           "a checkpoint lacking a shard was not refused by name: '" + error + "'");
  }
  world.barrier();
  if (rank == 0) std::filesystem::remove_all(root);
}


// Different batches per rank: all refused, nothing changed; then a step on equal batches still
// equals one rank's (no rank was left inside a collective).
void run_refusals(Pair& p, int count, int64_t vocab) {
  const bool with_old = true;
  const auto before = test::snapshot(p.sharded);
  // Rank 0's batch differs from the others' (at world 1 there are no others: no error):
  // another batch altogether, then one advantage only (same counts: only the hash differs).
  for (const char* differs : {"token counts", "content hashes"}) {
    auto batch = make_batch(rank == 0 || differs == std::string("content hashes") ? 5 : 6, count, vocab, with_old);
    if (differs == std::string("content hashes") && rank == 0) batch[2].advantage += 0.25f;
    std::string error;
    try {
      p.sharded.train_step(batch);
    } catch (const std::invalid_argument& e) {
      error = e.what();
    }
    if (p.dp.size() == 1) {
      expect(error.empty(), "one rank's batch was refused: " + error);
      return;  // (its step was taken)
    }
    expect(error.find("were given different batches: their " + std::string(differs)) != std::string::npos &&
               error.find(p.dp.name()) != std::string::npos,
           std::string("batches whose ") + differs + " differ were not refused naming the group: '" + error + "'");
    expect(test::differences(before, test::snapshot(p.sharded)).empty(), "the refused batches changed the trainer");
    if (rank == 0) std::cout << "refused on every rank: " << error << std::endl;
  }
  step_both(p, make_batch(1, count, vocab, with_old), "refusals then a step: ");
  return;
}

void run_case(parallel::Group& dp, const std::string& name) {
  const auto c = config_for(name);
  auto one_model = test::debug_model(7), sharded_model = test::debug_model(7);
  if (name == "bf16") {  // bf16 parameters, fp32 masters (sharded over dp)
    one_model->to_dtype(torch::kBFloat16);
    sharded_model->to_dtype(torch::kBFloat16);
  }
  Trainer one(one_model, c), sharded(sharded_model, c, &dp);
  Pair p{dp, one, sharded};
  const int64_t vocab = one_model->vocab_size();
  const int count = name == "few_samples" ? 3 : 7;
  const bool with_old = name != "sequence_mean" && name != "recompute";
  if (name == "refusals") return run_refusals(p, count, vocab);
  reduce_bf16 = name == "reduce_bf16" && dp.size() > 1;
  for (int s = 0; s < (name == "reduce_bf16" ? 1 : 3); ++s) {
    const auto at = name + " step " + std::to_string(s + 1) + ": ";
    if (name == "nonfinite" && s == 1) {
      auto before = test::snapshot(sharded);
      auto nan_batch = make_batch(100 + s, count, vocab, with_old);
      nan_batch[4].behavior_logprobs.back() = std::numeric_limits<float>::quiet_NaN();
      std::string error;
      try {
        sharded.train_step(nan_batch);
      } catch (const std::invalid_argument& e) {
        error = e.what();
      }
      expect(error.find("sample 4 has a non-finite value in behaviour log-probs") != std::string::npos,
             at + "a NaN behaviour log-prob was not refused by name: '" + error + "'");
      expect(test::differences(before, test::snapshot(sharded)).empty(), at + "the refused batch changed the trainer");

      // The overflowing sample: the longest completion of the last rank's share (rank 0's at
      // world 1), so that the other ranks see only finite values of their own.
      auto huge = make_batch(200 + s, count, vocab, with_old);
      const auto last_share = split_samples(huge, dp.size()).back();
      std::size_t longest = last_share.front();
      for (auto i : last_share)
        if (huge[i].completion.size() > huge[longest].completion.size()) longest = i;
      huge[longest].advantage = 3e38f;  // the token sum of -A * ratio overflows on its rank: loss -inf
      if (rank == 0)
        std::cout << "overflowing sample " << longest << " (" << huge[longest].completion.size()
                  << " tokens) is trained by rank " << dp.size() - 1 << std::endl;
      const auto m = step_both(p, huge, at + "overflow: ");
      expect(m.skipped_nonfinite, at + "the one-rank reference did not skip the overflowing step");
      expect(test::differences(before, test::snapshot(sharded)).empty(), at + "the skipped step changed the trainer");
      if (rank == 0) std::cout << "skipped on every rank: " << m.skip_reason << std::endl;
    }
    const auto m = step_both(p, make_batch(uint64_t(10 * s + 1), count, vocab, with_old), at);
    if (name == "clip")
      expect(m.grad_norm > c.grad_clip, at + "clipping is not active (grad norm " + std::to_string(m.grad_norm) +
                                            " <= clip " + std::to_string(c.grad_clip) + "): the case tests nothing");
    if (rank == 0)
      std::cout << "measured " << at << "loss " << m.loss << " grad_norm " << m.grad_norm << " kl " << m.kl
                << " clip_fraction " << m.clip_fraction << " micro_batches " << m.micro_batches << std::endl;
  }
  expect(sharded.version() == one.version(), name + ": version differs");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: kiln_trainer_dp_worker "
                 "[fsdp_[keep_]]token_mean|sequence_mean|clip|few_samples|recompute|activation_checkpointing|reduce_bf16|bf16|"
                 "nonfinite|refusals|"
                 "checkpoint|checkpoint_bf16"
              << std::endl;
    return 2;
  }
  try {
    torch::set_num_threads(1);
    const auto info = parallel::read_launch_from_environment();
    rank = info.rank;
    parallel::GroupOptions options;
    options.store_timeout = std::chrono::seconds(60);
    options.collective_timeout = std::chrono::seconds(60);
    std::string name = argv[1];
    if (name.rfind("fsdp_", 0) == 0) {
      fsdp = true;
      name = name.substr(5);
    }
    if (fsdp && name.rfind("keep_", 0) == 0) {
      keep = true;
      name = name.substr(5);
    }
    if (name == "checkpoint" && info.world_size % 2)
      throw std::invalid_argument("the checkpoint case needs an even world, got " + std::to_string(info.world_size));
    parallel::ProcessGroups groups(info, torch::kCPU,
                                   name == "checkpoint" ? std::vector<parallel::MeshDim>{{"x", 2}, {"dp", info.world_size / 2}}
                                                        : std::vector<parallel::MeshDim>{{"dp", info.world_size}},
                                   options);
    if (name == "checkpoint") run_checkpoint(groups);
    else if (name == "checkpoint_bf16") run_checkpoint_bf16(groups.along("dp"));
    else run_case(groups.along("dp"), name);
    std::cout << "rank " << rank << ": " << checks - failures << " of " << checks << " checks passed" << std::endl;
    return failures ? 1 : 0;
  } catch (const std::exception& e) {
    std::cerr << "rank " << rank << ": error: " << e.what() << std::endl;
    return 3;
  }
}

#pragma once
// Checks shared by the multi-rank trainer workers (dp_worker.cpp, ep_worker.cpp), each a
// process of tests/parallel/run_workers.py comparing its trainer with a one-rank trainer:
// counters of checks and failures, the relative-error comparisons and the step metrics check
// both use.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "actors/trainer/samples.hpp"
#include "actors/trainer/trainer_config.hpp"
#include "parallel/group.hpp"
#include "parallel/launch.hpp"
#include "parallel/process_group.hpp"

namespace kiln::test::rank_checks {

/// The groups of a worker started by tests/parallel/run_workers.py: a "dp" x "ep" mesh over the
/// launch's world (dp = world / `ep`, argument `ep_arg` of the command line), on the CPU, with
/// 60 s store and collective timeouts; sets `rank`. Throws std::invalid_argument when ep does
/// not divide the world.
inline std::unique_ptr<parallel::ProcessGroups> dp_ep_groups(const std::string& ep_arg);

/// One random sample drawn from `rng` (the same on every rank given the same state): 2-9 prompt
/// and 1-12 completion ids in [2, vocab), behaviour and reference log-probs in [-6, -3.5), old
/// log-probs in [-5.2, -4) when `with_old`, an advantage in [-1.5, 1.5).
inline trainer::Sample random_sample(std::mt19937_64& rng, int64_t vocab, bool with_old) {
  auto uniform = [&](double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); };
  auto integer = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  trainer::Sample s;
  for (int64_t k = integer(2, 9); k > 0; --k) s.prompt.push_back(integer(2, vocab - 1));
  for (int64_t k = integer(1, 12); k > 0; --k) {
    s.completion.push_back(integer(2, vocab - 1));
    s.behavior_logprobs.push_back(float(uniform(-6.0, -3.5)));
    s.ref_logprobs.push_back(float(uniform(-6.0, -3.5)));
    if (with_old) s.old_logprobs.push_back(float(uniform(-5.2, -4.0)));
  }
  s.advantage = float(uniform(-1.5, 1.5));
  return s;
}

inline constexpr double kTolerance = 1e-5;  ///< relative error allowed against one rank (fp32)
inline int checks = 0, failures = 0, rank = -1;

inline void expect(bool ok, const std::string& what) {
  ++checks;
  if (ok) return;
  ++failures;
  std::cerr << "rank " << rank << " MISMATCH " << what << std::endl;
}

/// ||got - want|| / ||want|| in fp64 (||got - want|| when want is 0).
inline double relative_error(const torch::Tensor& got, const torch::Tensor& want) {
  const double denom = want.to(torch::kFloat64).norm().item<double>();
  const double diff = (got.to(torch::kFloat64) - want.to(torch::kFloat64)).norm().item<double>();
  return denom > 0 ? diff / denom : diff;
}

/// A metric against the one-rank value: within kTolerance, equal, or both NaN.
inline void expect_close(double got, double want, const std::string& what) {
  const double err = std::abs(got - want) / std::max(std::abs(want), 1e-12);
  std::ostringstream s;
  s << what << ": got " << got << ", one rank " << want << " (relative error " << err << ")";
  expect(err <= kTolerance || got == want || (std::isnan(got) && std::isnan(want)), s.str());
}

/// Every rank's `local` [n], gathered: [W, n].
inline torch::Tensor gather_rows(parallel::Group& g, const torch::Tensor& local) {
  auto out = torch::empty({g.size() * local.size(0)}, local.options());
  g.all_gather_into_tensor(out, local.contiguous());
  return out.reshape({g.size(), local.size(0)});
}

/// A step's metrics: equal on every rank of `g` bit for bit (NaN == NaN: compared as
/// integers), and each against the one-rank step's `want` (expect_close; token counts equal).
/// Whether a step may be skipped is the caller's to check.
inline void expect_step_metrics(parallel::Group& g, const trainer::StepMetrics& got, const trainer::StepMetrics& want,
                                const std::string& at) {
  const std::vector<double> values{got.loss,    got.pg_loss,   got.kl,          got.clip_fraction,
                                   got.entropy, got.grad_norm, got.train_rollout_logprob_abs_diff,
                                   double(got.loss_tokens), double(got.tokens), double(got.micro_batches),
                                   double(got.skipped_nonfinite), got.lr};
  auto rows = gather_rows(g, torch::tensor(values, torch::kFloat64)).view(torch::kInt64);
  for (int r = 1; r < g.size(); ++r)
    expect(torch::equal(rows[r], rows[0]), at + "metrics of rank " + std::to_string(r) + " differ from rank 0's");
  expect_close(got.loss, want.loss, at + "loss");
  expect_close(got.pg_loss, want.pg_loss, at + "pg_loss");
  expect_close(got.kl, want.kl, at + "kl");
  expect_close(got.clip_fraction, want.clip_fraction, at + "clip_fraction");
  expect_close(got.entropy, want.entropy, at + "entropy");
  expect_close(got.grad_norm, want.grad_norm, at + "grad_norm");
  expect_close(got.train_rollout_logprob_abs_diff, want.train_rollout_logprob_abs_diff, at + "logprob abs diff");
  expect(got.loss_tokens == want.loss_tokens && got.tokens == want.tokens, at + "token counts differ");
}

inline std::unique_ptr<parallel::ProcessGroups> dp_ep_groups(const std::string& ep_arg) {
  const auto info = parallel::read_launch_from_environment();
  rank = info.rank;
  const int ep = std::stoi(ep_arg);
  if (ep < 1 || info.world_size % ep)
    throw std::invalid_argument("ep " + std::to_string(ep) + " does not divide the world " +
                                std::to_string(info.world_size));
  parallel::GroupOptions options;
  options.store_timeout = std::chrono::seconds(60);
  options.collective_timeout = std::chrono::seconds(60);
  return std::make_unique<parallel::ProcessGroups>(
      info, torch::kCPU, std::vector<parallel::MeshDim>{{"dp", info.world_size / ep}, {"ep", ep}}, options);
}

}  // namespace kiln::test::rank_checks

#pragma once
// Checks shared by the multi-rank trainer workers (dp_worker.cpp, ep_worker.cpp), each a
// process of tests/parallel/run_workers.py comparing its trainer with a one-rank trainer:
// counters of checks and failures, and the relative-error comparisons both use.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <sstream>
#include <string>

namespace kiln::test::rank_checks {

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

}  // namespace kiln::test::rank_checks

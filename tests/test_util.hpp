#pragma once
// Helpers shared by every test suite: elapsed time, skipping a test case whose hardware is
// missing, and, in suites built with LibTorch, whether a GPU is present and relative error.
#include <chrono>
#include <cstdio>

namespace kiln::test {

using Clock = std::chrono::steady_clock;

/// Time since t0 on the steady clock (compare with chrono literals: `since(t0) < 2s`).
inline Clock::duration since(Clock::time_point t0) { return Clock::now() - t0; }

/// Seconds since t0 on the steady clock.
inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(since(t0)).count(); }

/// What a skipped test case prints; tests/CMakeLists.txt gives every ctest entry
/// SKIP_REGULAR_EXPRESSION with it, so that ctest reports the entry as skipped, not passed.
inline constexpr const char* kSkipMarker = "KILN_TEST_SKIPPED";

/// How many times skip_unless skipped in this process. doctest has no "skipped at run time"
/// state, so its summary counts such a case as passed; tests/main.cpp reads this count to
/// name the skipped cases after that summary.
inline unsigned skips_taken = 0;

/// Skips the running test case unless `available`: prints the marker and `what_is_missing`
/// and returns true (the caller returns at once). Use: `if (test::skip_unless(ok, "...")) return;`.
inline bool skip_unless(bool available, const char* what_is_missing) {
  if (available) return false;
  std::printf("%s: %s\n", kSkipMarker, what_is_missing);
  std::fflush(stdout);
  ++skips_taken;
  return true;
}

}  // namespace kiln::test

// The LibTorch helpers: only where LibTorch is on the include path (the torch-free suites,
// also built under the sanitizers without LibTorch, use the part above).
#if __has_include(<torch/torch.h>)
#include <torch/torch.h>

namespace kiln::test {

/// LibTorch sees a CUDA device.
inline bool have_gpu() { return torch::cuda::is_available(); }

/// Skips the running test case on a machine without a GPU (see skip_unless).
inline bool skip_without_gpu() { return skip_unless(have_gpu(), "no CUDA device"); }

/// Relative error ||got - want|| / ||want||, computed in fp64 (on `got`'s device).
inline double rel_error(const torch::Tensor& got, const torch::Tensor& want) {
  auto w = want.to(got.device(), torch::kFloat64);
  return ((got.to(torch::kFloat64) - w).norm() / w.norm()).item<double>();
}

/// Largest error against the largest value: max |got - want| / max |want| (fp64, `got`'s device).
inline double rel_max(const torch::Tensor& got, const torch::Tensor& want) {
  auto w = want.to(got.device(), torch::kFloat64);
  return ((got.to(torch::kFloat64) - w).abs().max() / w.abs().max().clamp_min(1e-30)).item<double>();
}

}  // namespace kiln::test
#endif

#pragma once
// Elapsed wall time, the one helper for every timing in kiln (metrics, benchmarks, tests).
#include <chrono>

namespace kiln::messaging {

/// Started at construction (or restart()); seconds() is the steady-clock time since.
class Stopwatch {
 public:
  using Clock = std::chrono::steady_clock;
  Stopwatch() : t0_(Clock::now()) {}
  void restart() { t0_ = Clock::now(); }
  double seconds() const { return std::chrono::duration<double>(Clock::now() - t0_).count(); }
  double milliseconds() const { return seconds() * 1e3; }

 private:
  Clock::time_point t0_;
};

}  // namespace kiln::messaging

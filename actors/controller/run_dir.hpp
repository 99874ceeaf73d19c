#pragma once
// A run's files: RUN/checkpoints/step_NNNNNN (actors/trainer/checkpoint.hpp), the hint that
// tells how to continue, and the ipc:// socket files of the run's nodes in /tmp.
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace kiln::controller {

/// RUN/checkpoints/step_NNNNNN.
std::filesystem::path checkpoint_dir(const std::filesystem::path& run, int64_t step);

/// What to do after the policy was lost with its process: resume from the newest complete
/// checkpoint of the run (a step_N directory with its state.json; ".partial" ones are
/// incomplete), or start again. One or more lines, each ending in '\n'.
std::string continue_hint(const std::filesystem::path& run);

/// The ipc:// socket files of a run (TAG-controller, TAG-rollout[-i], TAG-ref, TAG-trainer),
/// removed on every way out: when this object goes (normal returns) and on SIGINT, SIGTERM and
/// SIGHUP (a handler that removes them, prints `interrupted`, then re-raises; the nodes exit
/// with their parent). One instance at a time.
class RunSockets {
 public:
  RunSockets(const std::string& tag, int64_t engines, const std::string& interrupted);
  ~RunSockets();
  RunSockets(const RunSockets&) = delete;
  RunSockets& operator=(const RunSockets&) = delete;

 private:
  std::vector<std::string> paths_;
};

}  // namespace kiln::controller

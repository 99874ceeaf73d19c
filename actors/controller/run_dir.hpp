#pragma once
// A run's files: RUN/checkpoints/step_NNNNNN (actors/trainer/checkpoint.hpp), the hint that
// tells how to continue, and the ipc:// socket files of the run's nodes in /tmp.
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace kiln::controller {

/// True when `inner` is `outer` or lies below it (both made absolute and normal, symbolic links
/// of existing parts resolved).
bool lies_within(const std::filesystem::path& inner, const std::filesystem::path& outer);
/// `path` lexically normal and without a trailing separator ("a/b/" -> "a/b"; "/" stays).
std::filesystem::path without_trailing_separator(const std::filesystem::path& path);
/// Why files written at `path` would change a kiln checkpoint or a run's checkpoints: "lies
/// inside the checkpoint 'X' (state.json, config.json)" or "lies in 'X', the checkpoints
/// directory of the run in 'Y'", for `path` itself or any ancestor (symbolic links of existing
/// parts resolved); empty when neither.
std::string inside_kiln_checkpoint(const std::filesystem::path& path);
/// "is a symbolic link ('PATH' -> 'TARGET') that leads to nothing" when `path` (trailing
/// separator aside) is a link whose target, followed to the end, does not exist; else empty.
std::string dangling_link(const std::filesystem::path& path);

/// Refuses, before anything is made, a run directory whose files would land where they damage
/// something (std::invalid_argument naming the key and the path): a filesystem root; a
/// directory inside a kiln checkpoint (one of its ancestors, or itself, holds state.json and
/// config.json) or a
/// run's checkpoints/ directory; a dangling symbolic link; RUN/checkpoints that is not a
/// directory, RUN/config.toml that is not a file; and with `overwrite` (not resuming), a `model_checkpoint` inside RUN/checkpoints,
/// which the overwrite would delete.
void check_run_dir(const std::filesystem::path& dir, const std::string& resume_from, bool overwrite,
                   const std::string& model_checkpoint);

/// The run directory, held for one run: created if missing and locked (RUN/.lock, flock: the
/// kernel drops the lock when its process dies, so a dead run never blocks the next one).
class RunLock {
 public:
  /// Throws std::runtime_error naming the directory and the pid of the run that holds it, or
  /// why the lock file cannot be made. A run directory that already holds a run
  /// (RUN/metrics.jsonl with rows) is accepted when `resume_from` is one of its own
  /// checkpoints, or with `overwrite`; otherwise refused, saying how to resume, choose another
  /// directory, or overwrite. A directory this lock created is removed again on release when
  /// the run left nothing in it but the lock file, its nodes' pid files (RUN/*_node*.pid) and
  /// RUN/rollout_weights (a run refused at start-up, e.g. by its model, or that failed before its
  /// first step was logged), and so are the
  /// parent directories it created that are then empty (not for a path with "." or ".."
  /// components: nothing is removed for those). A stop signal before the first step
  /// (RunSignals) removes them the same way.
  RunLock(const std::filesystem::path& dir, const std::string& resume_from, bool overwrite);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

 private:
  int fd_ = -1;
  std::filesystem::path created_;                       // the directory, when this lock made it (physical path)
  std::vector<std::filesystem::path> created_parents_;  // the directories above it that it made, innermost first
};

/// The settings that differ between two config.toml texts as kiln writes them ("[section]"
/// headers, one "key = value" per line), as "section.key: OLD -> NEW" (a key only one side has:
/// "(none)" on the other), sorted by key, leaving out `ignored` keys (e.g. run.resume_from).
std::vector<std::string> changed_settings(const std::string& before_toml, const std::string& after_toml,
                                          const std::vector<std::string>& ignored);

/// Writes `text` to FILE.tmp, then renames it over `file`: a write that fails leaves `file` as
/// it was (whole, or absent). Throws std::runtime_error naming the file (disk full, a file-size
/// limit, a rename refused), FILE.tmp removed.
void replace_file(const std::filesystem::path& file, const std::string& text);

/// RUN/checkpoints/step_NNNNNN.
std::filesystem::path checkpoint_dir(const std::filesystem::path& run, int64_t step);

/// The newest complete checkpoint of a run (a step_N directory with its state.json; ".partial"
/// ones are incomplete), or an empty path.
std::filesystem::path newest_checkpoint(const std::filesystem::path& run);

/// At a resume's first logged step: RUN/checkpoints/step_N for N >= first_step (steps the resume
/// trains again, their metrics rows dropped) renamed to step_N.superseded (".superseded.2", ...
/// when taken), so that no advice and no newest_checkpoint() leads back to a run the rows no
/// longer describe; their files stay. Returns the new paths. Throws std::runtime_error naming the
/// checkpoint when a rename fails.
std::vector<std::filesystem::path> supersede_checkpoints(const std::filesystem::path& run, int64_t first_step);

/// A run over another (run.overwrite, not resuming), at its first logged step, before anything
/// else there changes: the replaced run's RUN/checkpoints renamed to RUN/checkpoints.replaced
/// (".replaced.2", ... when taken), and an empty RUN/checkpoints made in its place. Returns the
/// aside (empty when there was no RUN/checkpoints). Throws std::runtime_error naming
/// RUN/checkpoints when the rename or the new directory fails (the old one back in its place). put_back_checkpoints(run, aside) undoes it, for a commit that fails
/// after it; delete_replaced_checkpoints() then deletes the asides. A kill in that delete so
/// leaves only an aside, never a checkpoint with part of its files under RUN/checkpoints, which
/// newest_checkpoint() and continue_hint() would offer.
std::filesystem::path set_aside_checkpoints(const std::filesystem::path& run);
/// Renames `aside` back to RUN/checkpoints; false when that fails.
bool put_back_checkpoints(const std::filesystem::path& run, const std::filesystem::path& aside);
/// Deletes RUN's asides (set_aside_checkpoints): "checkpoints.replaced" and
/// "checkpoints.replaced.N" (N digits) that are directories or symbolic links (a link goes, not
/// what it points to), this run's and those an earlier overwrite left when it was killed in its
/// delete; a file of such a name is not kiln's and stays. Returns a line for each leftover
/// deleted and each delete that failed (that only costs disk: the run goes on).
std::vector<std::string> delete_replaced_checkpoints(const std::filesystem::path& run, const std::filesystem::path& aside);

/// RUN/rollout_weights: where rollout.backend "http" writes each version for the servers (unless
/// rollout.weights_dir says elsewhere).
inline constexpr const char* kRolloutWeightsDir = "rollout_weights";

/// The file in the run directory holding the pid of a `kiln node`: "trainer_node.pid",
/// "ref_node.pid", "rollout_node.pid" for engine 0 and "rollout_node_<i>.pid" for engine i > 0
/// (`node` "trainer", "ref" or "rollout"; `index` the engine's).
std::string node_pid_file(const std::string& node, int64_t index = 0);

/// `word` as one shell word, for the commands kiln prints: as is when it holds only
/// [A-Za-z0-9_./:=@%+,-], else in single quotes (a quote inside as '\'').
std::string shell_word(const std::string& word);
/// `path` as a command's positional argument: "./" before a relative one that starts with '-'
/// (it would read as an option).
std::string as_argument(const std::filesystem::path& path);

/// What to do after the policy was lost with its process: resume from `last_checkpoint` (the
/// newest this run wrote or resumed from, which may lie outside RUN) when given and complete,
/// else from the newest complete checkpoint of the run, or start again. One or more lines, each
/// ending in '\n'.
std::string continue_hint(const std::filesystem::path& run, const std::filesystem::path& last_checkpoint = {});

/// Ctrl-C and the run's ipc:// socket files (TAG-controller, TAG-rollout[-i], TAG-ref,
/// TAG-trainer). Once the steps have begun (begin_steps()), the first SIGINT, SIGTERM or SIGHUP
/// only asks the loop to stop (it finishes the step in flight, checkpoints and says how to
/// continue: interrupted()); a second one removes the socket files and ends the process at once
/// (the nodes exit with it), saying whether any checkpoint was written. Before the steps begin
/// (building and loading the model, placing the actors: minutes for a large one) there is
/// nothing to checkpoint, and the first signal ends the process at once. The files are also
/// removed when this object goes. One instance at a time.
class RunSignals {
 public:
  RunSignals(const std::string& tag, int64_t engines, const std::filesystem::path& dir);
  ~RunSignals();
  RunSignals(const RunSignals&) = delete;
  RunSignals& operator=(const RunSignals&) = delete;
  /// The signal that asked the run to stop, or 0.
  static int interrupted();
  /// From now on the first signal waits for the step in flight (see above).
  static void begin_steps();

 private:
  std::vector<std::string> paths_;
};

}  // namespace kiln::controller

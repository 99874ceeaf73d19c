#pragma once
// RL checkpoints of a run (RUN/checkpoints/step_N/): the policy in HF layout (safetensors +
// config.json: loads in transformers), the AdamW state (optimizer.pt), the fp32 master weights
// of a bf16 policy (master_weights.pt), the loop state in state.json (step, policy
// version, the prompt RNG), and the rollouts in flight of an asynchronous run
// (in_flight_rollouts.msgpack, opaque here: actors/controller/in_flight.hpp). Written by `kiln run`'s trainer, in the controller process or in
// the trainer actor (actors/trainer/trainer_service.hpp).
//
// A data-parallel trainer (Trainer with a dp group of W ranks) writes a sharded checkpoint
// instead: the same policy and state.json (by dp rank 0; every rank holds the whole policy)
// and, in place of optimizer.pt and master_weights.pt, one optimizer_shard_R_of_W.pt per rank
// (its flat range, fp32 masters, AdamW moments and each parameter's step count: a
// FlatAdamWState), with no gather of the optimizer state anywhere. Either kind loads into
// either trainer at any world size: each rank reads the shards that overlap its own range.
#include <cstdint>
#include <filesystem>
#include <string>

#include "actors/trainer/trainer.hpp"

namespace kiln::trainer {

/// The file of CheckpointState::in_flight_rollouts in a checkpoint directory.
inline constexpr const char* kInFlightRolloutsFile = "in_flight_rollouts.msgpack";

/// The loop state a checkpoint holds beside the weights.
struct CheckpointState {
  int64_t step = 0;            ///< steps 1..step are trained
  int64_t policy_version = 0;  ///< optimizer steps taken (steps whose groups were all filtered take none)
  std::string prompt_rng;      ///< the prompt RNG (std::mt19937_64 text form) after step `step`'s prompts
  /// The rollouts generated for steps after `step` (staleness k > 0), as the controller
  /// encodes them; "" when none. Stored as DIR/in_flight_rollouts.msgpack.
  std::string in_flight_rollouts;
};

/// Writes the checkpoint into `dir`: first into `dir.partial`, renamed to `dir` once complete
/// (replacing an older `dir`), so a writer killed midway leaves no incomplete `dir`. Throws
/// std::runtime_error / std::filesystem::filesystem_error on I/O errors. With a data-parallel
/// trainer: collective over its group (every rank calls it with the same `dir`, on a filesystem
/// they share); a rank that fails leaves the others to fail at the next barrier by the
/// group's collective timeout. An expert-parallel trainer is refused (std::invalid_argument
/// naming expert parallel and the ep group), as by load_checkpoint.
void save_checkpoint(const std::filesystem::path& dir, model::CausalLM& policy, Trainer& trainer,
                     const CheckpointState& state);

/// Reads DIR/state.json (and DIR/in_flight_rollouts.msgpack when present). Throws
/// std::invalid_argument naming the directory when it is missing or lacks a field.
CheckpointState read_checkpoint_state(const std::filesystem::path& dir);

/// Loads policy weights, optimizer state and master weights from `dir` into `policy` and
/// `trainer` (whose version becomes the saved one) and returns the loop state. Throws
/// std::invalid_argument naming the directory and what is missing or does not fit (no
/// state.json, an unreadable optimizer.pt, a master_weights.pt of another policy, a policy of
/// other shapes, optimizer shards missing or of another policy). Sharded checkpoints (written
/// by W data-parallel ranks) load into a one-rank or data-parallel trainer of any size, and a
/// one-rank checkpoint into a data-parallel trainer.
CheckpointState load_checkpoint(const std::filesystem::path& dir, model::CausalLM& policy, Trainer& trainer);

}  // namespace kiln::trainer

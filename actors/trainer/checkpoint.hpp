#pragma once
// RL checkpoints of a run (RUN/checkpoints/step_N/): the policy in HF layout (safetensors +
// config.json: loads in transformers), the AdamW state (optimizer.pt), the fp32 master weights
// of a bf16 policy (master_weights.pt), the loop state in state.json (step, policy
// version, the prompt RNG), and the rollouts in flight of an asynchronous run
// (in_flight_rollouts.msgpack, opaque here: actors/controller/in_flight.hpp). Written by `kiln run`'s trainer, in the controller process or in
// the trainer actor (actors/trainer/trainer_service.hpp).
//
// A trainer over W ranks (data parallel, expert parallel or both) writes a sharded checkpoint
// instead, every rank its own part, with no gather of the model or its state anywhere:
//  - the policy in HF layout: by rank 0 when every rank holds all of it (data parallel);
//    with expert parallel over P ranks, model-0000k-of-0000P.safetensors by the replica-0 rank
//    of ep rank k (its experts under their global HF names; k = 0 also every other tensor) and
//    model.safetensors.index.json: transformers loads it as any sharded checkpoint;
//  - the buffers (buffers.pt), config.json and state.json by rank 0;
//  - in place of optimizer.pt and master_weights.pt, optimizer_shard_R_of_W.pt per rank: the
//    fp32 masters, AdamW moments and step counts of what rank R holds, as parts of the whole
//    model's flat index (Trainer::optimizer_state_parts: parameters() of the unsplit model in
//    order, routed experts with all E experts), their ranges in optimizer_shard_R_of_W.json.
// Either kind loads into any trainer (one rank, dp, dp x ep) at any world size and mesh: each
// rank reads the parts that overlap what it holds (resharding). An expert-parallel trainer
// takes its weights from the masters and buffers.pt (it never reads the whole HF export), so
// it resumes from sharded checkpoints only.
#include <cstdint>
#include <filesystem>
#include <optional>
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

/// torch::save of `value` into `file` (created or replaced) through a write kiln checks: a write
/// that fails (disk full, a file-size limit, /dev/full) throws std::runtime_error naming the file
/// once LibTorch's archive is done. (Through LibTorch's own file writer such a failure throws
/// inside its zip writer, whose destructor throws again while unwinding: std::terminate.)
void save_torch_file(const std::filesystem::path& file, const std::vector<torch::Tensor>& value);
void save_torch_file(const std::filesystem::path& file, const torch::optim::Optimizer& value);

/// Writes the checkpoint into `dir`: first into `dir.partial`, renamed to `dir` once complete
/// (replacing an older `dir`), so a writer killed midway leaves no incomplete `dir`; a write
/// that fails removes `dir.partial` (one rank's: with a group the others' stay). Throws
/// std::runtime_error / std::filesystem::filesystem_error on I/O errors, and std::runtime_error
/// before writing anything when a weight of the policy (or an fp32 master) holds NaN or
/// infinity (no run could resume from it; every rank of a group agrees). With a data-parallel
/// trainer: collective over its group (every rank calls it with the same `dir`, on a filesystem
/// they share); a rank that fails leaves the others to fail at the next barrier by the
/// group's collective timeout.
void save_checkpoint(const std::filesystem::path& dir, model::CausalLM& policy, Trainer& trainer,
                     const CheckpointState& state);

/// Reads DIR/state.json (and DIR/in_flight_rollouts.msgpack when present). Throws
/// std::invalid_argument naming the directory when it is missing or lacks a field; when DIR
/// is a run directory (or its checkpoints/ directory) the message names its newest checkpoint.
CheckpointState read_checkpoint_state(const std::filesystem::path& dir);

/// The step in a checkpoint directory's name as kiln names them ("step_" then digits only:
/// "step_000006" -> 6); -1 when the digits do not fit an int64; nullopt for any other name
/// ("step_6.partial", "step_6.superseded", "latest").
std::optional<int64_t> checkpoint_name_step(const std::string& name);

/// The newest complete checkpoint directly in PARENT (a step_N directory with its state.json;
/// step_N.partial ones are incomplete; the largest N as a number, so step_1000000 is newer
/// than step_999999 although the names are padded to 6 digits only), or an empty path.
std::filesystem::path newest_checkpoint_in(const std::filesystem::path& parent);

/// Loads policy weights, optimizer state and master weights from `dir` into `policy` and
/// `trainer` (whose version becomes the saved one) and returns the loop state. Throws
/// std::invalid_argument naming the directory and what is missing or does not fit (no
/// state.json, an unreadable optimizer.pt, a master_weights.pt of another policy, a policy of
/// other shapes, optimizer shards missing, cut short or of another policy, a one-rank checkpoint
/// given to an expert-parallel trainer). With a group: collective (the parameters are gathered
/// from the ranks' masters).
CheckpointState load_checkpoint(const std::filesystem::path& dir, model::CausalLM& policy, Trainer& trainer);

}  // namespace kiln::trainer

#pragma once
// RL checkpoints of a run (RUN/checkpoints/step_N/): the policy in HF layout (safetensors +
// config.json: loads in transformers), the AdamW state (optimizer.pt), the fp32 master weights
// of a bf16 policy (master_weights.pt), and the loop state in state.json (step, policy
// version, the prompt RNG). Written by `kiln run`'s trainer, in the controller process or in
// the trainer actor (actors/trainer/trainer_service.hpp).
#include <cstdint>
#include <filesystem>
#include <string>

#include "actors/trainer/trainer.hpp"

namespace kiln::trainer {

/// The loop state a checkpoint holds beside the weights.
struct CheckpointState {
  int64_t step = 0;            ///< steps 1..step are trained
  int64_t policy_version = 0;  ///< optimizer steps taken (steps whose groups were all filtered take none)
  std::string prompt_rng;      ///< the prompt RNG (std::mt19937_64 text form) after step `step`'s prompts
};

/// Writes the checkpoint into `dir`: first into `dir.partial`, renamed to `dir` once complete
/// (replacing an older `dir`), so a writer killed midway leaves no incomplete `dir`. Throws
/// std::runtime_error / std::filesystem::filesystem_error on I/O errors, std::invalid_argument
/// for a data-parallel trainer (sharded checkpoints are not supported yet).
void save_checkpoint(const std::filesystem::path& dir, model::CausalLM& policy, Trainer& trainer,
                     const CheckpointState& state);

/// Reads DIR/state.json. Throws std::invalid_argument naming the directory when it is missing
/// or lacks a field.
CheckpointState read_checkpoint_state(const std::filesystem::path& dir);

/// Loads policy weights, optimizer state and master weights from `dir` into `policy` and
/// `trainer` (whose version becomes the saved one) and returns the loop state. Throws
/// std::invalid_argument naming the directory and what is missing or does not fit (no
/// state.json, an unreadable optimizer.pt, a master_weights.pt of another policy, a policy of
/// other shapes, a data-parallel trainer: sharded checkpoints are not supported yet).
CheckpointState load_checkpoint(const std::filesystem::path& dir, model::CausalLM& policy, Trainer& trainer);

}  // namespace kiln::trainer

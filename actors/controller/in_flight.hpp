#pragma once
// The rollouts in flight of an asynchronous run (staleness k > 0) as a checkpoint keeps them
// (trainer::CheckpointState::in_flight_rollouts, the file in_flight_rollouts.msgpack): the
// batches generated for the steps after the checkpoint's, with the policy versions that made
// them, so that a resumed run trains on exactly the batches the uninterrupted run trained on
// instead of generating them again with newer weights (rollout_stream.hpp).
//
// Format (msgpack map, version 1): {"format": "kiln.in_flight_rollouts", "version": 1,
// "batches": [{step, problems: [{prompt, answer, numbers, target}], completions: [{id, prompt,
// tokens, logprobs, entropies, policy_versions, finish_reason ("stop"|"length"),
// time_to_first_token_s, routed_experts_shape [3] (empty: none), routed_experts (int32,
// flattened), topk_indices_shape [3] (empty or absent: none; sparse-attention selections,
// [P + n - 1, Ls, W]), topk_indices (int32, flattened)}], rollout_time, rng_after}]}.
#include <string>
#include <vector>

#include "actors/controller/rollout_stream.hpp"

namespace kiln::controller {

/// Encodes `batches` (in step order, consecutive); "" for none.
std::string encode_in_flight(const std::vector<Batch>& batches);

/// Decodes what encode_in_flight wrote; the batches must be for steps after_step + 1,
/// after_step + 2, ... Throws std::invalid_argument naming what is malformed (`source` names
/// the file in the message).
std::vector<Batch> decode_in_flight(const std::string& bytes, int64_t after_step, const std::string& source);

}  // namespace kiln::controller

#pragma once
// Expert parallel (EP) for the routed experts of moe.hpp, the torchtitan / Megatron-Core way:
// the P ranks of an ep group split the E experts, rank j holding experts [j*El, (j+1)*El)
// (El = E/P) as grouped tensors sliced along E. The MoE's dispatch step then becomes
//   dispatch (tokens to expert order, moe.hpp) -> dispatch_to_ranks (all-to-all to the rank
//   owning each expert) -> experts (El local ones) -> return_to_ranks (the reverse all-to-all)
//   -> combine (moe.hpp),
// with the counts exchanged first (an all-to-all of [P, El] int64), so that every all-to-all
// has variable counts and any rank may send or receive zero rows. Both row all-to-alls are
// differentiable (all_to_all_rows: the backward is the reverse all-to-all), so the backward
// of a rank reaches the experts of every other rank and comes back.
// Sources: torchtitan's ExpertParallel (_token_dispatch / _token_combine over all_to_all_single
// with variable splits) and Megatron-Core's MoEAlltoAllTokenDispatcher.
//
// Collective discipline: every rank of the ep group must call these the same number of times
// in the same order (one dispatch_to_ranks and one return_to_ranks per MoE layer and forward,
// and their backward), whatever its token count. A forward whose rows do not depend on the
// local experts breaks the chain: MoEImpl::forward keeps zero local rows connected for that.
//
// Legend: T tokens, K top-k, D hidden, E experts, P ep ranks, El = E/P local experts,
// R rows this rank's experts receive (from every rank), M = T*K rows this rank sends.
#include <cstdint>
#include <vector>

#include "model/blocks/moe.hpp"
#include "parallel/group.hpp"

namespace kiln::model {

/// Differentiable variable-count all-to-all along dim 0 over `group` (Group::all_to_all):
/// x [sum(input_rows), ...] -> [sum(output_rows), ...]; backward is the all-to-all with the
/// counts swapped. Collective in forward and in backward. Throws as Group::all_to_all.
torch::Tensor all_to_all_rows(const torch::Tensor& x, parallel::Group& group, const std::vector<int64_t>& output_rows,
                              const std::vector<int64_t>& input_rows);

/// The rows this rank's local experts work on, and how to send their results back.
struct RankDispatched {
  torch::Tensor x;                 ///< [R, D] received rows, sorted by local expert (stable)
  torch::Tensor counts;            ///< [El] int64 rows per local expert (CPU)
  torch::Tensor order;             ///< [R] int64: x = received.index_select(0, order)
  std::vector<int64_t> send_rows;  ///< [P] rows this rank sent to each rank (sum M)
  std::vector<int64_t> recv_rows;  ///< [P] rows received from each rank (sum R)
};

/// Step 2b: `d` (rows in global expert order, counts [E]) sent to the ranks owning their
/// experts. Collective over `ep` (a counts all-to-all, then the rows'). Throws
/// std::invalid_argument when d.counts is not [E] with E a multiple of ep.size().
RankDispatched dispatch_to_ranks(const Dispatched& d, parallel::Group& ep);

/// Step 3b: y [R, D], the local experts' output in rd.x's order, sent back: -> [M, D] in the
/// order of the Dispatched rows rd came from. Collective over `ep`.
torch::Tensor return_to_ranks(const torch::Tensor& y, const RankDispatched& rd, parallel::Group& ep);

/// The whole grouped tensor from its ep slices: local [El, ...] on every rank -> [P*El, ...],
/// rank j's slice at rows [j*El, (j+1)*El) (an all_gather_into_tensor over `ep`; no gradient).
/// Collective over `ep`. For HF weights (weight sync, checkpoints) of an expert-parallel model.
torch::Tensor gather_experts(const torch::Tensor& local, parallel::Group& ep);

}  // namespace kiln::model

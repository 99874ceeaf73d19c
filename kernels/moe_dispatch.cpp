#include "kernels/moe_dispatch.hpp"

#include <torch/torch.h>

#include <limits>

#ifdef KILN_CUDA
#include "kernels/moe_dispatch_cuda.hpp"
#endif

namespace kiln::kernels {

namespace {
void check_ids(const at::Tensor& ids, int64_t E) {
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong, "dispatch_order: ids must be [T, K] int64, got ",
              ids.sizes(), " ", ids.scalar_type());
  TORCH_CHECK(E >= 1, "dispatch_order: num_experts ", E, " < 1");
}
void check_combine(const at::Tensor& rows, const at::Tensor& row_of_slot, const at::Tensor& w) {
  TORCH_CHECK(rows.dim() == 2 && row_of_slot.dim() == 1 && w.dim() == 2 && row_of_slot.size(0) == w.numel() &&
                  rows.size(0) == w.numel(),
              "moe_combine: rows [M, D], row_of_slot [M] and weights [T, K] with M = T*K expected, got ",
              rows.sizes(), ", ", row_of_slot.sizes(), ", ", w.sizes());
  TORCH_CHECK(row_of_slot.scalar_type() == at::kLong && w.scalar_type() == at::kFloat,
              "moe_combine: row_of_slot must be int64 and weights fp32, got ", row_of_slot.scalar_type(), " and ",
              w.scalar_type());
  TORCH_CHECK(row_of_slot.device() == rows.device() && w.device() == rows.device(), "moe_combine: row_of_slot (",
              row_of_slot.device(), ") and weights (", w.device(), ") must be on rows' device (", rows.device(), ")");
}
void check_combine_grad(const at::Tensor& rows, const at::Tensor& w, const at::Tensor& grad) {
  TORCH_CHECK(grad.dim() == 2 && grad.size(0) == w.size(0) && grad.size(1) == rows.size(1),
              "moe_combine_backward: grad must be [T, D] = [", w.size(0), ", ", rows.size(1), "], got ", grad.sizes());
  TORCH_CHECK(grad.scalar_type() == rows.scalar_type() && grad.device() == rows.device(),
              "moe_combine_backward: grad (", grad.scalar_type(), ", ", grad.device(), ") must have rows' dtype and ",
              "device (", rows.scalar_type(), ", ", rows.device(), ")");
}
}  // namespace

DispatchOrder dispatch_order_ref(const at::Tensor& ids_TK, int64_t num_experts) {
  check_ids(ids_TK, num_experts);
  const int64_t K = ids_TK.size(1);
  // Sorted as int16 when every id in [0, E) fits (E < 32767; every model here): a radix sort over
  // 2 bytes where int64 keys took 8 passes (24 of a 4-layer 8k step's 32 sort passes on an H100),
  // the same stable order. Ids are in [0, E) by contract (the router's top-k, replay checked).
  auto flat = ids_TK.reshape({-1});                                                          // [M]
  if (num_experts < std::numeric_limits<int16_t>::max()) flat = flat.to(at::kShort);
  auto [sorted, order] = flat.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false);        // [M] each
  DispatchOrder d;
  d.slot = order;
  d.token_index = torch::div(order, K, "floor");
  d.row_of_slot = torch::empty_like(order).scatter_(0, order, torch::arange(order.size(0), order.options()));
  // Rows per expert from the sorted ids' boundaries: of static shape [E] and without a host
  // read (bincount on CUDA reads the largest id on the host).
  auto bounds = torch::searchsorted(sorted, torch::arange(num_experts + 1, flat.options()));  // [E+1] int64
  d.counts = bounds.narrow(0, 1, num_experts) - bounds.narrow(0, 0, num_experts);
  return d;
}

DispatchOrder dispatch_order(const at::Tensor& ids_TK, int64_t num_experts) {
  check_ids(ids_TK, num_experts);
#ifdef KILN_CUDA
  const int64_t M = ids_TK.numel();
  if (ids_TK.is_cuda() && M >= 1 && M <= cuda::kDispatchMaxSlots && num_experts <= cuda::kDispatchMaxExperts) {
    auto opts = ids_TK.options();
    DispatchOrder d{at::empty({M}, opts), at::empty({M}, opts), at::empty({M}, opts), at::empty({num_experts}, opts)};
    cuda::dispatch_order(ids_TK.contiguous(), num_experts, d.slot, d.token_index, d.row_of_slot, d.counts);
    return d;
  }
#endif
  return dispatch_order_ref(ids_TK, num_experts);
}

at::Tensor moe_combine_ref(const at::Tensor& rows_MD, const at::Tensor& row_of_slot_M, const at::Tensor& weights_TK) {
  check_combine(rows_MD, row_of_slot_M, weights_TK);
  const int64_t T = weights_TK.size(0), K = weights_TK.size(1), D = rows_MD.size(1);
  auto by_slot = rows_MD.index_select(0, row_of_slot_M).view({T, K, D});  // [T, K, D]
  return (by_slot * weights_TK.unsqueeze(-1)).sum(1).to(rows_MD.scalar_type());
}

at::Tensor moe_combine(const at::Tensor& rows_MD, const at::Tensor& row_of_slot_M, const at::Tensor& weights_TK) {
  check_combine(rows_MD, row_of_slot_M, weights_TK);
#ifdef KILN_CUDA
  const auto dt = rows_MD.scalar_type();
  if (rows_MD.is_cuda() && (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf)) {
    auto out = at::empty({weights_TK.size(0), rows_MD.size(1)}, rows_MD.options());
    if (out.numel() > 0)
      cuda::moe_combine(rows_MD.contiguous(), row_of_slot_M.contiguous(), weights_TK.contiguous(), out);
    return out;
  }
#endif
  return moe_combine_ref(rows_MD, row_of_slot_M, weights_TK);
}

at::Tensor gather_rows(const at::Tensor& src, const at::Tensor& index) {
  TORCH_CHECK(src.dim() == 2 && index.dim() == 1 && index.scalar_type() == at::kLong && index.device() == src.device(),
              "gather_rows: src [N, D] and index [M] int64 on src's device expected, got ", src.sizes(), " and ",
              index.sizes(), " ", index.scalar_type(), " on ", index.device());
#ifdef KILN_CUDA
  const auto dt = src.scalar_type();
  if (src.is_cuda() && (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf)) {
    const int64_t M = index.size(0);
    auto out = at::empty({M, src.size(1)}, src.options());
    if (out.numel() > 0)
      cuda::moe_combine(src.contiguous(), index.contiguous(), at::ones({M, 1}, src.options().dtype(at::kFloat)), out);
    return out;
  }
#endif
  return src.index_select(0, index);
}

CombineGrads moe_combine_backward_ref(const at::Tensor& rows_MD, const at::Tensor& row_of_slot_M,
                                      const at::Tensor& weights_TK, const at::Tensor& grad_TD) {
  check_combine(rows_MD, row_of_slot_M, weights_TK);
  check_combine_grad(rows_MD, weights_TK, grad_TD);
  const int64_t T = weights_TK.size(0), K = weights_TK.size(1), D = rows_MD.size(1);
  auto g = grad_TD.to(at::kFloat).unsqueeze(1);                                   // [T, 1, D]
  auto by_slot = rows_MD.index_select(0, row_of_slot_M).view({T, K, D});          // [T, K, D]
  auto grad_by_slot = (g * weights_TK.unsqueeze(-1)).to(rows_MD.scalar_type());   // [T, K, D]
  auto grad_rows = torch::empty_like(rows_MD).index_copy_(0, row_of_slot_M, grad_by_slot.view({T * K, D}));
  return {grad_rows, (by_slot * g).sum(-1)};                                       // [M, D], [T, K] fp32
}

CombineGrads moe_combine_backward(const at::Tensor& rows_MD, const at::Tensor& row_of_slot_M,
                                  const at::Tensor& weights_TK, const at::Tensor& grad_TD) {
  check_combine(rows_MD, row_of_slot_M, weights_TK);
  check_combine_grad(rows_MD, weights_TK, grad_TD);
#ifdef KILN_CUDA
  const auto dt = rows_MD.scalar_type();
  if (rows_MD.is_cuda() && (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf)) {
    CombineGrads out{at::empty_like(rows_MD, at::MemoryFormat::Contiguous),
                     at::empty(weights_TK.sizes(), weights_TK.options())};
    if (weights_TK.numel() > 0)
      cuda::moe_combine_backward(rows_MD.contiguous(), row_of_slot_M.contiguous(), weights_TK.contiguous(),
                                 grad_TD.contiguous(), out.rows_MD, out.weights_TK);
    return out;
  }
#endif
  return moe_combine_backward_ref(rows_MD, row_of_slot_M, weights_TK, grad_TD);
}

}  // namespace kiln::kernels

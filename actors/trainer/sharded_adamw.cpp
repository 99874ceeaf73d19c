#include "actors/trainer/sharded_adamw.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "actors/trainer/fused_adamw.hpp"

namespace kiln::trainer {

FlatAdamWState read_flat_state(torch::optim::AdamW& adamw, const std::vector<FlatPiece>& pieces, int64_t begin,
                               int64_t end, std::size_t params) {
  FlatAdamWState out;
  out.begin = begin;
  out.master = torch::zeros({end - begin}, torch::kFloat32);
  out.exp_avg = torch::zeros({end - begin}, torch::kFloat32);
  out.exp_avg_sq = torch::zeros({end - begin}, torch::kFloat32);
  out.steps = torch::full({int64_t(params)}, int64_t{-1}, torch::kInt64);
  torch::NoGradGuard no_grad;
  for (const auto& piece : pieces) {
    const int64_t n = piece.master.numel();
    // Pieces lie inside [begin, end): they are this holder's own elements.
    auto at = [&](const torch::Tensor& flat) { return flat.narrow(0, piece.offset - begin, n); };
    at(out.master).copy_(piece.master.detach().reshape({-1}));
    auto it = adamw.state().find(piece.master.unsafeGetTensorImpl());
    if (it == adamw.state().end()) continue;
    const auto& st = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    at(out.exp_avg).copy_(st.exp_avg().reshape({-1}));
    at(out.exp_avg_sq).copy_(st.exp_avg_sq().reshape({-1}));
    out.steps[int64_t(piece.param)] = st.step();
  }
  return out;
}

void write_flat_state(torch::optim::AdamW& adamw, const std::vector<FlatPiece>& pieces,
                      const std::vector<FlatAdamWState>& parts) {
  torch::NoGradGuard no_grad;
  for (const auto& piece : pieces) {
    const int64_t n = piece.master.numel(), lo = piece.offset, hi = piece.offset + n;
    auto master = torch::empty({n}, torch::kFloat32), exp_avg = torch::zeros({n}, torch::kFloat32),
         exp_avg_sq = torch::zeros({n}, torch::kFloat32);
    int64_t covered = 0, step = -1;
    for (const auto& part : parts) {
      if (piece.param >= std::size_t(part.steps.numel()))
        throw std::invalid_argument("optimizer state of " + std::to_string(part.steps.numel()) +
                                    " parameters, the policy has more (parameter " + std::to_string(piece.param) + ")");
      const int64_t a = std::max(lo, part.begin), b = std::min(hi, part.begin + part.master.numel());
      if (a >= b) continue;
      master.narrow(0, a - lo, b - a).copy_(part.master.narrow(0, a - part.begin, b - a));
      exp_avg.narrow(0, a - lo, b - a).copy_(part.exp_avg.narrow(0, a - part.begin, b - a));
      exp_avg_sq.narrow(0, a - lo, b - a).copy_(part.exp_avg_sq.narrow(0, a - part.begin, b - a));
      covered += b - a;
      step = std::max(step, part.steps[int64_t(piece.param)].item<int64_t>());
    }
    if (covered != n)  // parts do not overlap, so this counts each element once
      throw std::invalid_argument("optimizer state covers " + std::to_string(covered) + " of the " + std::to_string(n) +
                                  " elements [" + std::to_string(lo) + ", " + std::to_string(hi) +
                                  ") of parameter " + std::to_string(piece.param));
    piece.master.copy_(master.view(piece.master.sizes()));
    const auto key = piece.master.unsafeGetTensorImpl();
    adamw.state().erase(key);
    if (step < 0) continue;  // AdamW never stepped it: no state, as torch leaves it
    auto st = std::make_unique<torch::optim::AdamWParamState>();
    st->step(step);
    st->exp_avg(exp_avg.view(piece.master.sizes()).to(piece.master.device()));
    st->exp_avg_sq(exp_avg_sq.view(piece.master.sizes()).to(piece.master.device()));
    adamw.state()[key] = std::move(st);
  }
}

ShardedAdamW::ShardedAdamW(std::vector<torch::Tensor> params, parallel::Group& group,
                           torch::optim::AdamWOptions options, torch::Dtype reduce_dtype)
    : params_(std::move(params)), group_(group), reduce_dtype_(reduce_dtype) {
  if (reduce_dtype_ != torch::kFloat32 && reduce_dtype_ != torch::kBFloat16)
    throw std::invalid_argument(std::string("ShardedAdamW: gradients are reduced in fp32 or bf16, not ") +
                                c10::toString(reduce_dtype_));
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].device() != group_.device())
      throw std::invalid_argument("ShardedAdamW: parameter " + std::to_string(i) + " is on " +
                                  params_[i].device().str() + ", the data-parallel group '" + group_.name() + "' on " +
                                  group_.device().str());
    offsets_.push_back(numel_);
    numel_ += params_[i].numel();
  }
  const int64_t w = group_.size();
  shard_ = (numel_ + w - 1) / w;
  // Every rank starts from group rank 0's parameters (fp32 holds bf16/fp16 values exactly).
  auto flat = flatten([&](std::size_t i) { return params_[i].detach(); });
  group_.broadcast(flat, 0);
  {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < params_.size(); ++i)
      params_[i].copy_(flat.narrow(0, offsets_[i], params_[i].numel()).view_as(params_[i]));
  }
  const int64_t begin = group_.rank() * shard_, end = std::min(begin + shard_, numel_);
  master_shard_ = flat.narrow(0, group_.rank() * shard_, shard_).clone();
  grad_shard_ = torch::zeros_like(master_shard_);
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const int64_t lo = std::max(begin, offsets_[i]), hi = std::min(end, offsets_[i] + params_[i].numel());
    if (lo >= hi) continue;
    pieces_.push_back(Piece{i, lo - offsets_[i], lo - begin, hi - lo});
    // A view of the shard (a leaf of its own, so AdamW keeps one state per piece).
    masters_.push_back(master_shard_.narrow(0, lo - begin, hi - lo).detach());
  }
  adamw_ = std::make_unique<torch::optim::AdamW>(masters_, options);
}

template <typename Pick>
torch::Tensor ShardedAdamW::flatten(Pick pick, std::vector<int64_t>* has, torch::Tensor into,
                                    torch::Dtype dtype) const {
  auto flat = into.defined()
                  ? into
                  : torch::empty({group_.size() * shard_}, torch::TensorOptions(dtype).device(group_.device()));
  if (has) has->assign(params_.size(), 0);
  torch::NoGradGuard no_grad;
  // Every element written once: a parameter's values, or zeros where it has none; the padding.
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const torch::Tensor t = pick(i);
    auto at = flat.narrow(0, offsets_[i], params_[i].numel());
    if (!t.defined()) {
      at.zero_();
      continue;
    }
    at.copy_(t.reshape({-1}));  // [shape] -> [numel], to the flat dtype
    if (has) (*has)[i] = 1;
  }
  flat.narrow(0, numel_, flat.numel() - numel_).zero_();
  return flat;
}

void ShardedAdamW::reduce_gradients() {
  start_reduce_gradients();
  finish_reduce_gradients();
}

void ShardedAdamW::start_reduce_gradients() {
  std::vector<int64_t> has;
  if (has_gradient_.empty()) has_gradient_.assign(params_.size(), 0);
  auto grad = [&](std::size_t i) { return params_[i].grad(); };
  if (group_.size() == 1) {  // nothing to sum over: the gradients go to the shard directly
    if (!shard_written_) flatten(grad, &has, grad_shard_);
    else grad_shard_.add_(flatten(grad, &has));
    for (std::size_t i = 0; i < has.size(); ++i) has_gradient_[i] |= has[i];
    shard_written_ = true;
    return;
  }
  auto flat = flatten(grad, &has, {}, reduce_dtype_);  // [W*S]
  for (std::size_t i = 0; i < has.size(); ++i) has_gradient_[i] |= has[i];
  // [W*S] summed -> this rank's [S]: into the shard itself when nothing was added to it yet
  // (fp32), else into an [S] of the reduce dtype that finish adds (or, first, copies) in.
  const bool direct = !shard_written_ && reduce_dtype_ == torch::kFloat32;
  auto out = direct ? grad_shard_ : torch::empty({shard_}, flat.options());
  auto work = group_.start_reduce_scatter(out, flat);
  reductions_.push_back(
      Reduction{std::move(work), std::move(flat), direct ? torch::Tensor() : out, /*first=*/!shard_written_});
  shard_written_ = true;
}

void ShardedAdamW::finish_reduce_gradients() {
  {
    torch::NoGradGuard no_grad;
    auto pending = std::move(reductions_);
    reductions_.clear();
    for (auto& r : pending) {
      group_.finish(r.work, "reduce_scatter");
      if (!r.output.defined()) continue;  // written into the shard
      if (r.first) grad_shard_.copy_(r.output);  // (bf16 -> fp32)
      else grad_shard_.add_(r.output);
    }
  }
  // Which parameters have a gradient on some rank: torch's AdamW skips the others.
  if (has_gradient_.empty()) has_gradient_.assign(params_.size(), 0);
  auto any = torch::tensor(has_gradient_, torch::kInt64).to(group_.device());
  group_.all_reduce(any, parallel::ReduceOp::max);
  any = any.to(torch::kCPU);
  for (std::size_t k = 0; k < pieces_.size(); ++k)
    masters_[k].mutable_grad() = any[int64_t(pieces_[k].param)].item<int64_t>()
                                     ? grad_shard_.narrow(0, pieces_[k].shard_offset, pieces_[k].length)
                                     : torch::Tensor();
}

torch::Tensor ShardedAdamW::shard_squared_norm() const {
  torch::NoGradGuard no_grad;
  return grad_shard_.pow(2).sum().reshape({1});  // [1] fp32
}

void ShardedAdamW::scale_gradients(const torch::Tensor& coefficient) {
  torch::NoGradGuard no_grad;
  grad_shard_.mul_(coefficient);
}

double ShardedAdamW::clip_gradients(double max_norm) {
  auto squares = shard_squared_norm();
  group_.all_reduce(squares);
  auto norm = squares.sqrt();
  scale_gradients(torch::clamp(max_norm / (norm + 1e-6), std::nullopt, 1.0));
  return norm.item<double>();
}

void ShardedAdamW::step(double lr, bool gather) {
  for (auto& g : adamw_->param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
  fused_adamw_step(*adamw_);
  if (gather) gather_parameters();
}

void ShardedAdamW::gather_parameters() {
  start_gather_parameters();
  finish_gather_parameters();
}

void ShardedAdamW::start_gather_parameters() {
  if (gathering_) finish_gather_parameters();
  if (group_.size() == 1) {  // the shard is every parameter: written without a collective
    std::vector<torch::Tensor> from;
    for (std::size_t i = 0; i < params_.size(); ++i)
      from.push_back(master_shard_.narrow(0, offsets_[i], params_[i].numel()).view_as(params_[i]));
    copy_tensors(params_, from);
    return;
  }
  // In the parameters' dtype when they share one: rounding is elementwise, so rounding the
  // shard before the gather gives the same values for half the bytes (bf16).
  auto dtype = params_.empty() ? torch::kFloat32 : params_[0].scalar_type();
  for (const auto& p : params_)
    if (p.scalar_type() != dtype) dtype = torch::kFloat32;
  gathered_ = torch::empty({group_.size() * shard_}, master_shard_.options().dtype(dtype));  // [W*S]
  gather_input_ = dtype == torch::kFloat32 ? master_shard_ : master_shard_.to(dtype);
  gathering_ = group_.start_all_gather_into_tensor(gathered_, gather_input_);
}

void ShardedAdamW::finish_gather_parameters() {
  if (!gathering_) return;
  auto work = std::move(gathering_);
  gathering_.reset();
  auto full = std::move(gathered_);
  gathered_ = torch::Tensor();
  group_.finish(work, "all_gather_into_tensor");
  gather_input_ = torch::Tensor();
  std::vector<torch::Tensor> from;
  for (std::size_t i = 0; i < params_.size(); ++i)
    from.push_back(full.narrow(0, offsets_[i], params_[i].numel()).view_as(params_[i]));
  copy_tensors(params_, from);  // rounds to bf16, one launch
}

std::vector<FlatPiece> ShardedAdamW::pieces() const {
  std::vector<FlatPiece> out;
  for (std::size_t k = 0; k < pieces_.size(); ++k)
    out.push_back(FlatPiece{pieces_[k].param, offsets_[pieces_[k].param] + pieces_[k].param_offset, masters_[k]});
  return out;
}

void ShardedAdamW::zero_grad() {
  reductions_.clear();  // a step given up part-way (an error) leaves none behind
  has_gradient_.assign(params_.size(), 0);
  shard_written_ = false;
  grad_shard_.zero_();
  for (auto& m : masters_) m.mutable_grad() = torch::Tensor();
}

void ShardedAdamW::reload_from_parameters() {
  auto flat = flatten([&](std::size_t i) { return params_[i].detach(); });
  master_shard_.copy_(flat.narrow(0, group_.rank() * shard_, shard_));
}

}  // namespace kiln::trainer

#include "actors/trainer/trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <unordered_map>
#include <stdexcept>
#include <tuple>

#include "actors/trainer/fused_adamw.hpp"
#include "messaging/stopwatch.hpp"
#include "model/blocks/logprobs.hpp"

namespace kiln::trainer {

namespace {
// Trainer::time_phases: each phase's end synchronises `device` and adds the wall time since the
// last end (or construction) to its slot; does nothing when off.
class PhaseClock {
 public:
  PhaseClock(bool on, torch::Device device) : on_(on), device_(device) {}
  void ends(double& seconds) {
    if (!on_) return;
    if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
    const auto now = std::chrono::steady_clock::now();
    seconds += std::chrono::duration<double>(now - start_).count();
    start_ = now;
  }

 private:
  bool on_;
  torch::Device device_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// Sums `values` over the group in place (fp64).
void sum_over(parallel::Group& group, std::vector<double>& values) {
  auto t = torch::tensor(values, torch::kFloat64).to(group.device());
  group.all_reduce(t);
  t = t.to(torch::kCPU).contiguous();
  std::memcpy(values.data(), t.data_ptr<double>(), values.size() * sizeof(double));
}

// How many micro-batches this rank runs: the most of any rank of `group` (an all-reduce) —
// the model's ep group, so that every rank enters the MoE's all-to-alls equally often, or the
// data-parallel group of a fully sharded trainer (every layer's gathers); without one its own.
std::size_t micro_batch_count(parallel::Group* group, std::size_t mine) {
  if (!group) return mine;
  auto t = torch::full({1}, int64_t(mine), torch::kInt64).to(group->device());
  group->all_reduce(t, parallel::ReduceOp::max);
  return std::size_t(t.to(torch::kCPU).item<int64_t>());
}

// The padding micro-batch of an expert-parallel rank with fewer micro-batches than the others:
// one document of two tokens (id 0). Its hidden states [2, D] take part in every all-to-all;
// the caller multiplies whatever it derives from them by 0.
torch::Tensor padding_forward(model::CausalLM& m) {
  return m.forward(model::PackedBatch::from_documents({{0, 0}})).hidden;
}

// What every micro-batch of a train_step shares.
struct MicroBatchInputs {
  const std::vector<Sample>& samples;
  bool given_old, want_ref;     // samples carry old log-probs; the loss has a KL term
  double normalizer;            // the policy loss's (token_mean: the step's loss tokens; else its samples)
  double loss_tokens;           // the step's, over every rank (the MTP loss's normaliser)
  torch::Tensor sample_tokens;  // [S] fp32 loss tokens per sample, on the policy's device
};

// A micro-batch's sums, as train_micro_batch returns them.
enum MicroBatchSum : int64_t { kLoss, kPg, kKl, kEntropy, kClipped, kLossTokens, kOldBehaviour, kMtpLoss, kMicroBatchSums };

// One micro-batch's forward, loss and backward (its gradients added to the parameters'). Its
// sums come back as [kMicroBatchSums] fp64 on the device (MicroBatchSum order), not read: the
// caller adds them up and reads them once; the MTP cross-entropy and prediction count (host
// numbers) are added to mtp_ce and mtp_predictions. Host tensors reach the device through
// pinned memory without waiting for it (model::to_model_device).
torch::Tensor train_micro_batch(model::CausalLM& policy, const TrainerConfig& c, const MicroBatchInputs& in,
                                const std::vector<std::size_t>& idx, PhaseClock& clock, Trainer::StepPhases& phases,
                                double& mtp_ce, double& mtp_predictions) {
  auto p = pack(in.samples, idx, c.logprobs.routing_replay);
  model::ForwardOptions opts;
  opts.replay_routed_experts = p.replay;
  opts.replay_topk_indices = p.replay_topk;
  auto out = policy.forward(p.batch, opts);
  const auto dev = out.hidden.device();
  const auto positions_host = p.completion_positions;
  p.completion_positions = model::to_model_device(p.completion_positions, dev);
  const auto targets = model::to_model_device(p.targets, dev);
  std::optional<model::MtpLoss> mtp;
  if (c.mtp_loss_weight > 0) {  // from the hidden states before the temperature's scaling
    auto supervised = torch::zeros({p.batch.input_ids.size(0)}, torch::kBool);
    supervised.index_fill_(0, positions_host, true);
    mtp = model::mtp_loss(policy, p.batch, out.hidden, supervised, c.mtp_depths, c.mtp_loss_weight, in.loss_tokens,
                          c.logprobs.chunk);
  }
  const double temperature = c.logprobs.temperature;
  // The output head runs on the completion rows only: a prompt token's log-prob is never used
  // (and would get no gradient), so its [V, D] GEMMs are skipped forward and backward.
  const auto& rows = p.completion_positions;
  PolicyTokens t;
  if (c.loss.entropy_coef != 0)
    std::tie(t.logprob, t.entropy) = policy.token_logprobs_and_entropy(out, targets, c.logprobs.chunk, temperature, rows);
  else
    t.logprob = policy.token_logprobs(out, targets, c.logprobs.chunk, temperature, rows);  // [Tc]
  auto to_dev = [&](const torch::Tensor& host) { return model::to_model_device(host, dev); };
  t.old_logprob = in.given_old ? to_dev(per_token(in.samples, idx, &Sample::old_logprobs)) : t.logprob.detach();
  t.behavior_logprob = to_dev(per_token(in.samples, idx, &Sample::behavior_logprobs));
  if (in.want_ref) t.ref_logprob = to_dev(per_token(in.samples, idx, &Sample::ref_logprobs));
  std::vector<float> adv;
  std::vector<int64_t> global_index;
  for (auto k : p.completion_sample) {
    auto i = idx[std::size_t(k)];
    adv.push_back(in.samples[i].advantage);
    global_index.push_back(int64_t(i));
  }
  t.advantage = to_dev(torch::tensor(adv, torch::kFloat32));
  t.loss_mask = torch::ones_like(t.advantage);
  t.sample_index = to_dev(torch::tensor(global_index, torch::kInt64));
  auto r = policy_loss(t, c.loss, in.normalizer, in.sample_tokens, /*read_sums=*/false);
  if (mtp) {
    r.loss = r.loss + mtp->loss;
    mtp_ce += mtp->ce_sum;
    mtp_predictions += double(mtp->tokens);
  }
  clock.ends(phases.forward);
  r.loss.backward();
  clock.ends(phases.backward);
  const auto f64 = [](const torch::Tensor& x) { return x.detach().to(torch::kFloat64).reshape({1}); };
  return torch::cat({f64(r.loss), r.sums, f64((t.old_logprob - t.behavior_logprob).abs().sum()),
                     mtp ? f64(mtp->loss) : torch::zeros({1}, r.sums.options())});
}
}  // namespace

std::unique_ptr<Trainer> make_trainer(std::shared_ptr<model::CausalLM> policy, TrainerConfig config,
                                      parallel::ProcessGroups* ranks) {
  if (!ranks) return std::make_unique<Trainer>(std::move(policy), std::move(config));
  auto& ep = ranks->along("ep");
  if (ep.size() == 1) return std::make_unique<Trainer>(std::move(policy), std::move(config), &ranks->along("dp"));
  return std::make_unique<Trainer>(std::move(policy), std::move(config), ranks->world(),
                                   ExpertParallel{&ep, &ranks->along("dp")});
}

model::ExpertSlice expert_slice_of(parallel::ProcessGroups* ranks) {
  if (!ranks) return {};
  auto& ep = ranks->along("ep");
  return {ep.rank(), ep.size()};
}

int ranks_on_this_host(parallel::ProcessGroups* ranks) { return ranks ? std::max(1, ranks->launch().local_world_size) : 1; }

namespace {
// A multi-token-prediction loss needs a policy with an MTP layer.
void check_mtp(const TrainerConfig& c, model::CausalLM& policy) {
  if (c.mtp_loss_weight > 0 && policy.mtp_layers() == 0)
    throw std::invalid_argument("trainer config: mtp_loss_weight " + std::to_string(c.mtp_loss_weight) +
                                " (experiment key algorithm.mtp_loss_weight) needs a policy with a multi-token-"
                                "prediction layer; this model has none (glm5_next builds it when its config has "
                                "num_nextn_predict_layers > 0)");
}
// The true on-policy mode needs a policy whose blocks all have a batch-invariant form.
void check_true_on_policy(const TrainerConfig& c, model::CausalLM& policy) {
  if (c.logprobs.true_on_policy && !policy.supports_batch_invariant())
    throw std::invalid_argument("trainer config: true_on_policy (experiment key algorithm.true_on_policy) needs a "
                                "policy with a batch-invariant forward; this model's package does not implement it "
                                "(glm4_moe_lite does, glm5_next does not)");
}
// What both trainers do first: the settings checked, then those the policy's forward reads set on it.
void configure_policy(const TrainerConfig& c, model::CausalLM& policy) {
  c.validate();
  check_mtp(c, policy);
  check_true_on_policy(c, policy);
  policy.set_activation_checkpointing(c.activation_checkpointing, c.activation_checkpointing_layers);
  policy.set_kept_logits_bytes(c.keep_logits_bytes());
  policy.set_batch_invariant(c.logprobs.true_on_policy);
}
}  // namespace

Trainer::Trainer(std::shared_ptr<model::CausalLM> policy, TrainerConfig config, parallel::Group* data_parallel)
    : policy_(std::move(policy)), c_(config), dp_(data_parallel) {
  configure_policy(c_, *policy_);
  params_ = policy_->parameters();
  for (std::size_t i = 0; i < params_.size(); ++i)
    if (params_[i].scalar_type() != torch::kFloat32) low_precision_.push_back(i);
  for (const auto& p : params_) {
    global_offset_.push_back(global_numel_);
    global_numel_ += p.numel();
  }
  const auto options = torch::optim::AdamWOptions(c_.lr).betas({c_.beta1, c_.beta2}).weight_decay(c_.weight_decay);
  if (dp_) {  // fp32 masters and AdamW state of this rank's shard only
    shard_state(std::vector<bool>(params_.size(), false), options);
    return;
  }
  for (const auto& p : params_)
    masters_.push_back(p.scalar_type() == torch::kFloat32 ? p
                                                          : p.detach().to(torch::kFloat32).clone().requires_grad_(true));
  optimizer_ = std::make_unique<torch::optim::AdamW>(masters_, options);
}

Trainer::Trainer(std::shared_ptr<model::CausalLM> policy, TrainerConfig config, parallel::Group& data_parallel,
                 ExpertParallel expert_parallel)
    : policy_(std::move(policy)), c_(config), dp_(&data_parallel), ep_(expert_parallel) {
  configure_policy(c_, *policy_);
  if (!ep_.experts || !ep_.replicas)
    throw std::invalid_argument(std::string("Trainer: expert parallel needs both groups, got no ") +
                                (ep_.experts ? "replicas (dp) group" : "experts (ep) group"));
  if (int64_t(ep_.experts->size()) * ep_.replicas->size() != dp_->size())
    throw std::invalid_argument("Trainer: ep group '" + ep_.experts->name() + "' (" +
                                std::to_string(ep_.experts->size()) + " ranks) times replicas group '" +
                                ep_.replicas->name() + "' (" + std::to_string(ep_.replicas->size()) +
                                " ranks) is not the data-parallel group '" + dp_->name() + "' (" +
                                std::to_string(dp_->size()) + " ranks)");
  if (policy_->expert_parallel())
    throw std::invalid_argument("Trainer: the policy is expert-parallel already (ep group '" +
                                policy_->expert_parallel()->name() + "'): give the trainer the whole model");
  // A policy built holding this ep rank's experts only (an HF checkpoint read per rank:
  // model::Registry::build with expert_slice_of) takes its replicas' rank 0's; a whole one,
  // data-parallel rank 0's, before each rank keeps its slice (set_expert_parallel).
  const bool sliced = policy_->expert_slice().ranks > 1;
  {
    torch::NoGradGuard no_grad;
    auto& source = sliced ? *ep_.replicas : *dp_;
    for (auto& w : policy_->routed_expert_parameters()) {
      auto t = w.detach().to(torch::kFloat32).contiguous();  // fp32 holds bf16/fp16 exactly
      source.broadcast(t, 0);
      w.copy_(t);
    }
  }
  policy_->set_expert_parallel(ep_.experts);
  params_ = policy_->parameters();
  for (std::size_t i = 0; i < params_.size(); ++i)
    if (params_[i].scalar_type() != torch::kFloat32) low_precision_.push_back(i);
  global_offset_.assign(params_.size(), 0);
  const auto experts = policy_->routed_expert_parameters();
  std::vector<bool> is_expert(params_.size(), false);
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    is_expert[i] = std::any_of(experts.begin(), experts.end(), [&](const torch::Tensor& e) { return e.is_same(p); });
  }
  // The whole model's flat index: an expert slice stands for ep size slices of its shape.
  int64_t offset = 0;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    global_offset_[i] = offset + (is_expert[i] ? ep_.experts->rank() * params_[i].numel() : 0);
    offset += params_[i].numel() * (is_expert[i] ? ep_.experts->size() : 1);
  }
  global_numel_ = offset;
  const auto options = torch::optim::AdamWOptions(c_.lr).betas({c_.beta1, c_.beta2}).weight_decay(c_.weight_decay);
  shard_state(is_expert, options);  // makes the dense parameters rank 0's
}

Trainer::~Trainer() {
  if (fsdp_) policy_->set_layer_hooks(nullptr);
}

double Trainer::current_lr() const {
  const int64_t s = version_;  // lr of the next step
  if (c_.warmup_steps > 0 && s < c_.warmup_steps) return c_.lr * double(s + 1) / double(c_.warmup_steps);
  if (c_.lr_schedule == "constant") return c_.lr;
  double progress = std::min(1.0, double(s - c_.warmup_steps) / double(std::max<int64_t>(1, c_.total_steps - c_.warmup_steps)));
  double cosine = 0.5 * (1 + std::cos(M_PI * progress));
  return c_.lr * (c_.min_lr_ratio + (1 - c_.min_lr_ratio) * cosine);
}

double Trainer::reduce_and_clip_gradients(double max_norm) {
  if (dp_) {
    if (expert_sharded_) {
      // The one-rank trainer has a gradient for every expert tensor (every layer sees the
      // batch's tokens); a slice no row reached on this rank has none yet: it is zero.
      for (auto& w : policy_->routed_expert_parameters())
        if (!w.grad().defined()) w.mutable_grad() = torch::zeros_like(w);
    }
    for (auto& part : parts_)
      if (!part.unit) part.optimizer->reduce_gradients();
    if (fsdp_) fsdp_->finish_reduce_gradients();  // the layers' reductions, started in the backward
    policy_->zero_grad();  // the full local gradients are in the shards now
    // One norm over the whole model: every optimizer's shard (dense and layers over all ranks,
    // experts over their replicas, each ep slice once): the world sum of their squared sums.
    torch::Tensor squares;  // [1]
    for (auto& part : parts_) {
      auto s = part.optimizer->shard_squared_norm();
      squares = squares.defined() ? squares + s : s;
    }
    dp_->all_reduce(squares);
    auto norm = squares.sqrt();
    const auto coefficient = torch::clamp(max_norm / (norm + 1e-6), std::nullopt, 1.0);
    for (auto& part : parts_) part.optimizer->scale_gradients(coefficient);
    return norm.item<double>();
  }
  if (steps_from_low_precision()) {
    // The norm of the 16-bit gradients as they are (fp32 norms, equal to their fp32 copies');
    // the coefficient is applied inside the AdamW kernel, the fp32 parameters' own gradients
    // are scaled here.
    std::vector<torch::Tensor> grads, own;
    for (const auto& p : params_) {
      grads.push_back(p.grad());
      if (p.scalar_type() == torch::kFloat32) own.push_back(p.grad());
    }
    auto [norm, coef] = clip_gradients(grads, max_norm, own);
    clip_coefficient_ = coef.to(params_.front().device());
    return norm;
  }
  std::vector<torch::Tensor> to, from;  // bf16 gradients -> fp32 master gradients, one launch
  for (auto i : low_precision_)
    if (params_[i].grad().defined()) {
      masters_[i].mutable_grad() = torch::empty_like(masters_[i]);
      to.push_back(masters_[i].grad());
      from.push_back(params_[i].grad());
    }
  copy_tensors(to, from);
  return clip_grad_norm(masters_, max_norm);
}

bool Trainer::steps_from_low_precision() const {
  return !dp_ && !low_precision_.empty() && params_[low_precision_.front()].is_cuda();
}

StepMetrics Trainer::train_step(const std::vector<Sample>& samples) {
  auto t0 = std::chrono::steady_clock::now();
  const bool want_ref = c_.loss.kl_coef != 0;
  if (dp_) check_same_batch(*dp_, samples);  // before any rank may throw alone
  check_samples(samples, *policy_, want_ref, c_.logprobs.routing_replay);
  std::vector<std::size_t> mine(samples.size());
  std::iota(mine.begin(), mine.end(), std::size_t{0});
  if (dp_) mine = split_samples(samples, dp_->size())[std::size_t(dp_->rank())];
  StepMetrics m;
  std::vector<float> sample_tokens;  // [S] of the whole batch (sequence_mean indexes it by sample)
  for (const auto& s : samples) sample_tokens.push_back(float(s.completion.size()));
  // The normaliser counts the whole batch: this rank's share, summed over the group, so that
  // the ranks' gradients add up to the one-rank gradient.
  std::vector<double> counts{0, 0, double(mine.size())};  // loss tokens, tokens, samples
  for (auto i : mine) {
    counts[0] += double(samples[i].completion.size());
    counts[1] += double(samples[i].tokens());
  }
  if (dp_) sum_over(*dp_, counts);
  m.loss_tokens = int64_t(counts[0]);
  m.tokens = int64_t(counts[1]);
  const torch::Device device = params_.empty() ? torch::Device(torch::kCPU) : params_.front().device();
  const MicroBatchInputs in{samples,
                            !samples.front().old_logprobs.empty(),
                            want_ref,
                            aggregation_from_string(c_.loss.aggregation) == Aggregation::token_mean ? counts[0] : counts[2],
                            counts[0],
                            model::to_model_device(torch::tensor(sample_tokens, torch::kFloat32), device)};
  zero_optimizer_gradients();
  if (uses_master_weights() || dp_) policy_->zero_grad();
  phases_ = {};
  PhaseClock clock(time_phases_, device);
  auto plan = plan_micro_batches(samples, mine, c_.logprobs.max_tokens_per_microbatch);
  // Expert parallel: padded to the ep group's most; fully sharded: to the data-parallel group's.
  plan.resize(micro_batch_count(fsdp_ ? dp_ : policy_->expert_parallel(), plan.size()));
  if (fsdp_) fsdp_->reshard();
  // This rank's sums (MicroBatchSum order), added on the device and read once after the last
  // micro-batch, so that the host packs and queues micro-batch i + 1 while the GPU runs i.
  torch::Tensor on_device;
  double micro_batches = 0, mtp_ce = 0, mtp_predictions = 0;
  for (const auto& idx : plan) {
    if (idx.empty()) {  // padding: the all-to-alls of a forward and backward, gradients + 0
      (padding_forward(*policy_).sum() * 0).backward();
      continue;
    }
    auto mb = train_micro_batch(*policy_, c_, in, idx, clock, phases_, mtp_ce, mtp_predictions);
    on_device = on_device.defined() ? on_device + mb : mb;
    micro_batches += 1;
  }
  std::vector<double> mb_sums(kMicroBatchSums, 0.0);
  if (on_device.defined()) {
    const auto host = on_device.cpu();
    std::copy(host.data_ptr<double>(), host.data_ptr<double>() + kMicroBatchSums, mb_sums.begin());
  }
  // Over the group: loss, pg, kl, clipped tokens, entropy, |old - behaviour|, micro-batches,
  // MTP term, MTP cross-entropy, MTP predictions.
  std::vector<double> sums{mb_sums[kLoss],    mb_sums[kPg],           mb_sums[kKl], mb_sums[kClipped],
                           mb_sums[kEntropy], mb_sums[kOldBehaviour], micro_batches, mb_sums[kMtpLoss],
                           mtp_ce,            mtp_predictions};
  if (dp_) sum_over(*dp_, sums);
  const double tokens = double(m.loss_tokens);
  m.loss = sums[0];
  m.pg_loss = sums[1] / tokens;
  m.kl = sums[2] / tokens;
  m.clip_fraction = sums[3] / tokens;
  m.entropy = sums[4] / tokens;
  m.train_rollout_logprob_abs_diff = sums[5] / tokens;
  m.micro_batches = int64_t(sums[6]);
  clock.ends(phases_.backward);  // (the sums' reduction)
  m.mtp_loss = sums[7];
  m.mtp_ce = sums[9] > 0 ? sums[8] / sums[9] : 0;
  m.grad_norm = reduce_and_clip_gradients(c_.grad_clip > 0 ? c_.grad_clip : 1e30);
  clock.ends(phases_.reduce);
  m.lr = current_lr();
  m.skip_reason = nonfinite_reason(m.loss, m.grad_norm);
  if (dp_) {  // loss and norm are the group's already; the ranks still decide together
    auto skip = torch::full({1}, int64_t(!m.skip_reason.empty()), torch::kInt64).to(dp_->device());
    dp_->all_reduce(skip, parallel::ReduceOp::max);
    if (skip.item<int64_t>() && m.skip_reason.empty())
      m.skip_reason =
          "another rank of data-parallel group '" + dp_->name() + "' found a non-finite loss or gradient norm";
  }
  m.skipped_nonfinite = !m.skip_reason.empty();
  if (m.skipped_nonfinite) {  // nothing applied: parameters, AdamW's moments and step count, lr, version
    zero_optimizer_gradients();
    if (uses_master_weights()) policy_->zero_grad();
    if (fsdp_) fsdp_->gather_all();  // the layers whole again, as they were
  } else {
    apply_update(m.lr);
  }
  clock.ends(phases_.optimizer);
  m.actor_train_time = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return m;
}

void Trainer::apply_update(double lr) {
  if (dp_) {
    // Each optimizer's all-gather queued behind its own update, so that the gathers run beside
    // the updates after them; then every parameter is whole again.
    for (auto& part : parts_)
      if (!part.unit) {
        part.optimizer->step(lr, /*gather=*/false);
        part.optimizer->start_gather_parameters();
      }
    if (fsdp_) fsdp_->step_and_gather_all(lr);
    for (auto& part : parts_)
      if (!part.unit) part.optimizer->finish_gather_parameters();
  } else {
    for (auto& g : optimizer_->param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
    if (steps_from_low_precision()) {
      LowPrecisionGradients low;
      for (auto i : low_precision_) {
        low.masters.push_back(masters_[i]);
        low.grads.push_back(params_[i].grad());
        low.params.push_back(params_[i]);
      }
      low.scale = clip_coefficient_;
      fused_adamw_step(*optimizer_, &low);
      ++version_;
      return;
    }
    fused_adamw_step(*optimizer_);
    std::vector<torch::Tensor> to, from;  // round to the policy's dtype, one launch
    for (auto i : low_precision_) {
      to.push_back(params_[i]);
      from.push_back(masters_[i]);
    }
    copy_tensors(to, from);
  }
  ++version_;
}

StepMetrics Trainer::step(std::vector<Sample> samples) {
  double log_probs_time = 0;
  if (c_.recompute_old_logprobs && dp_) {  // each rank its share, then every value everywhere
    const messaging::Stopwatch t;
    check_same_batch(*dp_, samples);  // before any rank may throw alone, as in train_step
    check_samples(samples, *policy_, c_.loss.kl_coef != 0, c_.logprobs.routing_replay);
    const auto mine = split_samples(samples, dp_->size())[std::size_t(dp_->rank())];
    std::vector<Sample> share;
    for (auto i : mine) share.push_back(samples[i]);
    auto old = completion_logprobs(*policy_, share, c_.logprobs);
    // [completion tokens of the batch]: this rank's values at its samples' offsets, 0 elsewhere;
    // summed over the group (x + 0 = x exactly), every rank holds every sample's values.
    std::vector<int64_t> offset(samples.size() + 1, 0);
    for (std::size_t i = 0; i < samples.size(); ++i) offset[i + 1] = offset[i] + int64_t(samples[i].completion.size());
    auto all = torch::zeros({offset.back()}, torch::kFloat32);
    for (std::size_t k = 0; k < mine.size(); ++k)
      all.narrow(0, offset[mine[k]], int64_t(old[k].size())).copy_(torch::tensor(old[k], torch::kFloat32));
    all = all.to(dp_->device());
    dp_->all_reduce(all);
    all = all.to(torch::kCPU).contiguous();
    const float* v = all.data_ptr<float>();
    for (std::size_t i = 0; i < samples.size(); ++i) samples[i].old_logprobs.assign(v + offset[i], v + offset[i + 1]);
    log_probs_time = t.seconds();
  } else if (c_.recompute_old_logprobs) {  // pi_old in its own pass (verl/slime "log_probs")
    check_samples(samples, *policy_, c_.loss.kl_coef != 0, c_.logprobs.routing_replay);  // before that forward
    const messaging::Stopwatch t;
    auto old = completion_logprobs(*policy_, samples, c_.logprobs);
    for (std::size_t i = 0; i < samples.size(); ++i) samples[i].old_logprobs = std::move(old[i]);
    log_probs_time = t.seconds();
  }
  auto m = train_step(samples);
  m.log_probs_time = log_probs_time;
  return m;
}

std::vector<std::vector<float>> completion_logprobs(model::CausalLM& model, const std::vector<Sample>& samples,
                                                    int64_t max_tokens_per_microbatch, bool routing_replay,
                                                    double temperature) {
  torch::NoGradGuard no_grad;
  if (routing_replay) check_routed_experts(samples, model, "log-probs");  // named here, not in the forward
  std::vector<std::vector<float>> out(samples.size());
  auto plan = plan_micro_batches(samples, max_tokens_per_microbatch);
  plan.resize(micro_batch_count(model.expert_parallel(), plan.size()));  // expert parallel: padded to the ep group's most
  for (const auto& idx : plan) {
    if (idx.empty()) {  // padding: the MoE's all-to-alls only
      padding_forward(model);
      continue;
    }
    auto p = pack(samples, idx, routing_replay);
    model::ForwardOptions opts;
    opts.replay_routed_experts = p.replay;
    opts.replay_topk_indices = p.replay_topk;
    auto fwd = model.forward(p.batch, opts);
    auto lp = model.token_logprobs(fwd, p.targets, 1024, temperature, p.completion_positions)  // [Tc]
                  .to(torch::kCPU)
                  .contiguous();
    const float* v = lp.data_ptr<float>();
    for (std::size_t k = 0; k < p.completion_sample.size(); ++k) out[idx[std::size_t(p.completion_sample[k])]].push_back(v[k]);
  }
  return out;
}

}  // namespace kiln::trainer

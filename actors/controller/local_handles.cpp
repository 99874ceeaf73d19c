#include "actors/controller/local_handles.hpp"

#include "actors/trainer/trainer_service.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "actors/trainer/trainer_service.hpp"
#include "kernels/device_memory.hpp"

namespace kiln::controller {

namespace {
constexpr auto kSyncTimeout = std::chrono::seconds(120);

// The completions as trainer samples (prompt, completion, routed experts, indexer selections): what a forward
// over them needs.
std::vector<trainer::Sample> as_samples(const std::vector<rollout::Completion>& completions) {
  std::vector<trainer::Sample> out(completions.size());
  for (std::size_t i = 0; i < completions.size(); ++i) {
    out[i].prompt = completions[i].prompt;
    out[i].completion = completions[i].tokens;
    out[i].routed_experts = completions[i].routed_experts;
    out[i].topk_indices = completions[i].topk_indices;
  }
  return out;
}
}  // namespace

LocalTrainer::LocalTrainer(std::shared_ptr<model::CausalLM> policy, const trainer::TrainerConfig& config,
                           messaging::Gateway& gateway, uint64_t bucket_bytes, parallel::ProcessGroups* ranks)
    : policy_(policy), trainer_(trainer::make_trainer(std::move(policy), config, ranks)), gw_(gateway),
      bucket_bytes_(bucket_bytes), logprobs_(config.logprobs) {}

trainer::StepMetrics LocalTrainer::train(std::vector<trainer::Sample> samples) {
  auto m = trainer_->step(std::move(samples));
  m.peak_memory_gib = {kernels::take_peak_memory_gib(policy_device())};  // this process's, since its last step
  return m;
}

PolicyWeights LocalTrainer::weights(bool copy) {
  PolicyWeights w{trainer_->version(), {}};
  for (auto& t : policy_->hf_state_dict())
    w.tensors.push_back(copy ? messaging::Tensor::copy_of(t.name, t.dtype, t.shape, t.data, t.nbytes) : t);
  return w;
}

void LocalTrainer::send(const PolicyWeights& w, const std::vector<std::string>& targets) {
  for (const auto& to : targets) {  // every target gets the version, each checks it before applying
    auto r = weight_sync::send_weights(gw_, to, w.tensors, w.version, bucket_bytes_, kSyncTimeout,
                                       policy_->weight_sync_groups());
    if (!r)
      throw std::runtime_error(to + ": weight sync of version " + std::to_string(w.version) + ": " + r.error().what());
  }
}

void LocalTrainer::send_collective(weight_sync::CollectiveSender& sender) {
  const auto experts = trainer::sync_expert_slices(*policy_, *trainer_);  // none without expert parallel
  sender.send(*policy_, trainer_->version(), bucket_bytes_, policy_->weight_sync_groups(/*hf_names=*/false), &experts);
}

void LocalTrainer::save(const std::filesystem::path& dir, const trainer::CheckpointState& state) {
  auto s = state;
  s.policy_version = trainer_->version();
  trainer::save_checkpoint(dir, *policy_, *trainer_, s);
}

trainer::CheckpointState LocalTrainer::load(const std::filesystem::path& dir) {
  return trainer::load_checkpoint(dir, *policy_, *trainer_);
}

std::vector<rollout::Completion> LocalTrainer::generate_colocated(std::vector<rollout::GenerationRequest> requests,
                                                                  const rollout::EngineOptions& engine, int64_t,
                                                                  const std::function<void()>& between_steps) {
  if (!engine_) engine_ = trainer::make_colocated_engine(policy_, *trainer_, engine);
  return engine_->generate(std::move(requests), trainer_->version(), between_steps);
}

void LocalTrainer::hold_reference(const model::ModelSpec& spec) {
  reference_ = std::make_unique<trainer::FrozenReference>(spec, *policy_, logprobs_);
}

std::vector<std::vector<float>> LocalTrainer::reference_logprobs(const std::vector<rollout::Completion>& completions) {
  if (!reference_) return TrainerHandle::reference_logprobs(completions);  // throws: none held
  return reference_->logprobs(as_samples(completions), /*routing_replay=*/true);
}

LocalEngine::LocalEngine(std::shared_ptr<model::CausalLM> model, const rollout::EngineOptions& options,
                         messaging::Gateway& controller_gateway)
    : engine_(std::move(model), options),
      gw_({"rollout", "inproc://kiln-run-" + std::to_string(::getpid()) + "-engine"}) {
  receiver_ = std::make_shared<weight_sync::ReceiverService>([this](std::vector<messaging::Tensor> t, int64_t v) {
    std::lock_guard<std::mutex> l(mu_);
    received_ = std::make_pair(std::move(t), v);
  });
  gw_.serve("weight_sync/0", [this, receiver = receiver_](messaging::Envelope env) {
    auto r = receiver->handle(env);
    if (r) gw_.reply(env, std::move(*r));
    else gw_.reply_error(env, r.error());
  });
  controller_gateway.add_route("weight_sync/0", gw_.endpoint());
}
LocalEngine::~LocalEngine() = default;

std::vector<rollout::Completion> LocalEngine::generate(std::vector<rollout::GenerationRequest> requests,
                                                       const std::function<void()>& between_steps) {
  std::vector<rollout::Completion> out;
  for (auto& r : requests) engine_.submit(std::move(r));
  while (engine_.has_work()) {
    for (auto& c : engine_.step()) out.push_back(std::move(c));
    between_steps();
  }
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.id < y.id; });
  return out;
}

void LocalEngine::load(const PolicyWeights& w, TrainerHandle& trainer) {
  trainer.send(w, {"weight_sync/0"});  // returns once the receiver verified and kept them
  std::optional<std::pair<std::vector<messaging::Tensor>, int64_t>> verified;
  {
    std::lock_guard<std::mutex> l(mu_);
    verified.swap(received_);
  }
  if (!verified) throw std::logic_error("weight sync acknowledged without a verified version");  // commit applies first
  engine_.pause();  // between decode steps
  engine_.update_weights(verified->first, verified->second);
  engine_.resume();
}

LocalReference::LocalReference(std::shared_ptr<model::CausalLM> model, const PolicyWeights& initial,
                               trainer::LogprobConfig config)
    : model_(std::move(model)), config_(config) {
  model_->set_batch_invariant(config_.true_on_policy);  // the policy's formula: KL compares like with like
  model_->load_hf_tensors(initial.tensors);
}

std::vector<std::vector<float>> LocalReference::logprobs(const std::vector<rollout::Completion>& completions) {
  return trainer::completion_logprobs(*model_, as_samples(completions), config_);
}

}  // namespace kiln::controller

#include "actors/trainer/trainer_service.hpp"

#include "kernels/device_memory.hpp"
#include "model/blocks/moe_ep.hpp"

#include <torch/torch.h>

#include <chrono>
#include <optional>
#include <cmath>

#include "actors/reference/ref_messages.hpp"
#include "actors/rollout/generate_messages.hpp"
#include "actors/trainer/frozen_reference.hpp"
#include "actors/trainer/checkpoint.hpp"
#include "actors/trainer/trainer.hpp"
#include "actors/weight_sync/service.hpp"
#include "messaging/hosting.hpp"
#include "messaging/gateway.hpp"
#include "messaging/replay_frames.hpp"
#include "messaging/torch_tensor.hpp"
#include "model/registry.hpp"

namespace kiln::trainer {

using namespace kiln::messaging;

struct TrainerService::State {
  Gateway& gw;
  std::string name;
  TrainerInit init;
  std::shared_ptr<model::CausalLM> policy;
  std::unique_ptr<Trainer> trainer;
  std::unique_ptr<rollout::ColocatedEngine> engine;  ///< trainer.generate's, built by the first
  std::unique_ptr<FrozenReference> reference;         ///< TrainerInit::reference: ref.logprobs'
  parallel::ProcessGroups* ranks = nullptr;
  State(Gateway& g, std::string n) : gw(g), name(std::move(n)) {}
};

TrainerService::TrainerService(Gateway& gateway, const std::string& name)
    : s_(std::make_unique<State>(gateway, name)) {}
TrainerService::TrainerService(Gateway& gateway, const std::string& name, parallel::ProcessGroups* ranks)
    : s_(std::make_unique<State>(gateway, name)) {
  s_->ranks = ranks;
}
TrainerService::~TrainerService() = default;

namespace {
// trainer.train's samples, checked against the policy before anything runs.
// Moves the samples' vectors out of `q` (decoded for this request only).
Expected<std::vector<Sample>> to_samples(const Envelope& request, TrainerTrain& q, int64_t vocab, bool need_ref) {
  auto bad = [](const std::string& what) { return make_error(ErrorCode::bad_message, "trainer.train: " + what); };
  if (q.samples.empty()) return bad("no samples");
  std::vector<int64_t> rows;
  for (const auto& spec : q.samples) rows.push_back(int64_t(spec.prompt.size() + spec.completion.size()) - 1);
  messaging::ReplayTensors replayed;
  try {
    replayed = messaging::read_replay_frames(request.tensors, rows, "trainer.train");
  } catch (const std::invalid_argument& e) {
    return make_error(ErrorCode::bad_message, e.what());
  }
  std::vector<Sample> out(q.samples.size());
  for (std::size_t i = 0; i < out.size(); ++i) {
    auto& spec = q.samples[i];
    const std::string who = "sample " + std::to_string(spec.id);
    if (spec.prompt.empty() || spec.completion.empty()) return bad(who + " has an empty prompt or completion");
    for (const auto* ids : {&spec.prompt, &spec.completion})
      for (auto t : *ids)
        if (t < 0 || t >= vocab)
          return bad(who + " has token id " + std::to_string(t) + " outside the vocabulary [0, " +
                     std::to_string(vocab) + ")");
    if (spec.behavior_logprobs.size() != spec.completion.size())
      return bad(who + " has " + std::to_string(spec.behavior_logprobs.size()) + " behaviour log-probs for " +
                 std::to_string(spec.completion.size()) + " completion tokens");
    if (need_ref ? spec.ref_logprobs.size() != spec.completion.size()
                 : !(spec.ref_logprobs.empty() || spec.ref_logprobs.size() == spec.completion.size()))
      return bad(who + " has " + std::to_string(spec.ref_logprobs.size()) + " reference log-probs for " +
                 std::to_string(spec.completion.size()) + " completion tokens" +
                 (need_ref ? " (the KL term needs one per token)" : ""));
    // NaN or inf here would poison the update (and every later one through AdamW's state).
    if (!std::isfinite(spec.advantage)) return bad(who + " has a non-finite advantage");
    for (const auto* v : {&spec.behavior_logprobs, &spec.ref_logprobs})
      for (float x : *v)
        if (!std::isfinite(x))
          return bad(who + " has a non-finite " + (v == &spec.ref_logprobs ? "reference" : "behaviour") + " log-prob");
    auto& s = out[i];
    if (!replayed.routed_experts.empty()) s.routed_experts = std::move(replayed.routed_experts[i]);
    if (!replayed.topk_indices.empty()) s.topk_indices = std::move(replayed.topk_indices[i]);
    s.prompt = std::move(spec.prompt);
    s.completion = std::move(spec.completion);
    s.behavior_logprobs = std::move(spec.behavior_logprobs);
    s.ref_logprobs = std::move(spec.ref_logprobs);
    s.advantage = spec.advantage;
  }
  return out;
}
}  // namespace

Expected<Envelope> TrainerService::handle(const Envelope& request) {
  auto reply = [&](const auto& value) { return make_envelope(value, Kind::reply, request.receiver, request.sender); };
  auto ready = [&] {
    const auto& p = *s_->policy;
    return TrainerReady{s_->trainer->version(), p.vocab_size(), p.num_moe_layers(), p.experts_per_token(),
                        p.num_experts()};
  };
  // Rank 0 asked this rank to join a gather of `version`: an error when this rank holds another.
  auto other_version = [&](int64_t version, const char* verb) -> std::optional<Error> {
    if (version == s_->trainer->version()) return std::nullopt;
    return make_error(ErrorCode::remote_error, request.type + ": rank 0 " + verb + " version " +
                                                   std::to_string(version) + ", this rank holds " +
                                                   std::to_string(s_->trainer->version()));
  };
  try {
    if (request.type == TrainerInit::kType) {
      auto init = payload_as<TrainerInit>(request);
      if (!init) return init.error();
      if (!(init->bucket_mib > 0)) return make_error(ErrorCode::bad_message, "trainer.init: bucket_mib must be > 0");
      try {
        init->trainer.validate([](const std::string& f) { return "trainer.init: trainer config: " + f; });
      } catch (const std::exception& e) {
        return make_error(ErrorCode::bad_message, e.what());
      }
      // As a one-process run builds its policy: the same seed, then the same registry call.
      torch::manual_seed(uint64_t(init->seed));
      auto policy = model::Registry::with_plugins().build(init->model, expert_slice_of(s_->ranks),
                                                                 ranks_on_this_host(s_->ranks));
      s_->trainer = make_trainer(policy, init->trainer, s_->ranks);
      s_->engine.reset();     // built over the policy replaced here
      s_->reference.reset();  // before any step: the initial weights
      if (init->reference) s_->reference = std::make_unique<FrozenReference>(init->model, *policy, init->trainer.logprobs);
      s_->policy = std::move(policy);
      s_->init = *init;
      return reply(ready());
    }
    const bool known = request.type == TrainerLoad::kType || request.type == TrainerTrain::kType ||
                       request.type == TrainerPushWeights::kType || request.type == TrainerSave::kType ||
                       request.type == TrainerGatherWeights::kType || request.type == TrainerSyncExperts::kType ||
                       request.type == TrainerGenerate::kType || request.type == RefLogprobs::kType;
    if (!known)
      return make_error(ErrorCode::unknown_type,
                        "actor '" + request.receiver + "' does not handle '" + request.type + "'");
    if (!s_->trainer) return make_error(ErrorCode::remote_error, request.type + " before trainer.init");
    if (request.type == TrainerLoad::kType) {
      auto q = payload_as<TrainerLoad>(request);
      if (!q) return q.error();
      load_checkpoint(q->dir, *s_->policy, *s_->trainer);
      return reply(ready());
    }
    if (request.type == TrainerTrain::kType) {
      auto q = payload_as<TrainerTrain>(request);
      if (!q) return q.error();
      auto samples = to_samples(request, *q, s_->policy->vocab_size(), s_->init.trainer.loss.kl_coef > 0);
      if (!samples) return samples.error();
      auto m = s_->trainer->step(std::move(*samples));
      m.peak_memory_gib = {kernels::take_peak_memory_gib(s_->policy->lm_head_weight().device())};
      return reply(TrainerStepResult{m, s_->trainer->version()});
    }
    if (request.type == TrainerGatherWeights::kType) {
      auto q = payload_as<TrainerGatherWeights>(request);
      if (!q) return q.error();
      if (auto e = other_version(q->version, "reads")) return *e;
      if (auto* ep = s_->policy->expert_parallel()) {
        // hf_state_dict's gathers, in its order (to_hf_state_dict gathers routed_expert_parameters()
        // as it meets them in parameters() order), each dropped on the device: only rank 0
        // keeps the host copy of the whole model (~60 GB at full size).
        torch::NoGradGuard no_grad;
        for (const auto& w : s_->policy->routed_expert_parameters()) (void)model::gather_experts(w, *ep);
      }
      return reply(TrainerPushed{s_->trainer->version()});
    }
    if (request.type == TrainerSyncExperts::kType) {
      auto q = payload_as<TrainerSyncExperts>(request);
      if (!q) return q.error();
      if (auto e = other_version(q->version, "sends")) return *e;
      weight_sync::join_expert_gathers(*s_->policy, sync_expert_slices(*s_->policy, *s_->trainer),
                                       s_->policy->weight_sync_groups(/*hf_names=*/false));
      return reply(TrainerPushed{s_->trainer->version()});
    }
    if (request.type == RefLogprobs::kType) {
      if (!s_->reference)
        return make_error(ErrorCode::remote_error, "ref.logprobs: this trainer rank holds no reference "
                                                   "(trainer.init without reference: placement.reference is not \"colocated\")");
      bool replay = false;
      auto samples = reference::requested_samples(request, &replay);
      if (!samples) return samples.error();
      return reply(RefLogprobsResult{s_->reference->logprobs(*samples, replay)});
    }
    if (request.type == TrainerGenerate::kType) {
      auto q = payload_as<TrainerGenerate>(request);
      if (!q) return q.error();
      if (auto e = other_version(q->version, "generates with")) return *e;
      if (!s_->engine) s_->engine = make_colocated_engine(s_->policy, *s_->trainer, q->engine);
      std::vector<rollout::GenerationRequest> requests;
      for (const auto& r : q->requests) requests.push_back(rollout::from_spec(r));
      return rollout::result_reply(request, s_->engine->generate(std::move(requests), s_->trainer->version()));
    }
    if (request.type == TrainerPushWeights::kType) {
      auto q = payload_as<TrainerPushWeights>(request);
      if (!q) return q.error();
      if (q->targets.empty()) return make_error(ErrorCode::bad_message, "trainer.push_weights: no targets");
      const int64_t version = s_->trainer->version();
      // No copies: requests run one at a time, so the policy cannot change during the push.
      auto tensors = s_->policy->hf_state_dict();
      for (const auto& to : q->targets) {
        auto r = weight_sync::send_weights(s_->gw, to, tensors, version, uint64_t(s_->init.bucket_mib * (1 << 20)),
                                           std::chrono::seconds(120), s_->policy->weight_sync_groups());
        if (!r)  // remote_error: the trainer is fine, the target is not (the caller tells them apart)
          return make_error(ErrorCode::remote_error, "weight sync of version " + std::to_string(version) + " to " +
                                                         to + ": " + r.error().what());
      }
      return reply(TrainerPushed{version});
    }
    auto q = payload_as<TrainerSave>(request);  // trainer.save
    if (!q) return q.error();
    if (q->dir.empty()) return make_error(ErrorCode::bad_message, "trainer.save: empty dir");
    CheckpointState state{q->step, s_->trainer->version(), q->prompt_rng, {}};
    for (const auto& t : request.tensors)
      if (t.name == TrainerSave::kInFlightFrame && t.dtype == messaging::DType::uint8)
        state.in_flight_rollouts.assign(reinterpret_cast<const char*>(t.data), t.nbytes);
      else
        return make_error(ErrorCode::bad_message, "trainer.save: unexpected tensor frame '" + t.name + "'");
    save_checkpoint(q->dir, *s_->policy, *s_->trainer, state);
    return reply(TrainerPushed{s_->trainer->version()});
  } catch (const c10::Error& e) {  // LibTorch's: without its C++ backtrace
    return make_error(failure_code(), std::string(request.type) + ": " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return make_error(failure_code(), std::string(request.type) + ": " + e.what());
  }
}

bool TrainerService::collectives_failed() const { return s_->ranks && s_->ranks->failed(); }

messaging::ErrorCode TrainerService::failure_code() const {
  return collectives_failed() ? ErrorCode::collective_failed : ErrorCode::remote_error;
}

std::unique_ptr<rollout::ColocatedEngine> make_colocated_engine(std::shared_ptr<model::CausalLM> policy,
                                                               const Trainer& trainer,
                                                               const rollout::EngineOptions& options) {
  if (trainer.fully_sharded())
    throw std::invalid_argument("a colocated engine (placement.mode = \"colocated\") over a fully sharded trainer "
                                "(parallel.fsdp): its decoder layers are shards between steps; turn parallel.fsdp off");
  return std::make_unique<rollout::ColocatedEngine>(std::move(policy), options);
}

weight_sync::ExpertSlices sync_expert_slices(model::CausalLM& policy, const Trainer& trainer) {
  weight_sync::ExpertSlices out;
  out.ep = trainer.expert_parallel().experts;
  if (!out.ep) return out;
  const auto experts = policy.routed_expert_parameters();
  for (const auto& p : policy.named_parameters())
    for (const auto& e : experts)
      if (e.is_same(p.value())) out.names.push_back(p.key());
  return out;
}

Envelope train_request(const std::vector<Sample>& samples, const std::string& sender, const std::string& receiver) {
  TrainerTrain q;
  std::vector<torch::Tensor> experts, selections;
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const auto& s = samples[i];
    q.samples.push_back({uint64_t(i), s.prompt, s.completion, s.behavior_logprobs, s.ref_logprobs, s.advantage});
    experts.push_back(s.routed_experts);
    selections.push_back(s.topk_indices);
  }
  auto env = make_envelope(q, Kind::request, sender, receiver);
  env.tensors = messaging::replay_frames(experts, selections);  // none when a sample has none: the receiver routes itself
  return env;
}

void register_trainer_actor_kind() { messaging::register_service_kind<TrainerService>("trainer"); }

}  // namespace kiln::trainer

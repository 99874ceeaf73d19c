#include "actors/reference/ref_service.hpp"

#include "actors/trainer/trainer.hpp"
#include "actors/weight_sync/service.hpp"
#include "messaging/hosting.hpp"
#include "actors/reference/messages.hpp"
#include "actors/reference/ref_messages.hpp"
#include "actors/weight_sync/messages.hpp"
#include "messaging/torch_tensor.hpp"
#include "model/registry.hpp"

namespace kiln::reference {

using namespace kiln::messaging;

struct RefService::State {
  std::shared_ptr<model::CausalLM> model;
  RefInit init;
  int64_t weights_version = -1;
  std::unique_ptr<weight_sync::ReceiverService> weights;
};

RefService::RefService() : s_(std::make_unique<State>()) {
  s_->weights = std::make_unique<weight_sync::ReceiverService>([this](std::vector<Tensor> t, int64_t version) {
    if (!s_->model) throw std::logic_error("weights before ref.init");
    s_->model->load_hf_tensors(t);  // the full set, checked by the receiver first
    s_->weights_version = version;
  });
}
RefService::~RefService() = default;

Expected<Envelope> RefService::handle(const Envelope& request) {
  try {
    if (request.type == RefInit::kType) {
      auto init = payload_as<RefInit>(request);
      if (!init) return init.error();
      if (init->logprobs.max_tokens_per_microbatch < 1)
        return make_error(ErrorCode::bad_message, "ref.init: max_tokens_per_microbatch must be >= 1");
      if (!(init->logprobs.temperature > 0)) return make_error(ErrorCode::bad_message, "ref.init: temperature must be > 0");
      s_->model = model::Registry::with_plugins().build(init->model);
      s_->model->set_batch_invariant(init->logprobs.true_on_policy);  // the policy's formula
      s_->init = *init;
      s_->weights_version = -1;
      return make_envelope(RefReady{s_->weights_version}, Kind::reply, request.receiver, request.sender);
    }
    if (request.type == WeightSyncBucket::kType || request.type == WeightSyncCommit::kType)
      return s_->weights->handle(request);
    if (request.type == RefLogprobs::kType) {
      if (!s_->model) return make_error(ErrorCode::remote_error, "ref.logprobs before ref.init");
      if (s_->weights_version < 0)
        return make_error(ErrorCode::remote_error, "ref.logprobs before the reference weights arrived");
      bool replay = false;
      auto samples = requested_samples(request, &replay);
      if (!samples) return samples.error();
      RefLogprobsResult r;
      auto config = s_->init.logprobs;
      config.routing_replay &= replay;
      r.logprobs = trainer::completion_logprobs(*s_->model, *samples, config);
      return make_envelope(r, Kind::reply, request.receiver, request.sender);
    }
  } catch (const std::exception& e) {
    return make_error(ErrorCode::remote_error, std::string(request.type) + ": " + e.what());
  }
  return make_error(ErrorCode::unknown_type, "actor '" + request.receiver + "' does not handle '" + request.type + "'");
}

void register_ref_actor_kind() { messaging::register_service_kind<RefService>("ref"); }

}  // namespace kiln::reference

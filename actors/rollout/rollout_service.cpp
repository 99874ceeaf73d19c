#include "actors/rollout/rollout_service.hpp"

#include "actors/rollout/engine.hpp"
#include "actors/rollout/generate_messages.hpp"
#include "actors/weight_sync/collective.hpp"
#include "actors/weight_sync/service.hpp"
#include "messaging/hosting.hpp"
#include "actors/rollout/messages.hpp"
#include "actors/weight_sync/messages.hpp"
#include "messaging/torch_tensor.hpp"
#include "model/registry.hpp"

namespace kiln::rollout {

using namespace kiln::messaging;

struct RolloutService::State {
  std::shared_ptr<model::CausalLM> model;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<weight_sync::ReceiverService> weights;
  weight_sync::CollectiveReceiver collective;  ///< weight_sync.join_group / weight_sync.collective
};

RolloutService::RolloutService() : s_(std::make_unique<State>()) {
  s_->weights = std::make_unique<weight_sync::ReceiverService>([this](std::vector<Tensor> t, int64_t version) {
    if (!s_->engine) throw std::logic_error("weights before rollout.init");
    s_->engine->pause();  // requests are handled one at a time: we are between generations
    s_->engine->update_weights(t, version);
    s_->engine->resume();
  });
}
RolloutService::~RolloutService() = default;

Expected<Envelope> RolloutService::handle(const Envelope& request) {
  try {
    if (request.type == RolloutInit::kType) {
      auto init = payload_as<RolloutInit>(request);
      if (!init) return init.error();
      s_->model = model::Registry::with_plugins().build(init->model);
      s_->engine = std::make_unique<Engine>(s_->model, init->engine);
      return make_envelope(RolloutReady{0}, Kind::reply, request.receiver, request.sender);
    }
    if (request.type == WeightSyncBucket::kType || request.type == WeightSyncCommit::kType)
      return s_->weights->handle(request);
    if (request.type == WeightSyncJoinGroup::kType || request.type == WeightSyncCollective::kType) {
      if (!s_->engine) return make_error(ErrorCode::remote_error, request.type + " before rollout.init");
      if (request.type == WeightSyncJoinGroup::kType)
        return s_->collective.join(request, s_->model->lm_head_weight().device());
      s_->engine->pause();  // requests are handled one at a time: we are between generations
      auto r = s_->collective.receive(request, *s_->model);
      if (r) s_->engine->weights_written(payload_as<WeightSyncAck>(*r)->version);
      s_->engine->resume();
      return r;
    }
    if (request.type == RolloutGenerate::kType) {
      if (!s_->engine) return make_error(ErrorCode::remote_error, "rollout.generate before rollout.init");
      if (s_->collective.torn())
        return make_error(ErrorCode::remote_error, "rollout.generate: the engine's weights mix two versions (a "
                                                   "collective weight sync failed part-way); load a version first");
      auto g = payload_as<RolloutGenerate>(request);
      if (!g) return g.error();
      for (const auto& r : g->requests) s_->engine->submit(from_spec(r));  // throws std::invalid_argument naming the fault
      std::vector<Completion> done;
      while (s_->engine->has_work())
        for (auto& c : s_->engine->step()) done.push_back(std::move(c));
      return result_reply(request, done);
    }
  } catch (const std::exception& e) {
    return make_error(ErrorCode::remote_error, std::string(request.type) + ": " + e.what());
  }
  return make_error(ErrorCode::unknown_type, "actor '" + request.receiver + "' does not handle '" + request.type + "'");
}

void register_rollout_actor_kind() { messaging::register_service_kind<RolloutService>("rollout"); }

}  // namespace kiln::rollout

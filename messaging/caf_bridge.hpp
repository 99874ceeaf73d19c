#pragma once
// The CAF side of the gateway: local CAF actors reachable by logical name.
//
// An envelope for logical name N reaches the CAF actor bound to N as a CAF message holding
// one kiln::messaging::Envelope. A *service* is a plain class (no CAF in its header) with
//     Expected<Envelope> handle(const Envelope& request);
// spawn_service() hosts it in a CAF actor that answers every request with handle()'s reply
// (or an error envelope) and ignores the return value for tells.
#include <caf/all.hpp>
#include <memory>
#include <string>

#include "messaging/gateway.hpp"

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(kiln::messaging::Envelope)

namespace kiln::messaging {

/// Delivers every envelope for `name` to `actor` (asynchronously, as a CAF message).
inline void bind_actor(Gateway& gateway, const std::string& name, caf::actor actor) {
  gateway.serve(name, [actor = std::move(actor)](Envelope env) { caf::anon_send(actor, std::move(env)); });
}

/// Spawns a CAF actor around `service` and binds it to `name` on `gateway`. Detached
/// actors get their own thread (use it for services that block: GPU work, long steps).
/// `gateway` must outlive the actor.
template <class Service>
caf::actor spawn_service(caf::actor_system& system, Gateway& gateway, const std::string& name,
                         std::shared_ptr<Service> service, bool detached = false) {
  auto behavior = [&gateway, service](caf::event_based_actor*) -> caf::behavior {
    return {[&gateway, service](Envelope& env) {
      auto reply = service->handle(env);
      if (env.kind != Kind::request) return;
      if (reply) gateway.reply(env, std::move(*reply));
      else gateway.reply_error(env, reply.error());
    }};
  };
  caf::actor a = detached ? caf::actor{system.spawn<caf::detached>(behavior)}
                          : caf::actor{system.spawn(behavior)};
  bind_actor(gateway, name, a);
  return a;
}

}  // namespace kiln::messaging

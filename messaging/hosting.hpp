#pragma once
// The kinds of actor a process can host (the part of a logical name before '/': "rollout" in
// "rollout/0"). Each actor family registers its kind at start-up with a factory for the
// handler of a new actor; a node (`kiln node`, experiments/node.cpp) then spawns the actors
// it is asked to host. Every hosted actor is a detached CAF actor (its own thread) that
// answers one request at a time (messaging/caf_bridge.hpp).
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "messaging/envelope.hpp"

namespace caf {  // (no CAF headers here: torch-using services include this file)
class actor;
class actor_system;
}  // namespace caf

namespace kiln::messaging {

class Gateway;

/// A service's request handler: the reply, or an Error sent back as an error reply.
using ServiceHandler = std::function<Expected<Envelope>(const Envelope&)>;
/// Makes the handler of a new actor (the node's gateway, for actors that send requests of their
/// own; node name; actor name).
using ServiceFactory = std::function<ServiceHandler(Gateway& gateway, const std::string& node, const std::string& name)>;

/// Adds (or replaces) a kind of actor this process can host.
void register_actor_kind(const std::string& kind, ServiceFactory factory);
/// Kinds registered so far, sorted.
std::vector<std::string> hostable_actor_kinds();
/// Spawns actor `name` ("<kind>/<index>") of a registered kind on `gateway`. Throws
/// std::invalid_argument naming the kind and the hostable kinds when the kind is unknown.
caf::actor spawn_actor(caf::actor_system& system, Gateway& gateway, const std::string& node, const std::string& name);

/// register_actor_kind for a plain service class with `handle(const Envelope&)`: one fresh
/// Service per hosted actor, constructed from (Gateway&, actor name) when it has such a
/// constructor, from (node name, actor name) when it has that one, else default-constructed.
template <class Service>
void register_service_kind(const std::string& kind) {
  register_actor_kind(kind, [](Gateway& gw, const std::string& node, const std::string& name) -> ServiceHandler {
    std::shared_ptr<Service> svc;
    if constexpr (std::is_constructible_v<Service, Gateway&, const std::string&>)
      svc = std::make_shared<Service>(gw, name);
    else if constexpr (std::is_constructible_v<Service, const std::string&, const std::string&>)
      svc = std::make_shared<Service>(node, name);
    else
      svc = std::make_shared<Service>();
    return [svc](const Envelope& e) { return svc->handle(e); };
  });
}

}  // namespace kiln::messaging

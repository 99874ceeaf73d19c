#pragma once
// `kiln node`: a process that joins an actor graph and hosts the actors it is given.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <type_traits>

#include "messaging/envelope.hpp"

namespace kiln::messaging {
class Gateway;
}

namespace kiln::experiments {

struct NodeOptions {
  std::string name = "node";        ///< node name (logs, directory)
  std::string bind;                 ///< endpoint to bind, e.g. tcp://127.0.0.1:0 or ipc:///tmp/n.sock
  std::string join;                 ///< root gateway endpoint to join; empty: this node is the root
  std::vector<std::string> actors;  ///< logical names to host, "<kind>/<index>", e.g. diag/0
  int join_timeout_ms = 10000;
  /// > 0: stop (as on SIGTERM) when this parent process dies (Linux PR_SET_PDEATHSIG); the
  /// node exits at once if that process is already gone. Set by `kiln run` for its children.
  int64_t exit_with_parent = 0;
};

/// Kinds of actor a node can host (the part of a logical name before '/').
std::vector<std::string> hostable_actor_kinds();

/// A service's request handler (see messaging/caf_bridge.hpp: one request at a time, in its
/// own detached CAF actor).
using ServiceHandler = std::function<messaging::Expected<messaging::Envelope>(const messaging::Envelope&)>;
/// Makes the handler of a new actor (the node's gateway, for actors that send requests of their
/// own; node name; actor name).
using ServiceFactory =
    std::function<ServiceHandler(messaging::Gateway& gateway, const std::string& node, const std::string& name)>;
/// Adds a kind of actor nodes can host (e.g. "rollout", registered by the LibTorch build).
void register_actor_kind(const std::string& kind, ServiceFactory factory);
/// register_actor_kind for a plain service class with `handle(const Envelope&)`: one fresh
/// Service per hosted actor, constructed from (Gateway&, actor name) when it has such a
/// constructor, else default-constructed.
template <class Service>
void register_service_kind(const std::string& kind) {
  register_actor_kind(kind, [](messaging::Gateway& gw, const std::string&, const std::string& name) -> ServiceHandler {
    std::shared_ptr<Service> svc;
    if constexpr (std::is_constructible_v<Service, messaging::Gateway&, const std::string&>)
      svc = std::make_shared<Service>(gw, name);
    else
      svc = std::make_shared<Service>();
    return [svc](const messaging::Envelope& e) { return svc->handle(e); };
  });
}

/// Runs the node until SIGINT or SIGTERM. Prints "kiln node NAME ready at ENDPOINT" on
/// stdout once it hosts its actors and has joined. Returns the process exit code; a bad
/// option (unknown actor kind, endpoint that cannot be bound, root that does not answer)
/// is reported on stderr with exit code 2.
int run_node(const NodeOptions& options);

}  // namespace kiln::experiments

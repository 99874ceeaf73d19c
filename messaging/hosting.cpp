#include "messaging/hosting.hpp"

#include <map>
#include <mutex>
#include <stdexcept>

#include "messaging/caf_bridge.hpp"

namespace kiln::messaging {

namespace {
struct Kinds {
  std::mutex mu;
  std::map<std::string, ServiceFactory> factories;
};
Kinds& kinds() {
  static Kinds k;
  return k;
}
// A plain handler as a service for spawn_service.
struct HandlerService {
  ServiceHandler fn;
  Expected<Envelope> handle(const Envelope& e) { return fn(e); }
};
}  // namespace

void register_actor_kind(const std::string& kind, ServiceFactory factory) {
  std::lock_guard<std::mutex> l(kinds().mu);
  kinds().factories[kind] = std::move(factory);
}

std::vector<std::string> hostable_actor_kinds() {
  std::lock_guard<std::mutex> l(kinds().mu);
  std::vector<std::string> out;
  for (const auto& [k, f] : kinds().factories) out.push_back(k);
  return out;
}

caf::actor spawn_actor(caf::actor_system& system, Gateway& gateway, const std::string& node, const std::string& name) {
  const auto kind = name.substr(0, name.find('/'));
  ServiceFactory factory;
  {
    std::lock_guard<std::mutex> l(kinds().mu);
    auto it = kinds().factories.find(kind);
    if (it != kinds().factories.end()) factory = it->second;
  }
  if (!factory) {
    std::string known;
    for (const auto& k : hostable_actor_kinds()) known += (known.empty() ? "" : ", ") + k;
    throw std::invalid_argument("actor '" + name + "' has unknown kind '" + kind + "' (hostable kinds: " + known + ")");
  }
  // Detached: services block their thread (GPU work, long steps, diag.sleep).
  return spawn_service(system, gateway, name, std::make_shared<HandlerService>(HandlerService{factory(gateway, node, name)}),
                       /*detached=*/true);
}

}  // namespace kiln::messaging

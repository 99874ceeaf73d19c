#include "experiments/node.hpp"

#include <signal.h>
#include <spdlog/spdlog.h>

#include <caf/all.hpp>
#include <cstdio>
#include <functional>
#include <map>
#include <regex>

#include <sys/prctl.h>
#include <unistd.h>
#include <set>
#include <thread>

#include "actors/diag/diag_service.hpp"
#include "messaging/caf_bridge.hpp"

namespace kiln::experiments {

namespace {
using SpawnFn = std::function<caf::actor(caf::actor_system&, messaging::Gateway&, const std::string& node,
                                         const std::string& name)>;

std::map<std::string, SpawnFn>& actor_factories() {
  static std::map<std::string, SpawnFn> f = {
      {"diag",
       [](caf::actor_system& sys, messaging::Gateway& gw, const std::string& node, const std::string& name) {
         // Detached: diag.sleep blocks its thread on purpose.
         return messaging::spawn_service(sys, gw, name, std::make_shared<actors::DiagService>(node, name),
                                         /*detached=*/true);
       }},
  };
  return f;
}
// A plain handler as a service for spawn_service.
struct HandlerService {
  ServiceHandler fn;
  messaging::Expected<messaging::Envelope> handle(const messaging::Envelope& e) { return fn(e); }
};
}  // namespace

void register_actor_kind(const std::string& kind, ServiceFactory factory) {
  actor_factories()[kind] = [factory](caf::actor_system& sys, messaging::Gateway& gw, const std::string& node,
                                      const std::string& name) {
    return messaging::spawn_service(sys, gw, name, std::make_shared<HandlerService>(HandlerService{factory(gw, node, name)}),
                                    /*detached=*/true);
  };
}

std::vector<std::string> hostable_actor_kinds() {
  std::vector<std::string> kinds;
  for (const auto& [k, f] : actor_factories()) kinds.push_back(k);
  return kinds;
}

int run_node(const NodeOptions& options) {
  if (options.bind.empty()) {
    std::fprintf(stderr, "kiln node: --bind must name an endpoint (inproc://, ipc://, tcp://host:port)\n");
    return 2;
  }
  std::set<std::string> seen;
  static const std::regex name_re("[a-z_][a-z0-9_]*/[0-9]+");
  for (const auto& a : options.actors) {
    if (!std::regex_match(a, name_re)) {
      std::fprintf(stderr, "kiln node: actor name '%s' is not <kind>/<index> (e.g. diag/0)\n", a.c_str());
      return 2;
    }
    if (!seen.insert(a).second) {
      std::fprintf(stderr, "kiln node: actor '%s' given twice\n", a.c_str());
      return 2;
    }
  }
  for (const auto& a : options.actors) {
    auto kind = a.substr(0, a.find('/'));
    if (!actor_factories().count(kind)) {
      std::string known;
      for (const auto& k : hostable_actor_kinds()) known += (known.empty() ? "" : ", ") + k;
      std::fprintf(stderr, "kiln node: actor '%s' has unknown kind '%s' (hostable kinds: %s)\n", a.c_str(),
                   kind.c_str(), known.c_str());
      return 2;
    }
  }
  // Block the stop signals before any thread starts, so that sigwait below receives them.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  if (options.exit_with_parent > 0) {  // SIGTERM when the parent dies: the stop path below
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (int64_t(::getppid()) != options.exit_with_parent) {
      std::fprintf(stderr, "kiln node: parent process %lld is gone\n", (long long)options.exit_with_parent);
      return 2;
    }
  }

  std::unique_ptr<messaging::Gateway> gateway;
  try {
    gateway = std::make_unique<messaging::Gateway>(messaging::Gateway::Options{options.name, options.bind});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln node: %s\n", e.what());
    return 2;
  }
  caf::actor_system_config cfg;
  caf::actor_system system{cfg};
  std::vector<caf::actor> hosted;
  for (const auto& a : options.actors)
    hosted.push_back(actor_factories().at(a.substr(0, a.find('/')))(system, *gateway, options.name, a));
  if (!options.join.empty()) {
    auto dir = gateway->join(options.join, std::chrono::milliseconds(options.join_timeout_ms));
    if (!dir) {
      std::fprintf(stderr, "kiln node: cannot join graph at %s: %s\n", options.join.c_str(), dir.error().what().c_str());
      for (auto& h : hosted) caf::anon_send_exit(h, caf::exit_reason::user_shutdown);
      hosted.clear();
      system.await_all_actors_done();
      gateway.reset();
      return 2;
    }
  }
  std::printf("kiln node %s ready at %s\n", options.name.c_str(), gateway->endpoint().c_str());
  std::fflush(stdout);
  int sig = 0;
  sigwait(&stop, &sig);
  spdlog::info("kiln node {}: signal {}, stopping", options.name, sig);
  for (auto& h : hosted) caf::anon_send_exit(h, caf::exit_reason::user_shutdown);
  hosted.clear();
  // An actor busy in a long request cannot see the exit message: do not wait for it forever.
  std::thread([] {
    std::this_thread::sleep_for(std::chrono::seconds(5));
    std::fprintf(stderr, "kiln node: actors did not stop within 5 s of the signal; exiting anyway\n");
    std::_Exit(0);
  }).detach();
  system.await_all_actors_done();  // no actor may still be replying through the gateway
  gateway.reset();                 // drops the gateway's handles on the actors
  return 0;
}

}  // namespace kiln::experiments

#include "experiments/node.hpp"

#include <signal.h>
#include <spdlog/spdlog.h>

#include <caf/all.hpp>
#include <cstdio>
#include <algorithm>
#include <regex>

#include <sys/prctl.h>
#include <unistd.h>
#include <set>
#include <thread>

#include "messaging/gateway.hpp"
#include "messaging/hosting.hpp"

namespace kiln::experiments {

int run_node(const NodeOptions& options) {
  if (options.bind.empty()) {
    std::fprintf(stderr, "kiln node: --bind must name an endpoint (inproc://, ipc://, tcp://host:port)\n");
    return 2;
  }
  // A TCP endpoint's port: a number in [0, 65535] or ZeroMQ's "*" (ZeroMQ itself reads
  // tcp://host:99999 as port 34463).
  for (const auto& [option, endpoint] : {std::pair<const char*, const std::string*>{"--bind", &options.bind},
                                         {"--join", &options.join}}) {
    if (endpoint->rfind("tcp://", 0) != 0) continue;
    const auto colon = endpoint->rfind(':');
    const std::string port = colon < 6 ? "" : endpoint->substr(colon + 1);
    const bool number = !port.empty() && port.size() <= 5 && port.find_first_not_of("0123456789") == std::string::npos;
    if (port != "*" && !(number && std::stol(port) <= 65535)) {
      std::fprintf(stderr, "kiln node: %s '%s' must end in :PORT, PORT in [0, 65535] (or * on --bind)\n", option,
                   endpoint->c_str());
      return 2;
    }
  }
  std::set<std::string> seen;
  static const std::regex name_re("[a-z_][a-z0-9_]*/[0-9]{1,9}");
  for (const auto& a : options.actors) {
    if (!std::regex_match(a, name_re)) {
      std::fprintf(stderr, "kiln node: actor name '%s' is not <kind>/<index> (e.g. diag/0; index of up to 9 digits)\n", a.c_str());
      return 2;
    }
    if (!seen.insert(a).second) {
      std::fprintf(stderr, "kiln node: actor '%s' given twice\n", a.c_str());
      return 2;
    }
  }
  const auto kinds = messaging::hostable_actor_kinds();
  for (const auto& a : options.actors) {
    auto kind = a.substr(0, a.find('/'));
    if (std::find(kinds.begin(), kinds.end(), kind) == kinds.end()) {
      std::string known;
      for (const auto& k : kinds) known += (known.empty() ? "" : ", ") + k;
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
    hosted.push_back(messaging::spawn_actor(system, *gateway, options.name, a));
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

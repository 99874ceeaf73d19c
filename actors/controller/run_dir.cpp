#include "actors/controller/run_dir.hpp"

#include <signal.h>
#include <unistd.h>

#include <cstdio>

namespace kiln::controller {

namespace fs = std::filesystem;

fs::path checkpoint_dir(const fs::path& run, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%06lld", (long long)step);
  return run / "checkpoints" / name;
}

std::string continue_hint(const fs::path& run) {
  fs::path newest;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run / "checkpoints", ec)) {
    const auto name = e.path().filename().string();
    if (name.rfind("step_", 0) == 0 && name.find('.') == std::string::npos && fs::exists(e.path() / "state.json") &&
        (newest.empty() || name > newest.filename().string()))
      newest = e.path();
  }
  if (newest.empty())
    return "kiln run: no checkpoint was written (run.checkpoint_every = 0): start again, with checkpoints\n";
  return "kiln run: the steps after it are lost; continue with --set run.resume_from=" + newest.string() + "\n";
}

namespace {
// What the signal handler needs, in fixed buffers (async-signal-safe: unlink, write, raise).
constexpr int kMaxSockets = 80;
char g_sockets[kMaxSockets][108];
volatile std::sig_atomic_t g_socket_count = 0;
char g_message[1024];
volatile std::sig_atomic_t g_message_size = 0;

extern "C" void remove_sockets_and_die(int sig) {
  for (int i = 0; i < g_socket_count; ++i) ::unlink(g_sockets[i]);
  [[maybe_unused]] auto n = ::write(2, g_message, std::size_t(g_message_size));
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}
}  // namespace

RunSockets::RunSockets(const std::string& tag, int64_t engines, const std::string& interrupted) {
  paths_ = {tag + "-controller", tag + "-rollout", tag + "-ref", tag + "-trainer"};
  for (int64_t i = 1; i < engines; ++i) paths_.push_back(tag + "-rollout-" + std::to_string(i));
  int n = 0;
  for (const auto& p : paths_)
    if (n < kMaxSockets && p.size() < sizeof g_sockets[0]) std::snprintf(g_sockets[n++], sizeof g_sockets[0], "%s", p.c_str());
  g_socket_count = n;
  const int size = std::snprintf(g_message, sizeof g_message, "%s\n", interrupted.c_str());
  g_message_size = size < int(sizeof g_message) ? size : int(sizeof g_message) - 1;
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) std::signal(sig, remove_sockets_and_die);
}

RunSockets::~RunSockets() {
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) std::signal(sig, SIG_DFL);
  g_socket_count = 0;
  for (const auto& p : paths_) std::remove(p.c_str());
}

}  // namespace kiln::controller

#include "experiments/ranks.hpp"

#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <deque>
#include <mutex>
#include <thread>

#include "actors/controller/loop.hpp"
#include "actors/controller/trainer_ranks.hpp"
#include "actors/trainer/trainer_service.hpp"
#include "messaging/gateway.hpp"
#include "parallel/process_group.hpp"

extern char** environ;

namespace kiln::experiments {

namespace {

using controller::kRankDoneKey;
using controller::kRunOverKey;
using controller::kTrainerRankEndpointKey;

// Set in the ranks this program starts itself: the pid of rank 0, whose death stops them.
constexpr const char* kParentVariable = "KILN_RANK_PARENT";

// Ranks 1..world-1 of a launch without launcher, as torchrun would start them.
std::vector<pid_t> start_ranks(const parallel::LaunchInfo& info, const std::vector<std::string>& argv) {
  std::vector<pid_t> pids;
  for (int r = 1; r < info.world_size; ++r) {
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) env.emplace_back(*e);
    for (const auto& [k, v] : std::vector<std::pair<std::string, std::string>>{
             {"RANK", std::to_string(r)},
             {"WORLD_SIZE", std::to_string(info.world_size)},
             {"LOCAL_RANK", std::to_string(r)},
             {"LOCAL_WORLD_SIZE", std::to_string(info.world_size)},
             {"MASTER_ADDR", info.master_addr},
             {"MASTER_PORT", std::to_string(info.master_port)},
             {kParentVariable, std::to_string(::getpid())}})
      env.push_back(k + "=" + v);
    std::vector<char*> args, envp;
    auto argv_copy = argv;
    for (auto& a : argv_copy) args.push_back(a.data());
    args.push_back(nullptr);
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);  // Ctrl-C reaches rank 0 alone
    posix_spawnattr_setpgroup(&attr, 0);
    pid_t pid = -1;
    const int rc = posix_spawn(&pid, "/proc/self/exe", nullptr, &attr, args.data(), envp.data());
    posix_spawnattr_destroy(&attr);
    if (rc != 0) {
      for (pid_t p : pids) ::kill(p, SIGKILL);
      throw std::runtime_error("cannot start trainer rank " + std::to_string(r) + ": " + std::strerror(rc));
    }
    pids.push_back(pid);
  }
  return pids;
}

// Waits up to `seconds` for the ranks this program started, then kills those left. Returns
// a description of the ranks that did not exit with `expected` (rank 0's own exit code, which
// they were told to take), "" when all did.
// How rank `r` (pid `pid`) ended, when not with `expected`: "rank R (pid P) exit code C" or
// "... killed by signal S"; "" when it exited with `expected`.
std::string ended_badly(std::size_t r, pid_t pid, int status, int expected) {
  if (WIFEXITED(status) && WEXITSTATUS(status) == expected) return "";
  return "rank " + std::to_string(r) + " (pid " + std::to_string(pid) + ") " +
         (WIFSIGNALED(status) ? "killed by signal " + std::to_string(WTERMSIG(status))
                              : "exit code " + std::to_string(WEXITSTATUS(status)));
}

void add_item(std::string& list, const std::string& item) {
  if (!item.empty()) list += (list.empty() ? "" : "; ") + item;
}

std::string reap(const std::vector<pid_t>& pids, int seconds, int expected) {
  std::string failed;
  for (std::size_t i = 0; i < pids.size(); ++i) {
    if (pids[i] <= 0) continue;  // reaped already
    int status = 0;
    pid_t got = 0;
    for (int waited = 0; (got = ::waitpid(pids[i], &status, WNOHANG)) == 0 && waited < seconds * 20; ++waited)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (got == 0) {
      ::kill(pids[i], SIGKILL);
      ::waitpid(pids[i], &status, 0);
      add_item(failed, "rank " + std::to_string(i + 1) + " (pid " + std::to_string(pids[i]) + ") did not exit: killed");
    } else if (got == pids[i]) {
      add_item(failed, ended_badly(i + 1, pids[i], status, expected));
    }
  }
  return failed;
}

// While rank 0 makes the job's process groups (the rendezvous, then each group's connections),
// a rank it started that dies would leave it waiting up to parallel.store_timeout_s, and longer
// in Gloo's connect. The watch names that rank, stops the others and ends this process with
// exit code 2: the run has not started (no run directory exists yet).
class StartupWatch {
 public:
  StartupWatch(std::vector<pid_t> pids, std::string who)
      : pids_(std::move(pids)), who_(std::move(who)), thread_([this] { run(); }) {}
  ~StartupWatch() {
    {
      std::lock_guard<std::mutex> l(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  void run() {
    std::unique_lock<std::mutex> l(mu_);
    while (!cv_.wait_for(l, std::chrono::milliseconds(100), [&] { return done_; }))
      for (std::size_t i = 0; i < pids_.size(); ++i) {
        siginfo_t info{};
        if (::waitid(P_PID, id_t(pids_[i]), &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid != pids_[i])
          continue;  // alive (WNOWAIT: reaped below, or by reap())
        const std::string how = info.si_code == CLD_EXITED ? "exited with code " + std::to_string(info.si_status)
                                                           : "was killed by signal " + std::to_string(info.si_status);
        std::fprintf(stderr, "%s: trainer rank %zu (pid %d) %s before the job's process groups were made; "
                     "stopping the other ranks (the run did not start)\n", who_.c_str(), i + 1, int(pids_[i]), how.c_str());
        for (pid_t p : pids_) ::kill(p, SIGKILL);
        for (pid_t p : pids_) ::waitpid(p, nullptr, 0);
        std::fflush(stderr);
        std::_Exit(2);
      }
  }

  std::vector<pid_t> pids_;
  std::string who_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

// Ranks other than 0: trainer/R served until rank 0 says the run is over.
int serve_trainer_rank(parallel::ProcessGroups& groups) {
  const auto& info = groups.launch();
  const std::string r = std::to_string(info.rank);
  const std::string me = "kiln run: trainer rank " + r;
  // Before the gateway, whose thread fills the queue: destroyed after the gateway has stopped.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<messaging::Envelope> queue;
  // Reachable from rank 0: loopback for a job on one host's loopback, else every interface,
  // announced under KILN_ADVERTISE_ADDR or this host's name.
  const bool local = is_loopback(info.master_addr);
  std::unique_ptr<messaging::Gateway> gw;
  std::string endpoint;
  try {
    gw = std::make_unique<messaging::Gateway>(
        messaging::Gateway::Options{"trainer-rank-" + r, local ? "tcp://127.0.0.1:0" : "tcp://0.0.0.0:0"});
    endpoint = gw->endpoint();
    if (!local) {
      std::string host;
      if (const char* a = std::getenv("KILN_ADVERTISE_ADDR"); a && *a) host = a;
      else {
        char name[256] = {};
        ::gethostname(name, sizeof name - 1);
        host = name;
      }
      endpoint = "tcp://" + host + endpoint.substr(endpoint.rfind(':'));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", me.c_str(), e.what());
    return 2;
  }
  trainer::TrainerService service(*gw, "trainer/" + r, &groups);
  gw->serve("trainer/" + r, [&](messaging::Envelope e) {  // on the gateway thread: queue only
    std::lock_guard<std::mutex> l(mu);
    queue.push_back(std::move(e));
    cv.notify_one();
  });
  auto& store = groups.store();
  try {
    store.set(kTrainerRankEndpointKey + r, endpoint);
    for (;;) {
      std::optional<messaging::Envelope> request;
      {
        std::unique_lock<std::mutex> l(mu);
        cv.wait_for(l, std::chrono::milliseconds(200), [&] { return !queue.empty(); });
        if (!queue.empty()) {
          request = std::move(queue.front());
          queue.pop_front();
        }
      }
      if (request) {  // the same request rank 0 runs itself, collectively
        auto answer = service.handle(*request);
        if (answer) {
          gw->reply(*request, std::move(*answer));
        } else {
          std::fprintf(stderr, "%s: %s\n", me.c_str(), answer.error().what().c_str());
          gw->reply_error(*request, answer.error());
        }
        if (service.collectives_failed()) {
          // The job's collectives cannot go on. Exiting (the answer above is sent first: the
          // gateway's stop drains it) closes this rank's connections, so that ranks waiting
          // on it in a collective fail now instead of at parallel.collective_timeout_s.
          std::fprintf(stderr, "%s: its collectives failed; exiting\n", me.c_str());
          return 1;
        }
        continue;
      }
      if (store.check({kRunOverKey})) {
        const int rc = std::stoi(store.get_to_str(kRunOverKey));
        store.set(kRankDoneKey + r, "1");
        return rc;
      }
    }
  } catch (const std::exception& e) {  // the store lives in rank 0 (or the torchrun agent)
    std::fprintf(stderr, "%s: lost rank 0 (its store at %s:%d): %s\n", me.c_str(), info.master_addr.c_str(),
                 info.master_port, e.what());
    return 1;
  }
}

}  // namespace

int run_ranks(const controller::Config& c, const std::string& config_toml, const std::vector<std::string>& argv) {
  try {
    c.validate();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln run: %s\n", e.what());
    return 2;
  }
  parallel::LaunchInfo info;
  try {
    info = parallel::read_launch_from_environment();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln run: %s\n", e.what());
    return 2;
  }
  const int dp = int(c.parallel.dp), ep = int(c.parallel.ep), world = dp * ep;
  if (info.launcher == parallel::Launcher::single && world == 1) return controller::run(c, config_toml);
  if (c.model.device != "cpu" && !torch::cuda::is_available()) {
    std::fprintf(stderr, "kiln run: model.device = \"%s\" with %d trainer ranks, but no CUDA device is visible\n",
                 c.model.device.c_str(), world);
    return 2;
  }
  std::vector<pid_t> started;
  if (info.launcher == parallel::Launcher::single) {
    try {
      info = {parallel::Launcher::single, 0, world, 0, world, "127.0.0.1",
              c.parallel.master_port > 0 ? int(c.parallel.master_port) : parallel::free_loopback_port(), false};
      started = start_ranks(info, argv);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kiln run: %s\n", e.what());
      return 2;
    }
  } else if (info.world_size != world) {
    std::fprintf(stderr, "kiln run: parallel.dp x parallel.ep = %d x %d = %d, but %s started %d ranks (they must be equal)\n",
                 dp, ep, world, parallel::launcher_name(info.launcher), info.world_size);
    return 2;
  }
  const std::string who = "kiln run: rank " + std::to_string(info.rank);
  if (info.rank != 0) {
    ::signal(SIGINT, SIG_IGN);  // rank 0 handles Ctrl-C and tells the others
    if (const char* parent = std::getenv(kParentVariable)) {
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (std::to_string(::getppid()) != parent) {  // rank 0 died before this rank started
        std::fprintf(stderr, "kiln run: rank %d: rank 0 (pid %s), which started it, is gone\n", info.rank, parent);
        return 1;
      }
    }
  }
  const torch::Device device =
      c.model.device == "cpu" ? torch::Device(torch::kCPU) : torch::Device(torch::kCUDA, int8_t(info.local_rank));
  std::unique_ptr<parallel::ProcessGroups> groups;
  std::string failure;
  {
    std::optional<StartupWatch> watch;
    if (!started.empty()) watch.emplace(started, who);
    try {
      groups = std::make_unique<parallel::ProcessGroups>(
          info, device, std::vector<parallel::MeshDim>{{"dp", dp}, {"ep", ep}},
          parallel::GroupOptions{std::chrono::seconds(c.parallel.store_timeout_s),
                                 std::chrono::seconds(c.parallel.collective_timeout_s)});
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  if (!groups) {
    std::fprintf(stderr, "%s: %s\n", who.c_str(), failure.c_str());
    if (!started.empty()) reap(started, 0, 0);
    return 2;
  }
  // Failed groups may hold a collective left to Gloo's worker thread (Group::abort), which their
  // destructor would wait out (up to twice parallel.collective_timeout_s): the process exits
  // without destroying them.
  auto leave_failed = [&] {
    if (groups->failed()) (void)groups.release();
  };
  if (info.rank != 0) {
    const int rc = serve_trainer_rank(*groups);
    leave_failed();
    return rc;
  }
  const int rc = controller::run(c, config_toml, groups.get());
  // Tell the other ranks; give them up to 10 s to see it before the store (served here) goes.
  // Ranks this process started and that are gone already (a lost rank) are not waited for.
  // After a failed collective, a rank still alive waits in one (until rank 0's connections
  // close or its timeout): it cannot see the key, and is given 2 s before it is killed.
  const bool broken = groups->failed();
  std::string gone;  // ranks reaped while waiting for their confirmation, when not ending with rc
  try {
    auto& store = groups->store();
    store.set(kRunOverKey, std::to_string(rc));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(broken ? 0 : 10);
    for (int r = 1; r < world; ++r) {
      const std::string key = kRankDoneKey + std::to_string(r);
      const bool mine = std::size_t(r - 1) < started.size();
      while (!store.check({key}) && std::chrono::steady_clock::now() < deadline) {
        if (mine && ::kill(started[std::size_t(r - 1)], 0) != 0) break;
        int status = 0;
        if (mine && ::waitpid(started[std::size_t(r - 1)], &status, WNOHANG) == started[std::size_t(r - 1)]) {
          add_item(gone, ended_badly(std::size_t(r), started[std::size_t(r - 1)], status, rc));
          started[std::size_t(r - 1)] = -1;  // reaped: gone before it could confirm
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s: not every rank confirmed the end of the run: %s\n", who.c_str(), e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: not every rank confirmed the end of the run: %s\n", who.c_str(), e.what());
  }
  auto failed = gone;
  add_item(failed, reap(started, broken ? 2 : 10, rc));
  leave_failed();
  if (!failed.empty()) {
    std::fprintf(stderr, "%s: trainer ranks ended badly: %s\n", who.c_str(), failed.c_str());
    return rc == 0 ? 1 : rc;
  }
  return rc;
}

}  // namespace kiln::experiments

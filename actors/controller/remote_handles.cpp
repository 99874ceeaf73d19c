#include "actors/controller/remote_handles.hpp"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "actors/controller/run_dir.hpp"
#include "actors/reference/messages.hpp"
#include "actors/reference/ref_messages.hpp"
#include "actors/rollout/generate_messages.hpp"
#include "actors/rollout/messages.hpp"
#include "actors/trainer/messages.hpp"
#include "actors/trainer/trainer_service.hpp"
#include "messaging/torch_tensor.hpp"

extern char** environ;

namespace kiln::controller {

using namespace kiln::messaging;

namespace {
constexpr auto kInitTimeout = std::chrono::seconds(600);

}  // namespace

Node::Node(const NodeSite& site, const std::string& suffix, const std::string& actor, const std::string& pidfile)
    : actor_(actor) {
  // argv[0] "kiln" (the binary is /proc/self/exe): `ps` and `pgrep -f "kiln node"` show the nodes.
  std::vector<std::string> argv = {"kiln", "node", "--name", suffix + "-node", "--bind", "ipc://" + site.tag + "-" + suffix,
                                   "--join", site.gateway.endpoint(), "--actor", actor,
                                   "--exit-with-parent", std::to_string(::getpid())};  // no orphans
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  // A process group of its own: Ctrl-C on the terminal reaches the controller alone, which
  // finishes its step and checkpoints while the nodes keep serving (they exit with it).
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);
  const int spawned = posix_spawn(&pid_, "/proc/self/exe", nullptr, &attr, args.data(), environ);
  posix_spawnattr_destroy(&attr);
  if (spawned != 0) throw std::runtime_error("cannot start the node process for " + actor);
  {  // written whole, then renamed: a reader never sees the file empty or half written
    const auto final_path = site.dir / pidfile, tmp = site.dir / (pidfile + ".tmp");
    std::ofstream(tmp) << pid_ << "\n";
    std::filesystem::rename(tmp, final_path);
  }
  // Up to 60 s to join, but a node process that exits first is reported at once.
  for (int waited_ms = 0;; waited_ms += 200) {
    auto up = site.gateway.wait_for_actor(actor, std::chrono::milliseconds(200));
    if (up) return;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      throw std::runtime_error("the node process for " + actor + " exited before it joined (" +
                               (WIFSIGNALED(status) ? "killed by signal " + std::to_string(WTERMSIG(status))
                                                    : "exit code " + std::to_string(WEXITSTATUS(status))) +
                               ")");
    }
    if (waited_ms >= 60000) {
      stop();  // no destructor runs for a constructor that throws
      throw std::runtime_error("the node for " + actor + " did not join within 60 s: " + up.error().what());
    }
  }
}

Node::~Node() { stop(); }

bool Node::alive() {
  int status = 0;
  if (pid_ > 0 && ::waitpid(pid_, &status, WNOHANG) == pid_) pid_ = -1;  // exited (and reaped)
  return pid_ > 0;
}

void Node::stop() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGTERM);
  int status = 0;
  // A node gets 5 s to stop (it stops its actors); a frozen one (SIGSTOP) is then killed.
  for (int i = 0; i < 100 && ::waitpid(pid_, &status, WNOHANG) == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  if (::waitpid(pid_, &status, WNOHANG) == 0) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, &status, 0);
  }
  pid_ = -1;
}

RemoteTrainer::RemoteTrainer(const NodeSite& site, const Config& c)
    : gw_(site.gateway), node_(site, "trainer", "trainer/0", node_pid_file("trainer")) {
  TrainerInit init{c.model, c.run.seed, c.trainer_for_run(), c.weight_sync.bucket_mib};
  Envelope r;
  try {
    r = call(make_envelope(init, Kind::request, "controller", node_.actor()), kInitTimeout);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("the trainer node could not build its policy: ") + e.what());
  }
  auto ready = payload_as<TrainerReady>(r);
  if (!ready) throw std::runtime_error(std::string("trainer node: ") + ready.error().what());
  version_ = ready->policy_version;
  vocab_size_ = ready->vocab_size;
  routing_ = {ready->moe_layers, ready->experts_per_token, ready->num_experts};
}

Envelope RemoteTrainer::call(Envelope request, std::chrono::seconds timeout) {
  const std::string type = request.type;
  auto r = gw_.request(std::move(request), timeout).get();
  if (r) return std::move(*r);
  // A remote_error from a push is the target's failure (the trainer answered); anything else
  // (peer_lost, timeout, ...) is the trainer node's: its state since the last checkpoint is gone.
  if (type == TrainerPushWeights::kType && r.error().code == ErrorCode::remote_error)
    throw std::runtime_error("rollout node failed: " + r.error().message);
  if (r.error().code == ErrorCode::remote_error)
    throw std::runtime_error("trainer node " + node_.actor() + ": " + type + ": " + r.error().what());
  throw PolicyLost("trainer node " + node_.actor() + ": " + type + ": " + r.error().what());
}

trainer::StepMetrics RemoteTrainer::train(std::vector<trainer::Sample> samples) {
  auto env = trainer::train_request(samples, "controller", node_.actor());
  auto res = payload_as<TrainerStepResult>(call(std::move(env), std::chrono::seconds(3600)));
  if (!res) throw std::runtime_error(std::string("trainer node: ") + res.error().what());
  version_ = res->policy_version;
  return res->metrics;
}

void RemoteTrainer::send(const PolicyWeights&, const std::vector<std::string>& targets) {
  auto r = call(make_envelope(TrainerPushWeights{targets}, Kind::request, "controller", node_.actor()), kInitTimeout);
  if (auto res = payload_as<TrainerPushed>(r); !res) throw std::runtime_error(std::string("trainer node: ") + res.error().what());
}

void RemoteTrainer::save(const std::filesystem::path& dir, const trainer::CheckpointState& state) {
  auto env = make_envelope(TrainerSave{dir.string(), state.step, state.prompt_rng}, Kind::request, "controller",
                           node_.actor());
  if (!state.in_flight_rollouts.empty())
    env.tensors.push_back(Tensor::copy_of(std::string(TrainerSave::kInFlightFrame), DType::uint8,
                                          {int64_t(state.in_flight_rollouts.size())}, state.in_flight_rollouts.data(),
                                          state.in_flight_rollouts.size()));
  call(std::move(env), kInitTimeout);
}

trainer::CheckpointState RemoteTrainer::load(const std::filesystem::path& dir) {
  auto state = trainer::read_checkpoint_state(dir);  // the loop's part; the node loads the rest
  auto res = payload_as<TrainerReady>(
      call(make_envelope(TrainerLoad{dir.string()}, Kind::request, "controller", node_.actor()), kInitTimeout));
  if (!res) throw std::runtime_error(std::string("trainer node: ") + res.error().what());
  version_ = res->policy_version;
  return state;
}

RemoteEngines::RemoteEngines(const NodeSite& site, const Config& c, TrainerHandle& trainer)
    : site_(site),
      init_{c.model, c.engine_for_run()},
      group_size_(c.algorithm.samples_per_prompt),
      max_restarts_(c.placement.engine_restarts),
      nodes_(std::size_t(c.placement.rollout_engines)),
      restarts_in_a_row_(nodes_.size(), 0) {
  for (std::size_t i = 0; i < nodes_.size(); ++i) devices_.push_back(c.placement.engine_device(i, c.model.device));
  trainer_ = &trainer;
  if (c.weight_sync.transport == "collective")
    collective_ = std::make_unique<weight_sync::CollectiveSender>(site.gateway, trainer.policy_device(),
                                                                  std::chrono::seconds(c.parallel.store_timeout_s),
                                                                  std::chrono::seconds(c.parallel.collective_timeout_s));
  for (std::size_t i = 0; i < nodes_.size(); ++i) try {
      start_node(i);
    } catch (const std::exception& e) {  // a node that answered with an error is not lost: no restart
      if (max_restarts_ == 0 || (nodes_[i] && nodes_[i]->alive())) throw;
      restart(i, e.what());
    }
  if (collective_) {
    collective_->connect(actors());
    regroup_ = false;
  }
}

std::vector<std::string> RemoteEngines::actors() const {
  std::vector<std::string> out;
  for (const auto& n : nodes_) out.push_back(n->actor());
  return out;
}

void RemoteEngines::push(const PolicyWeights& w, const std::vector<std::string>& targets) {
  if (!collective_) return trainer_->send(w, targets);
  if (regroup_ || collective_->engines().empty()) {  // a replaced engine, or a failed broadcast: a new group
    collective_->connect(actors());
    regroup_ = false;
  }
  trainer_->send_collective(*collective_);
}

void RemoteEngines::start_node(std::size_t i) {
  const auto index = std::to_string(i);
  nodes_[i].reset();  // a lost node's process is stopped (or reaped) first
  nodes_[i] = std::make_unique<Node>(site_, i == 0 ? "rollout" : "rollout-" + index, "rollout/" + index,
                                     node_pid_file("rollout", int64_t(i)));
  // A restarted node joins at its predecessor's endpoint, which the directory still lists:
  // until its connection is up, requests fail at once (peer_lost); ask again for up to 300 s.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(300);
  for (;;) {
    auto init = init_;
    init.model.device = devices_[i];
    auto r = site_.gateway.request(make_envelope(init, Kind::request, "controller", nodes_[i]->actor()),
                                   std::chrono::seconds(300))
                 .get();
    if (r) return;
    const bool retry = r.error().code == ErrorCode::peer_lost || r.error().code == ErrorCode::unknown_actor;
    if (!retry || !nodes_[i]->alive() || std::chrono::steady_clock::now() > deadline)
      throw std::runtime_error("the rollout node " + nodes_[i]->actor() + " could not build its engine: " +
                               r.error().what());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

void RemoteEngines::restart(std::size_t i, const std::string& what) {
  const std::string actor = "rollout/" + std::to_string(i);
  std::string last = what;
  while (restarts_in_a_row_[i] < max_restarts_) {
    const int64_t attempt = ++restarts_in_a_row_[i];
    const double backoff_s = std::min(30.0, 0.5 * double(int64_t(1) << std::min<int64_t>(attempt - 1, 10)));
    std::fprintf(stderr, "kiln run: rollout node %s lost (%s); restarting it in %.1f s (%lld of %lld in a row)\n",
                 actor.c_str(), last.c_str(), backoff_s, (long long)attempt, (long long)max_restarts_);
    std::this_thread::sleep_for(std::chrono::duration<double>(backoff_s));
    try {
      start_node(i);
      regroup_ = true;
      if (loaded_) push(*loaded_, {actor});  // the engines' current version
      return;
    } catch (const PolicyLost&) {
      throw;
    } catch (const std::exception& e) {
      last = e.what();
    }
  }
  throw std::runtime_error("rollout node " + actor + " lost, restarts used up (placement.engine_restarts = " +
                           std::to_string(max_restarts_) + " in a row): " + last);
}

std::vector<rollout::Completion> RemoteEngines::generate(std::vector<rollout::GenerationRequest> requests,
                                                         const std::function<void()>&) {
  // Whole prompt groups to each engine, contiguous shares; all engines work at once.
  const auto bounds = prompt_group_shares(requests.size(), group_size_, nodes_.size());
  std::vector<std::vector<rollout::GenerationRequest>> asked(nodes_.size());
  std::vector<RolloutGenerate> shares(nodes_.size());
  for (std::size_t i = 0; i < nodes_.size(); ++i)
    for (std::size_t k = bounds[i].first; k < bounds[i].second; ++k) {
      shares[i].requests.push_back(rollout::to_spec(requests[k]));
      asked[i].push_back(std::move(requests[k]));
    }
  std::vector<std::future<Expected<Envelope>>> replies(nodes_.size());
  auto send = [&](std::size_t i) {
    replies[i] = site_.gateway.request(make_envelope(shares[i], Kind::request, "controller", nodes_[i]->actor()),
                                       std::chrono::seconds(900));
  };
  for (std::size_t i = 0; i < nodes_.size(); ++i) send(i);
  std::vector<rollout::Completion> out;
  for (std::size_t i = 0; i < nodes_.size();) {  // throws on an engine lost for good, naming it
    const std::string who = "rollout node " + nodes_[i]->actor();
    auto r = replies[i].get();
    if (!r && (r.error().code == ErrorCode::peer_lost || r.error().code == ErrorCode::timeout) && max_restarts_ > 0) {
      restart(i, r.error().what());  // its share again, from the start: none of it was returned
      send(i);
      continue;
    }
    if (!r) throw std::runtime_error(who + ": " + r.error().what());
    for (auto& c : rollout::read_result(*r, asked[i], who)) out.push_back(std::move(c));
    restarts_in_a_row_[i] = 0;
    ++i;
  }
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.id < y.id; });
  return out;
}

void RemoteEngines::load(const PolicyWeights& w, TrainerHandle& trainer) {
  loaded_ = w;  // shares the tensors' bytes (no copy)
  trainer_ = &trainer;
  const auto targets = actors();
  auto named = [](const std::string& what) {  // names the engine; say that it is a rollout node
    return std::runtime_error(what.rfind("rollout node", 0) == 0 ? what : "rollout node " + what);
  };
  try {
    push(w, targets);
    return;
  } catch (const PolicyLost&) {
    throw;
  } catch (const std::exception& e) {
    if (collective_) regroup_ = true;  // the group is broken by a failed broadcast
    if (max_restarts_ == 0) throw named(e.what());
    // Engines whose process is gone are restarted (each gets `w` then); the others get `w`
    // again (the send may have stopped at the lost one; a version sent twice is applied twice).
    std::vector<std::string> living;
    bool restarted = false;
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      if (nodes_[i]->alive()) {
        living.push_back(nodes_[i]->actor());
        continue;
      }
      restart(i, e.what());
      restarted = true;
    }
    if (!restarted) throw named(e.what());
    try {
      if (!living.empty() && !collective_) push(w, living);  // collective: restart() sent it to all
    } catch (const PolicyLost&) {
      throw;
    } catch (const std::exception& again) {
      throw named(again.what());
    }
  }
}

RemoteReference::RemoteReference(const NodeSite& site, const Config& c, TrainerHandle& initial)
    : gw_(site.gateway), routing_replay_(c.trainer.logprobs.routing_replay), node_(site, "ref", "ref/0", node_pid_file("ref")) {
  auto spec = c.model;
  if (!c.placement.reference_device.empty()) spec.device = c.placement.reference_device;
  auto r = gw_.request(make_envelope(RefInit{spec, c.trainer.logprobs}, Kind::request, "controller", node_.actor()),
                       std::chrono::seconds(300))
               .get();
  if (!r) throw std::runtime_error(std::string("the reference node could not build its model: ") + r.error().what());
  try {  // the frozen reference: the initial policy's weights, checked by the node
    initial.send(initial.weights(false), {node_.actor()});
  } catch (const PolicyLost&) {
    throw;
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("reference node: weight sync: ") + e.what());
  }
}

std::vector<std::vector<float>> RemoteReference::logprobs(const std::vector<rollout::Completion>& completions) {
  auto r = gw_.request(reference::logprobs_request(completions, routing_replay_, "controller", node_.actor()),
                       std::chrono::seconds(900))
               .get();
  const std::string who = "reference node " + node_.actor();
  if (!r) throw std::runtime_error(who + ": " + r.error().what());
  return reference::read_logprobs(*r, completions, who);
}

}  // namespace kiln::controller

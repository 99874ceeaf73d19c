#include "experiments/rollout_drivers.hpp"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <thread>

#include "actors/trainer/trainer_service.hpp"
#include "messaging/schema.hpp"
#include "messaging/torch_tensor.hpp"

extern char** environ;

namespace kiln::experiments {

// Asynchronous rollouts (see the header): a thread generates the batches of steps first..last in order,
// running ahead of the trainer by at most `staleness` steps: it starts step s only once the
// trainer has consumed step s - 1 - k, whose weights it applies first (weights are posted
// before a step counts as consumed, and applied between decode steps). Tokens are therefore
// at most k policy versions older than the trainer that learns from them.
AsyncRollout::AsyncRollout(Apply apply, Generate generate, int64_t first, int64_t last, int64_t staleness)
    : apply_(std::move(apply)), generate_(std::move(generate)), consumed_(first - 1), k_(staleness) {
  thread_ = std::thread([this, first, last] { run(first, last); });
}
AsyncRollout::~AsyncRollout() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}
Batch AsyncRollout::take(int64_t step) {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return !ready_.empty() || !error_.empty(); });
  // Batches made before a failure are still delivered; the failure surfaces at its own step.
  if (ready_.empty()) throw std::runtime_error("rollout thread: " + error_);
  Batch b = std::move(ready_.front());
  ready_.pop_front();
  if (b.step != step) throw std::logic_error("rollout batches out of order");  // FIFO by construction
  return b;
}
void AsyncRollout::consumed(int64_t step, bool updated, std::vector<messaging::Tensor> weights, int64_t version) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (updated) pending_ = std::make_pair(std::move(weights), version);
    consumed_ = step;
  }
  cv_.notify_all();
}

void AsyncRollout::apply_pending() {
  std::optional<std::pair<std::vector<messaging::Tensor>, int64_t>> w;
  {
    std::lock_guard<std::mutex> l(mu_);
    w.swap(pending_);
  }
  if (!w) return;
  apply_(std::move(w->first), w->second);
}
void AsyncRollout::run(int64_t first, int64_t last) {
  try {
    for (int64_t s = first; s <= last; ++s) {
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return stop_ || consumed_ >= s - 1 - k_; });
        if (stop_) return;
      }
      apply_pending();
      Batch b = generate_(s, [this] { apply_pending(); });
      {
        std::lock_guard<std::mutex> l(mu_);
        ready_.push_back(std::move(b));
      }
      cv_.notify_all();
    }
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> l(mu_);
    error_ = e.what();
    cv_.notify_all();
  }
}

std::string spawn_node(messaging::Gateway& gw, const std::string& tag, const std::string& suffix,
                       const std::string& actor, const std::filesystem::path& dir, const std::string& pidfile,
                       pid_t& pid) {
  // argv[0] "kiln" (the binary is /proc/self/exe): `ps` and `pgrep -f "kiln node"` show the nodes.
  std::vector<std::string> argv = {"kiln",           "node",          "--name",  suffix + "-node",
                                   "--bind",         "ipc://" + tag + "-" + suffix,
                                   "--join",         gw.endpoint(), "--actor", actor,
                                   "--exit-with-parent", std::to_string(::getpid())};  // no orphans
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, args.data(), environ) != 0)
    return "cannot start the node process for " + actor;
  std::ofstream(dir / pidfile) << pid << "\n";
  // Up to 60 s to join, but a node process that exits first is reported at once.
  for (int waited_ms = 0;; waited_ms += 200) {
    auto up = gw.wait_for_actor(actor, std::chrono::milliseconds(200));
    if (up) return "";
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      pid = -1;
      return "the node process for " + actor + " exited before it joined (" +
             (WIFSIGNALED(status) ? "killed by signal " + std::to_string(WTERMSIG(status))
                                  : "exit code " + std::to_string(WEXITSTATUS(status))) + ")";
    }
    if (waited_ms >= 60000) return "the node for " + actor + " did not join within 60 s: " + up.error().what();
  }
}

std::string RefNode::start(messaging::Gateway& gw, const std::string& tag, const ExperimentConfig& c,
                           const std::filesystem::path& dir) {
  auto err = spawn_node(gw, tag, "ref", kActor, dir, "ref_node.pid", pid_);
  if (!err.empty()) return err;
  messaging::RefInit init{c.model.package, c.model.flavor, c.model.checkpoint,
                          c.algorithm.max_tokens_per_microbatch, c.algorithm.routing_replay, c.algorithm.temperature,
                          c.model.dtype};
  auto r = gw.request(messaging::make_envelope(init, messaging::Kind::request, "controller", kActor),
                      std::chrono::seconds(300))
               .get();
  if (!r) return std::string("the reference node could not build its model: ") + r.error().what();
  return "";
}

std::vector<std::vector<float>> RefNode::logprobs(messaging::Gateway& gw, const std::vector<rollout::Completion>& samples,
                                                  bool routing_replay) {
  messaging::RefLogprobs q;
  std::vector<messaging::Tensor> experts;
  bool replay = routing_replay;
  for (const auto& s : samples) replay &= s.routed_experts.defined();
  for (const auto& s : samples) {
    q.samples.push_back({s.id, s.prompt, s.tokens});
    if (replay) experts.push_back(messaging::from_torch("routed_experts." + std::to_string(s.id), s.routed_experts.contiguous()));
  }
  auto env = messaging::make_envelope(q, messaging::Kind::request, "controller", kActor);
  env.tensors = std::move(experts);
  auto r = gw.request(std::move(env), std::chrono::seconds(900)).get();
  if (!r) throw std::runtime_error(std::string("reference node ") + kActor + ": " + r.error().what());
  auto res = messaging::payload_as<messaging::RefLogprobsResult>(*r);
  if (!res) throw std::runtime_error(std::string("reference node ") + kActor + ": " + res.error().what());
  if (res->logprobs.size() != samples.size())
    throw std::runtime_error(std::string("reference node answered ") + std::to_string(res->logprobs.size()) +
                             " samples for " + std::to_string(samples.size()));
  for (std::size_t i = 0; i < samples.size(); ++i)
    if (res->logprobs[i].size() != samples[i].tokens.size())
      throw std::runtime_error("reference node answered " + std::to_string(res->logprobs[i].size()) +
                               " log-probs for a completion of " + std::to_string(samples[i].tokens.size()) + " tokens");
  return std::move(res->logprobs);
}

messaging::TrainerInit trainer_init(const ExperimentConfig& c) {
  const auto& a = c.algorithm;
  messaging::TrainerInit t;
  t.package = c.model.package;
  t.flavor = c.model.flavor;
  t.checkpoint = c.model.checkpoint;
  t.device = c.model.device;
  t.dtype = c.model.dtype;
  t.seed = c.run.seed;
  t.max_tokens_per_microbatch = a.max_tokens_per_microbatch;
  t.routing_replay = a.routing_replay;
  t.temperature = a.temperature;
  t.recompute_old_logprobs = a.recompute_old_logprobs;
  t.bucket_mib = c.weight_sync.bucket_mib;
  t.optim = {a.lr, a.weight_decay, a.grad_clip, a.lr_schedule, a.warmup_steps, c.run.steps};
  t.loss = {a.clip_low, a.clip_high, a.kl_coef, a.kl_estimator, a.aggregation, a.tis_cap, a.entropy_coef};
  return t;
}

std::string TrainerNode::start(messaging::Gateway& gw, const std::string& tag, const ExperimentConfig& c,
                               const std::filesystem::path& dir) {
  auto err = spawn_node(gw, tag, "trainer", kActor, dir, "trainer_node.pid", pid_);
  if (!err.empty()) return err;
  try {
    auto r = call(gw, messaging::make_envelope(trainer_init(c), messaging::Kind::request, "controller", kActor),
                  std::chrono::seconds(600));
    auto ready = messaging::payload_as<messaging::TrainerReady>(r);
    if (!ready) return std::string("trainer node: ") + ready.error().what();
    version_ = ready->policy_version;
    vocab_size_ = ready->vocab_size;
  } catch (const std::exception& e) {
    return std::string("the trainer node could not build its policy: ") + e.what();
  }
  return "";
}
messaging::Envelope TrainerNode::call(messaging::Gateway& gw, messaging::Envelope request, std::chrono::seconds timeout,
                                      bool target_call) {
  const std::string type = request.type;
  auto r = gw.request(std::move(request), timeout).get();
  if (!r) {
    // A remote_error from a push is the target's failure (the trainer answered); anything else
    // (peer_lost, timeout, ...) is the trainer node's.
    const bool target = target_call && r.error().code == messaging::ErrorCode::remote_error;
    throw Error(target ? r.error().message : std::string("trainer node ") + kActor + ": " + type + ": " + r.error().what(),
                target);
  }
  return std::move(*r);
}
trainer::StepMetrics TrainerNode::train(messaging::Gateway& gw, const std::vector<trainer::Sample>& samples,
                                        double& log_probs_time) {
  messaging::TrainerTrain q;
  std::vector<messaging::Tensor> experts;
  bool replay = true;
  for (const auto& s : samples) replay &= s.routed_experts.defined();
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const auto& s = samples[i];
    q.samples.push_back({uint64_t(i), s.prompt, s.completion, s.behavior_logprobs, s.ref_logprobs, s.advantage});
    if (replay) experts.push_back(messaging::from_torch("routed_experts." + std::to_string(i), s.routed_experts.contiguous()));
  }
  auto env = messaging::make_envelope(q, messaging::Kind::request, "controller", kActor);
  env.tensors = std::move(experts);
  auto r = call(gw, std::move(env), std::chrono::seconds(3600));
  auto res = messaging::payload_as<messaging::TrainerStepResult>(r);
  if (!res) throw Error(std::string("trainer node: ") + res.error().what(), false);
  log_probs_time = res->log_probs_time;
  version_ = res->policy_version;
  return trainer::to_step_metrics(*res);
}
int64_t TrainerNode::push(messaging::Gateway& gw, const std::vector<std::string>& targets) {
  auto r = call(gw, messaging::make_envelope(messaging::TrainerPushWeights{targets}, messaging::Kind::request,
                                             "controller", kActor),
                std::chrono::seconds(600), /*target_call=*/true);
  auto res = messaging::payload_as<messaging::TrainerPushed>(r);
  if (!res) throw Error(std::string("trainer node: ") + res.error().what(), false);
  return res->policy_version;
}
void TrainerNode::save(messaging::Gateway& gw, const std::filesystem::path& dir, int64_t step,
                       const std::string& prompt_rng) {
  call(gw, messaging::make_envelope(messaging::TrainerSave{dir.string(), step, prompt_rng}, messaging::Kind::request,
                                    "controller", kActor),
       std::chrono::seconds(600));
}
int64_t TrainerNode::load(messaging::Gateway& gw, const std::filesystem::path& dir) {
  auto r = call(gw, messaging::make_envelope(messaging::TrainerLoad{dir.string()}, messaging::Kind::request,
                                             "controller", kActor),
                std::chrono::seconds(600));
  auto res = messaging::payload_as<messaging::TrainerReady>(r);
  if (!res) throw Error(std::string("trainer node: ") + res.error().what(), false);
  version_ = res->policy_version;
  return version_;
}
void TrainerNode::stop() { stop_node(pid_); }

void stop_node(pid_t& pid) {
  if (pid <= 0) return;
  ::kill(pid, SIGTERM);
  int status = 0;
  // A node gets 5 s to stop (it stops its actors); a frozen one (SIGSTOP) is then killed.
  for (int i = 0; i < 100 && ::waitpid(pid, &status, WNOHANG) == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  if (::waitpid(pid, &status, WNOHANG) == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
  }
  pid = -1;
}

void RefNode::stop() { stop_node(pid_); }

std::string RolloutNode::start(messaging::Gateway& gw, const std::string& tag, const ExperimentConfig& c,
                               const std::filesystem::path& dir, int64_t index) {
  index_ = index;
  const std::string suffix = index == 0 ? "rollout" : "rollout-" + std::to_string(index);
  auto err = spawn_node(gw, tag, suffix, actor(), dir,
                        index == 0 ? "rollout_node.pid" : "rollout_node_" + std::to_string(index) + ".pid", pid_);
  if (!err.empty()) return err;
  messaging::RolloutInit init{c.model.package,      c.model.flavor,      c.model.checkpoint,
                              c.rollout.cache_blocks, c.rollout.block_size, c.rollout.max_batch,
                              c.rollout.step_delay_ms, c.model.dtype};
  auto r = gw.request(messaging::make_envelope(init, messaging::Kind::request, "controller", actor()),
                      std::chrono::seconds(300))
               .get();
  if (!r) return "the rollout node " + actor() + " could not build its engine: " + r.error().what();
  return "";
}
RolloutNode::Pending RolloutNode::send_generate(messaging::Gateway& gw,
                                                const std::vector<rollout::GenerationRequest>& requests) {
  messaging::RolloutGenerate g;
  Pending p;
  for (const auto& q : requests) {
    p.prompts[q.id] = q.prompt;
    const auto& sp = q.sampling;
    g.requests.push_back(
        {q.id, q.prompt, sp.temperature, sp.top_p, sp.top_k, sp.max_new_tokens, sp.seed, sp.stop_token_ids});
  }
  p.count = requests.size();
  p.reply = gw.request(messaging::make_envelope(g, messaging::Kind::request, "controller", actor()),
                       std::chrono::seconds(900));
  return p;
}
std::vector<rollout::Completion> RolloutNode::collect(Pending& p) {
  const std::string who = "rollout node " + actor();
  auto r = p.reply.get();
  if (!r) throw std::runtime_error(who + ": " + r.error().what());
  auto res = messaging::payload_as<messaging::RolloutResult>(*r);
  if (!res) throw std::runtime_error(who + ": " + res.error().what());
  if (res->completions.size() != r->tensors.size() || res->completions.size() != p.count)
    throw std::runtime_error(who + " answered " + std::to_string(res->completions.size()) + " completions for " +
                             std::to_string(p.count) + " requests");
  std::vector<rollout::Completion> out;
  for (std::size_t i = 0; i < res->completions.size(); ++i) {
    const auto& sp = res->completions[i];
    auto it = p.prompts.find(sp.id);
    if (it == p.prompts.end())
      throw std::runtime_error(who + " answered an unknown request id " + std::to_string(sp.id));
    rollout::Completion c;
    c.id = sp.id;
    c.prompt = it->second;
    c.tokens = sp.tokens;
    c.logprobs = sp.logprobs;
    c.entropies = sp.entropies;
    c.policy_versions = sp.policy_versions;
    c.finish_reason = sp.finish_reason == "stop" ? rollout::FinishReason::stop : rollout::FinishReason::length;
    c.time_to_first_token_s = sp.time_to_first_token_s;
    c.routed_experts = messaging::to_torch(r->tensors[i]).clone();
    out.push_back(std::move(c));
  }
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.id < y.id; });
  return out;
}
void RolloutNode::stop() { stop_node(pid_); }

}  // namespace kiln::experiments

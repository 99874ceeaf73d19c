#include "experiments/rl_run.hpp"
#include "experiments/rollout_drivers.hpp"

#include <torch/torch.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include "messaging/torch_tensor.hpp"

extern char** environ;
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <sstream>

#include "actors/rollout/engine.hpp"
#include "actors/rollout/tasks.hpp"
#include "actors/rollout/tokenizer.hpp"
#include "actors/trainer/checkpoint.hpp"
#include "actors/trainer/trainer.hpp"
#include "actors/trainer/trainer_service.hpp"
#include "actors/weight_sync/buckets.hpp"
#include "actors/weight_sync/service.hpp"
#include "messaging/gateway.hpp"
#include "messaging/schema.hpp"
#include "model/registry.hpp"

namespace kiln::experiments {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::unique_ptr<rollout::Task> build_task(const ExperimentConfig::Task& t) {
  if (t.name == "arithmetic")
    return std::make_unique<rollout::ArithmeticTask>(
        rollout::ArithmeticOptions{int(t.min_digits), int(t.max_digits), t.operators});
  return rollout::make_task(t.name);
}


// Socket paths for the signal handler (async-signal-safe: fixed buffers, unlink, write, raise).
constexpr int kMaxSockets = 80;
char g_sockets[kMaxSockets][108];
volatile std::sig_atomic_t g_socket_count = 0;
extern "C" void remove_sockets_and_die(int sig) {
  for (int i = 0; i < g_socket_count; ++i) ::unlink(g_sockets[i]);
  static const char msg[] =
      "kiln run: interrupted; checkpoints so far are in RUN/checkpoints (run.checkpoint_every)\n";
  [[maybe_unused]] auto n = ::write(2, msg, sizeof msg - 1);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

// Where to continue after the policy was lost with its process: the newest complete checkpoint
// of the run (a step_N directory with its state.json; ".partial" ones are incomplete).
std::string continue_hint(const std::filesystem::path& run_dir) {
  std::filesystem::path newest;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(run_dir / "checkpoints", ec)) {
    const auto name = e.path().filename().string();
    if (name.rfind("step_", 0) == 0 && name.find('.') == std::string::npos && std::filesystem::exists(e.path() / "state.json") &&
        (newest.empty() || name > newest.filename().string()))
      newest = e.path();
  }
  if (newest.empty())
    return "kiln run: no checkpoint was written (run.checkpoint_every = 0): start again, with checkpoints\n";
  return "kiln run: the steps after it are lost; continue with --set run.resume_from=" + newest.string() + "\n";
}

// Rows of steps >= first_step in RUN/metrics.{jsonl,tsv} describe training a resume repeats
// (left by a run that went further, or lost with a trainer node): removes them, so that every
// step appears once. Returns how many metrics.jsonl rows went.
int64_t drop_metric_rows_from(const std::filesystem::path& dir, int64_t first_step) {
  int64_t dropped = 0;
  for (const std::string name : {"metrics.jsonl", "metrics.tsv"}) {
    const bool json = name == "metrics.jsonl";
    std::ifstream in(dir / name);
    std::vector<std::string> keep;
    for (std::string line; std::getline(in, line);) {
      int64_t row_step = 0;
      try {
        row_step = json ? nlohmann::json::parse(line).at("step").get<int64_t>() : std::stoll(line);
      } catch (const std::exception&) {
        row_step = 0;  // not a row of ours: keep it
      }
      if (row_step < first_step) keep.push_back(line);
      else if (json) ++dropped;
    }
    in.close();
    std::ofstream out(dir / name, std::ios::trunc);
    for (const auto& l : keep) out << l << "\n";
  }
  return dropped;
}

void plot(const std::filesystem::path& dir) {
  auto tsv = dir / "metrics.tsv";
  auto png = dir / "reward_kl.png";
  std::string cmd = "gnuplot -e \"set terminal png size 900,500; set output '" + png.string() +
                    "'; set xlabel 'step'; set ylabel 'reward'; set y2label 'KL'; set y2tics; set ytics nomirror; "
                    "set key left top; plot '" + tsv.string() + "' using 1:2 with lines lw 2 title 'reward mean', '" +
                    tsv.string() + "' using 1:3 axes x1y2 with lines title 'KL'\" 2>&1";
  if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "kiln run: plotting with gnuplot failed (is gnuplot installed?)\n");
}
}  // namespace

int run_experiment(const ExperimentConfig& c) {
  try {
    c.validate();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln run: %s\n", e.what());
    return 2;
  }
  namespace fs = std::filesystem;
  fs::path dir(c.run.output_dir);
  std::shared_ptr<model::CausalLM> policy, engine_model, ref_model;
  std::unique_ptr<rollout::Task> task;
  rollout::CharTokenizer tokenizer;
  trainer::TrainerConfig tc;
  const bool remote = c.placement.mode == "multi_process";
  // placement.trainer = "process": the policy lives in the trainer node; this process then
  // holds no model (the reference and the engines are nodes too).
  const bool remote_trainer = c.placement.trainer == "process";
  try {
    fs::create_directories(dir);
    std::ofstream(dir / "config.toml") << c.to_toml();
    tc = trainer::trainer_config(trainer_init(c));
    auto registry = model::Registry::with_plugins();
    torch::manual_seed(uint64_t(c.run.seed));  // the trainer node seeds its policy the same way
    if (!remote_trainer) policy = registry.build(c.model.package, c.model.flavor, c.model.checkpoint);
    if (!remote) {  // the in-process engine
      engine_model = registry.build(c.model.package, c.model.flavor, c.model.checkpoint);
      engine_model->load_hf_tensors(policy->hf_state_dict());
    }
    // The frozen reference: the KL term of the loss (kl_coef > 0) and the KL metric.
    if (c.placement.reference == "controller") {  // else a kiln node hosts it (ref/0)
      ref_model = registry.build(c.model.package, c.model.flavor, c.model.checkpoint);
      ref_model->load_hf_tensors(policy->hf_state_dict());
    }
    if (c.model.device != "cpu" && !torch::cuda::is_available())
      throw std::invalid_argument("model.device is \"" + c.model.device + "\" but no CUDA device is visible" +
                                  " (is this a CUDA build of LibTorch on a GPU machine?)");
    const torch::Device device(c.model.device);
    const auto dtype = c.model.dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32;
    for (auto* m : {&policy, &engine_model, &ref_model}) {
      if (!*m) continue;
      (*m)->to(device);
      (*m)->to_dtype(dtype);
    }
    if (policy && tokenizer.vocab_size() > policy->vocab_size())
      throw std::invalid_argument("model vocabulary " + std::to_string(policy->vocab_size()) +
                                  " is smaller than the task tokenizer's " + std::to_string(tokenizer.vocab_size()));
    task = build_task(c.task);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln run: %s\n", e.what());
    return 2;
  }
  const auto& a = c.algorithm;
  std::unique_ptr<trainer::Trainer> local_trainer;
  if (!remote_trainer) local_trainer = std::make_unique<trainer::Trainer>(policy, tc);
  rollout::EngineOptions eo;
  eo.cache_blocks = c.rollout.cache_blocks;
  eo.block_size = c.rollout.block_size;
  eo.max_batch = c.rollout.max_batch;
  std::unique_ptr<rollout::Engine> engine;
  if (!remote) engine = std::make_unique<rollout::Engine>(engine_model, eo);
  std::mt19937_64 rng(uint64_t(c.run.seed));
  // Weight sync over the messaging layer: the trainer side sends each new version to the
  // rollout side's receiver service (inproc in one process: tensor frames are zero-copy).
  messaging::Gateway rollout_gw({"rollout", "inproc://kiln-run-" + std::to_string(::getpid())});
  const std::string run_tag = "/tmp/kiln-run-" + std::to_string(::getpid());
  // The ipc:// socket files of this run, removed on every way out: normal returns (the
  // destructor) and SIGINT/SIGTERM/SIGHUP (the handler; the nodes exit with their parent).
  struct RemoveSockets {
    std::vector<std::string> paths;
    RemoveSockets(const std::string& tag, int64_t engines) {
      paths = {tag + "-controller", tag + "-rollout", tag + "-ref", tag + "-trainer"};
      for (int64_t i = 1; i < engines; ++i) paths.push_back(tag + "-rollout-" + std::to_string(i));
      g_socket_count = 0;
      for (const auto& p : paths)
        if (g_socket_count < kMaxSockets && p.size() < sizeof g_sockets[0])
          std::snprintf(g_sockets[g_socket_count++], sizeof g_sockets[0], "%s", p.c_str());
      for (int sig : {SIGINT, SIGTERM, SIGHUP}) std::signal(sig, remove_sockets_and_die);
    }
    ~RemoveSockets() {
      for (int sig : {SIGINT, SIGTERM, SIGHUP}) std::signal(sig, SIG_DFL);
      g_socket_count = 0;
      for (const auto& p : paths) std::remove(p.c_str());
    }
  } remove_sockets{run_tag, c.placement.rollout_engines};
  // The controller's gateway: the graph root the nodes join.
  messaging::Gateway controller_gw({"controller", remote ? "ipc://" + run_tag + "-controller" : ""});
  std::mutex received_mu;
  std::optional<std::pair<std::vector<messaging::Tensor>, int64_t>> received;
  auto receiver = std::make_shared<weight_sync::ReceiverService>([&](std::vector<messaging::Tensor> t, int64_t v) {
    std::lock_guard<std::mutex> l(received_mu);
    received = std::make_pair(std::move(t), v);
  });
  rollout_gw.serve("weight_sync/0", [&rollout_gw, receiver](messaging::Envelope env) {
    auto r = receiver->handle(env);
    if (r) rollout_gw.reply(env, std::move(*r));
    else rollout_gw.reply_error(env, r.error());
  });
  controller_gw.add_route("weight_sync/0", rollout_gw.endpoint());
  // Sends the policy as `version`; returns the tensors the receiver verified. `copy`: send
  // copies (async mode: the trainer keeps writing its parameters while the engine loads).
  // Multi-process placement: the rollout engine lives in a `kiln node` child process that
  // joins this process's gateway as graph root and hosts rollout/0.
  // placement.rollout_engines nodes, rollout/0..N-1, each its own process.
  std::vector<std::unique_ptr<RolloutNode>> nodes;
  if (remote) {
    for (int64_t i = 0; i < c.placement.rollout_engines; ++i) {
      nodes.push_back(std::make_unique<RolloutNode>());
      auto err = nodes.back()->start(controller_gw, run_tag, c, dir, i);
      if (!err.empty()) {
        std::fprintf(stderr, "kiln run: %s\n", err.c_str());
        return 2;
      }
    }
  }
  // The policy's HF tensors; `copy`: owned copies (async mode: the trainer keeps writing its
  // parameters while the rollout side loads them).
  auto snapshot = [&](bool copy) {
    std::vector<messaging::Tensor> tensors;
    for (auto& t : policy->hf_state_dict())
      tensors.push_back(copy ? messaging::Tensor::copy_of(t.name, t.dtype, t.shape, t.data, t.nbytes) : t);
    return tensors;
  };
  // Sends `tensors` as `version` to every engine; returns what the in-process receiver verified
  // (remote engines verify and apply themselves: returns nothing).
  auto send_to_engines = [&](std::vector<messaging::Tensor> tensors, int64_t version) {
    std::vector<std::string> targets;
    if (remote)
      for (const auto& n : nodes) targets.push_back(n->actor());
    else
      targets.push_back("weight_sync/0");
    for (const auto& to : targets) {  // every engine gets the version, each checked before applying
      auto r = weight_sync::send_weights(controller_gw, to, tensors, version, uint64_t(c.weight_sync.bucket_mib * (1 << 20)),
                                         std::chrono::seconds(120));
      if (!r)
        throw std::runtime_error(std::string(remote ? "rollout node " + to + ": " : "") + "weight sync of version " +
                                 std::to_string(version) + ": " + r.error().what());
    }
    if (remote) return std::vector<messaging::Tensor>{};  // the nodes verified and applied them
    std::lock_guard<std::mutex> l(received_mu);
    auto out = std::move(received->first);
    received.reset();
    return out;
  };
  TrainerNode trainer_node;
  auto version = [&] { return remote_trainer ? trainer_node.version() : local_trainer->version(); };
  // The current version to every engine. Local trainer: returns what the in-process receiver
  // verified (empty for remote engines). Trainer node: it streams to each engine itself.
  auto push_weights = [&](bool copy) {
    if (!remote_trainer) return send_to_engines(snapshot(copy), version());
    std::vector<std::string> engines;
    for (const auto& n : nodes) engines.push_back(n->actor());
    try {
      trainer_node.push(controller_gw, engines);
    } catch (const TrainerNode::Error& e) {  // the message names the engine
      if (e.target_failed) throw std::runtime_error(std::string("rollout node failed: ") + e.what());
      throw;
    }
    return std::vector<messaging::Tensor>{};
  };
  auto apply_to_engine = [&](std::vector<messaging::Tensor> tensors, int64_t v) {
    if (remote) return;
    engine->pause();  // between decode steps
    engine->update_weights(tensors, v);
    engine->resume();
  };
  // A checkpoint of steps 1..step, written where the policy lives.
  auto save = [&](const fs::path& ck, int64_t step, const std::string& prompt_rng) {
    if (remote_trainer) trainer_node.save(controller_gw, ck, step, prompt_rng);
    else trainer::save_checkpoint(ck, *policy, *local_trainer, {step, version(), prompt_rng});
  };
  RefNode ref_node;
  const bool remote_ref = c.placement.reference == "process";
  if (remote_ref) {  // the frozen reference: the initial policy's weights, checked by the node
    auto err = ref_node.start(controller_gw, run_tag, c, dir);
    if (err.empty() && !remote_trainer) {
      auto r = weight_sync::send_weights(controller_gw, RefNode::kActor, snapshot(false), 0,
                                         uint64_t(c.weight_sync.bucket_mib * (1 << 20)), std::chrono::seconds(120));
      if (!r) err = std::string("reference node: weight sync: ") + r.error().what();
    }
    if (!err.empty()) {
      std::fprintf(stderr, "kiln run: %s\n", err.c_str());
      return 2;
    }
  }
  if (remote_trainer) {  // the seeded initial policy, also the reference's weights
    auto err = trainer_node.start(controller_gw, run_tag, c, dir);
    if (err.empty() && tokenizer.vocab_size() > trainer_node.vocab_size())
      err = "model vocabulary " + std::to_string(trainer_node.vocab_size()) + " is smaller than the task tokenizer's " +
            std::to_string(tokenizer.vocab_size());
    if (err.empty()) {
      try {
        trainer_node.push(controller_gw, {RefNode::kActor});
      } catch (const std::exception& e) {
        err = std::string("reference node: ") + e.what();
      }
    }
    if (!err.empty()) {
      std::fprintf(stderr, "kiln run: %s\n", err.c_str());
      return 2;
    }
  }
  int64_t first_step = 1;
  if (!c.run.resume_from.empty()) {
    try {
      fs::path ck(c.run.resume_from);
      trainer::CheckpointState state;
      if (remote_trainer) {
        state = trainer::read_checkpoint_state(ck);  // the loop's part; the node loads the rest
        trainer_node.load(controller_gw, ck);
      } else {
        state = trainer::load_checkpoint(ck, *policy, *local_trainer);
      }
      std::istringstream r(state.prompt_rng);
      r >> rng;
      if (!r) throw std::invalid_argument("state.json in '" + ck.string() + "': prompt_rng is not an RNG state");
      first_step = state.step + 1;
      if (state.step >= c.run.steps)
        throw std::invalid_argument("it holds steps 1.." + std::to_string(state.step) + " and run.steps is " +
                                    std::to_string(c.run.steps) + ": nothing to train (raise run.steps to go on)");
      std::fprintf(stderr, "kiln run: resumed from %s at step %lld\n", ck.c_str(), (long long)first_step);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kiln run: cannot resume from '%s': %s\n", c.run.resume_from.c_str(), e.what());
      return 2;
    }
  }
  // The engines start from the trainer's current version (initial, or resumed).
  try {
    if (remote) push_weights(false);
    else if (first_step > 1) apply_to_engine(push_weights(false), version());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln run: %s\n", e.what());
    return 1;
  }
  if (first_step > 1) {
    const int64_t dropped = drop_metric_rows_from(dir, first_step);
    if (dropped > 0)
      std::fprintf(stderr, "kiln run: dropped %lld metric rows of steps after the checkpoint (those steps are trained again now)\n",
                   (long long)dropped);
  }
  const auto mode = first_step > 1 ? std::ios::app : std::ios::trunc;
  std::ofstream metrics(dir / "metrics.jsonl", mode), tsv(dir / "metrics.tsv", mode);
  auto run_start = Clock::now();
  // Prompt RNG state after the last batch the trainer took (= before the next step's prompts):
  // what a checkpoint of "steps 1..s trained" must hold, whatever the rollout thread drew since.
  std::string rng_consumed;
  {
    std::ostringstream now;
    now << rng;
    rng_consumed = now.str();
  }
  // Draws the step's prompts and generates n samples each; `between_steps` runs between
  // decode steps (async mode applies pending weights there).
  auto generate_batch = [&](int64_t step, const std::function<void()>& between_steps) {
    auto t0 = Clock::now();
    Batch b;
    b.step = step;
    std::vector<rollout::GenerationRequest> requests;
    for (int64_t p = 0; p < a.prompts_per_step; ++p) {
      b.problems.push_back(task->sample(rng));
      auto prompt = tokenizer.encode(b.problems.back().prompt);
      prompt.insert(prompt.begin(), tokenizer.bos_id());
      for (int64_t j = 0; j < a.samples_per_prompt; ++j) {
        rollout::GenerationRequest r;
        r.id = uint64_t(p * a.samples_per_prompt + j);
        r.prompt = prompt;
        r.sampling.temperature = a.temperature;
        r.sampling.top_p = a.top_p;
        r.sampling.top_k = a.top_k;
        r.sampling.max_new_tokens = a.max_new_tokens;
        r.sampling.stop_token_ids = tokenizer.eos_ids();
        r.sampling.seed = uint64_t(c.run.seed) * 1000003u + uint64_t(step) * 7919u + r.id;
        requests.push_back(std::move(r));
      }
    }
    std::ostringstream rs;
    rs << rng;
    b.rng_after = rs.str();
    if (remote) {
      // Whole prompt groups to each engine, contiguous shares; all engines work at once.
      const int64_t groups = a.prompts_per_step, N = int64_t(nodes.size());
      std::vector<RolloutNode::Pending> pending;
      for (int64_t i = 0; i < N; ++i) {
        const int64_t g0 = groups * i / N, g1 = groups * (i + 1) / N;
        std::vector<rollout::GenerationRequest> share(requests.begin() + g0 * a.samples_per_prompt,
                                                      requests.begin() + g1 * a.samples_per_prompt);
        pending.push_back(nodes[std::size_t(i)]->send_generate(controller_gw, share));
      }
      for (int64_t i = 0; i < N; ++i)  // throws on a lost node, naming it
        for (auto& comp : nodes[std::size_t(i)]->collect(pending[std::size_t(i)])) b.completions.push_back(std::move(comp));
      std::sort(b.completions.begin(), b.completions.end(), [](const auto& x, const auto& y) { return x.id < y.id; });
      b.rollout_time = since(t0);
      return b;
    }
    for (auto& r : requests) engine->submit(std::move(r));
    while (engine->has_work()) {
      for (auto& comp : engine->step()) b.completions.push_back(std::move(comp));
      if (c.rollout.step_delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(c.rollout.step_delay_ms));
      between_steps();
    }
    std::sort(b.completions.begin(), b.completions.end(), [](const auto& x, const auto& y) { return x.id < y.id; });
    b.rollout_time = since(t0);
    return b;
  };
  std::unique_ptr<AsyncRollout> async;
  if (a.staleness > 0) {
    // Local: the verified weights go into the engine between decode steps. Remote: the rollout
    // thread sends them to the engine processes before its next request (only it talks to
    // them); a trainer node streams its newest version (never older than the posted one).
    AsyncRollout::Apply apply = [&](std::vector<messaging::Tensor> w, int64_t v) {
      if (remote_trainer) push_weights(false);
      else if (remote) send_to_engines(std::move(w), v);
      else apply_to_engine(std::move(w), v);
    };
    async = std::make_unique<AsyncRollout>(apply, generate_batch, first_step, c.run.steps, a.staleness);
  }
  auto checkpoint_name = [&](int64_t step) {
    char name[32];
    std::snprintf(name, sizeof name, "step_%06lld", (long long)step);
    return dir / "checkpoints" / name;
  };
  // A failed node: keep everything trained so far (checkpoint of steps 1..`trained` with the
  // data cursor after them), say how to continue, exit 1. A lost trainer node takes its policy
  // with it: then only the checkpoints already written remain.
  auto checkpoint_and_stop = [&](int64_t step, const std::string& what, int64_t trained, const std::string& rng_state) {
    std::fprintf(stderr, "kiln run: step %lld: %s\n", (long long)step, what.c_str());
    auto ck = checkpoint_name(trained);
    try {
      save(ck, trained, rng_state);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kiln run: cannot save a checkpoint of steps 1..%lld: %s\n%s", (long long)trained, e.what(),
                   continue_hint(dir).c_str());
      return 1;
    }
    std::fprintf(stderr, "kiln run: saved %s (steps 1..%lld trained); continue with --set run.resume_from=%s\n",
                 ck.c_str(), (long long)trained, ck.c_str());
    return 1;
  };
  for (int64_t step = first_step; step <= c.run.steps; ++step) {
    Batch batch;
    try {
      batch = async ? async->take(step) : generate_batch(step, [] {});
    } catch (const std::exception& e) {
      return checkpoint_and_stop(step, e.what(), step - 1, rng_consumed);
    }
    const auto& problems = batch.problems;
    const auto& completions = batch.completions;
    const double rollout_time = batch.rollout_time;
    // Rewards, groups, advantages.
    std::vector<float> rewards;
    double entropy = 0;
    int64_t gen_tokens = 0;
    std::map<int64_t, int64_t> staleness;
    for (const auto& comp : completions) {
      std::vector<int64_t> text_ids = comp.tokens;
      if (comp.finish_reason == rollout::FinishReason::stop) text_ids.pop_back();
      rewards.push_back(float(task->reward(problems[comp.id / uint64_t(a.samples_per_prompt)], tokenizer.decode(text_ids))));
      for (std::size_t i = 0; i < comp.tokens.size(); ++i) {
        entropy += comp.entropies[i];
        ++staleness[version() - comp.policy_versions[i]];
      }
      gen_tokens += int64_t(comp.tokens.size());
    }
    // Reference log-probs of every completion: the KL loss term and the KL metric.
    double ref_time = 0, update_time = 0, kl_metric = 0;
    std::vector<std::vector<float>> ref;
    {
      auto tr = Clock::now();
      std::vector<trainer::Sample> all(completions.size());
      for (std::size_t i = 0; i < completions.size(); ++i) {
        all[i].prompt = completions[i].prompt;
        all[i].completion = completions[i].tokens;
        all[i].routed_experts = completions[i].routed_experts;
      }
      try {
        ref = remote_ref ? ref_node.logprobs(controller_gw, completions, a.routing_replay)
                         : trainer::completion_logprobs(*ref_model, all, a.max_tokens_per_microbatch, a.routing_replay,
                                                        a.temperature);
      } catch (const std::exception& e) {
        return checkpoint_and_stop(step, e.what(), step - 1, rng_consumed);
      }
      ref_time = since(tr);
      std::vector<float> sampled, reference;  // every generated token, one KL estimate call
      for (std::size_t i = 0; i < completions.size(); ++i) {
        sampled.insert(sampled.end(), completions[i].logprobs.begin(), completions[i].logprobs.end());
        reference.insert(reference.end(), ref[i].begin(), ref[i].end());
      }
      if (!sampled.empty())
        kl_metric = trainer::kl_estimate(torch::tensor(sampled), torch::tensor(reference), tc.loss.kl_estimator)
                        .mean()
                        .item<double>();
    }
    trainer::StepMetrics m;
    auto r = torch::tensor(rewards);
    auto adv_t = trainer::grpo_advantages(r, a.samples_per_prompt, a.normalize_std).contiguous();
    std::vector<float> adv(adv_t.data_ptr<float>(), adv_t.data_ptr<float>() + adv_t.numel());
    std::vector<trainer::Sample> samples;
    int64_t filtered = 0, stale_dropped = 0;
    for (int64_t p = 0; p < a.prompts_per_step; ++p) {
      auto group = r.narrow(0, p * a.samples_per_prompt, a.samples_per_prompt);
      if (a.filter_zero_variance && (group.max() - group.min()).item<float>() == 0) {
        ++filtered;
        continue;
      }
      bool too_stale = false;  // never train version t on tokens of version p < t - k
      for (int64_t j = 0; j < a.samples_per_prompt; ++j)
        for (auto v : completions[std::size_t(p * a.samples_per_prompt + j)].policy_versions)
          too_stale |= version() - v > a.staleness;
      if (too_stale) {
        ++stale_dropped;
        continue;
      }
      for (int64_t j = 0; j < a.samples_per_prompt; ++j) {
        const auto& comp = completions[std::size_t(p * a.samples_per_prompt + j)];
        trainer::Sample s;
        s.prompt = comp.prompt;
        s.completion = comp.tokens;
        s.behavior_logprobs = comp.logprobs;
        s.routed_experts = comp.routed_experts;
        s.ref_logprobs = ref[std::size_t(p * a.samples_per_prompt + j)];
        s.advantage = adv[std::size_t(p * a.samples_per_prompt + j)];
        samples.push_back(std::move(s));
      }
    }
    std::vector<messaging::Tensor> new_weights;
    std::string sync_error;
    double log_probs_time = 0;
    if (!samples.empty() && remote_trainer) {
      try {
        m = trainer_node.train(controller_gw, samples, log_probs_time);
      } catch (const std::exception& e) {  // the trainer node failed: its state since the last checkpoint is gone
        std::fprintf(stderr, "kiln run: step %lld: %s\n%s", (long long)step, e.what(), continue_hint(dir).c_str());
        return 1;
      }
    } else if (!samples.empty()) {
      if (a.recompute_old_logprobs) {  // pi_old in its own pass (verl/slime "log_probs")
        auto tl = Clock::now();
        auto old = trainer::completion_logprobs(*policy, samples, a.max_tokens_per_microbatch, a.routing_replay,
                                                a.temperature);
        for (std::size_t i = 0; i < samples.size(); ++i) samples[i].old_logprobs = std::move(old[i]);
        log_probs_time = since(tl);
      }
      m = local_trainer->train_step(samples);
    }
    if (!samples.empty()) {
      if (a.update_delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(a.update_delay_ms));
      try {
        auto tu = Clock::now();
        if (async && remote_trainer) {}                                    // pushed when the rollout thread applies
        else if (async && remote) new_weights = snapshot(/*copy=*/true);  // sent by the rollout thread
        else if (async) new_weights = push_weights(/*copy=*/true);        // applied by the rollout thread
        else apply_to_engine(push_weights(/*copy=*/false), version());
        update_time = since(tu);
      } catch (const std::exception& e) {
        // The step is trained: record it, checkpoint it, then stop (nothing trained is lost).
        sync_error = e.what();
        update_time = -1;
      }
    }
    if (async && sync_error.empty()) async->consumed(step, !samples.empty(), std::move(new_weights), version());
    rng_consumed = batch.rng_after;
    m.kl = kl_metric;
    const double reward_mean = r.mean().item<double>(), reward_std = r.std(false).item<double>();
    nlohmann::json j;
    j["step"] = step;
    j["reward_mean"] = reward_mean;
    j["reward_std"] = reward_std;
    j["kl"] = m.kl;
    j["entropy"] = gen_tokens ? entropy / double(gen_tokens) : 0.0;  // of the sampling distribution
    j["clip_fraction"] = m.clip_fraction;
    j["train/rollout logprob abs diff"] = m.train_rollout_logprob_abs_diff;
    j["loss"] = m.loss;
    j["grad_norm"] = m.grad_norm;
    j["lr"] = m.lr;
    j["filtered_groups"] = filtered;
    j["stale_dropped_groups"] = stale_dropped;
    j["trained_samples"] = samples.size();
    nlohmann::json hist = nlohmann::json::object();
    for (const auto& [k, n] : staleness) hist[std::to_string(k)] = n;
    j["staleness_histogram"] = hist;
    j["rollout_time"] = rollout_time;
    j["ref_logprob_time"] = ref_time;
    j["log_probs_time"] = log_probs_time;
    j["actor_train_time"] = m.actor_train_time;
    j["update_weights_time"] = update_time;
    j["train_tokens_per_s"] = m.actor_train_time > 0 ? double(m.tokens) / m.actor_train_time : 0.0;
    j["policy_version"] = version();
    j["elapsed_s"] = since(run_start);
    metrics << j.dump() << "\n" << std::flush;
    tsv << step << "\t" << reward_mean << "\t" << m.kl << "\n" << std::flush;
    // The step is trained (and logged): a failed sync checkpoints it, then stops.
    if (!sync_error.empty()) return checkpoint_and_stop(step, sync_error, step, batch.rng_after);
    if (c.run.checkpoint_every > 0 && step % c.run.checkpoint_every == 0) {
      try {
        save(checkpoint_name(step), step, batch.rng_after);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "kiln run: step %lld: cannot save a checkpoint: %s\n%s", (long long)step, e.what(),
                     continue_hint(dir).c_str());
        return 1;
      }
    }
    if (c.logging.progress)
      std::fprintf(stderr, "step %3lld/%lld  reward %.3f ±%.3f  kl %.4f  clip %.3f  filtered %lld/%lld  rollout %.2fs  train %.2fs  sync %.3fs\n",
                   (long long)step, (long long)c.run.steps, reward_mean, reward_std, m.kl, m.clip_fraction,
                   (long long)filtered, (long long)a.prompts_per_step, rollout_time, m.actor_train_time, update_time);
  }
  if (c.logging.plot) plot(dir);
  std::fprintf(stderr, "kiln run: done in %.1fs; metrics in %s\n", since(run_start), (dir / "metrics.jsonl").c_str());
  return 0;
}

}  // namespace kiln::experiments

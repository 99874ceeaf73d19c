#include "experiments/rl_run.hpp"
#include "experiments/rollout_drivers.hpp"

#include <torch/torch.h>

#include <chrono>
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
#include "actors/trainer/trainer.hpp"
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


// A checkpoint: the policy in HF layout (loads in transformers), the optimizer state and the
// loop state (step, policy version, the prompt RNG) in state.json.
void save_checkpoint(const std::filesystem::path& dir, model::CausalLM& policy, trainer::Trainer& trainer,
                     int64_t step, const std::string& prompt_rng) {
  std::filesystem::create_directories(dir);
  policy.save_hf_checkpoint(dir.string(), uint64_t(5) << 30);
  torch::save(trainer.optimizer(), (dir / "optimizer.pt").string());
  // bf16 policies: the fp32 master weights too, or a resumed run would restart from rounded ones.
  if (trainer.uses_master_weights()) torch::save(trainer.master_parameters(), (dir / "master_weights.pt").string());
  nlohmann::json state{{"step", step}, {"policy_version", trainer.version()}, {"prompt_rng", prompt_rng}};
  std::ofstream(dir / "state.json") << state.dump(2) << "\n";
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
  try {
    fs::create_directories(dir);
    std::ofstream(dir / "config.toml") << c.to_toml();
    auto registry = model::Registry::with_plugins();
    torch::manual_seed(uint64_t(c.run.seed));
    policy = registry.build(c.model.package, c.model.flavor, c.model.checkpoint);
    engine_model = registry.build(c.model.package, c.model.flavor, c.model.checkpoint);
    engine_model->load_hf_tensors(policy->hf_state_dict());
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
    if (tokenizer.vocab_size() > engine_model->vocab_size())
      throw std::invalid_argument("model vocabulary " + std::to_string(engine_model->vocab_size()) +
                                  " is smaller than the task tokenizer's " + std::to_string(tokenizer.vocab_size()));
    task = build_task(c.task);
    const auto& a = c.algorithm;
    tc.max_tokens_per_microbatch = a.max_tokens_per_microbatch;
    tc.lr = a.lr;
    tc.weight_decay = a.weight_decay;
    tc.grad_clip = a.grad_clip;
    tc.lr_schedule = a.lr_schedule;
    tc.warmup_steps = a.warmup_steps;
    tc.total_steps = c.run.steps;
    tc.routing_replay = a.routing_replay;
    tc.temperature = a.temperature;
    tc.loss.clip_low = a.clip_low;
    tc.loss.clip_high = a.clip_high;
    tc.loss.kl_coef = a.kl_coef;
    tc.loss.kl_estimator = trainer::kl_estimator_from_string(a.kl_estimator);
    tc.loss.aggregation = trainer::aggregation_from_string(a.aggregation);
    tc.loss.tis_cap = a.tis_cap;
    tc.loss.entropy_coef = a.entropy_coef;
    tc.validate();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln run: %s\n", e.what());
    return 2;
  }
  const auto& a = c.algorithm;
  trainer::Trainer trainer(policy, tc);
  rollout::EngineOptions eo;
  eo.cache_blocks = c.rollout.cache_blocks;
  eo.block_size = c.rollout.block_size;
  eo.max_batch = c.rollout.max_batch;
  rollout::Engine engine(engine_model, eo);
  std::mt19937_64 rng(uint64_t(c.run.seed));
  // Weight sync over the messaging layer: the trainer side sends each new version to the
  // rollout side's receiver service (inproc in one process: tensor frames are zero-copy).
  messaging::Gateway rollout_gw({"rollout", "inproc://kiln-run-" + std::to_string(::getpid())});
  const bool remote = c.placement.mode == "multi_process";
  const std::string run_tag = "/tmp/kiln-run-" + std::to_string(::getpid());
  struct RemoveSockets {  // the ipc:// socket files of this run, on every way out
    std::string tag;
    int64_t engines;
    ~RemoveSockets() {
      std::remove((tag + "-trainer").c_str());
      std::remove((tag + "-rollout").c_str());
      for (int64_t i = 1; i < engines; ++i) std::remove((tag + "-rollout-" + std::to_string(i)).c_str());
      std::remove((tag + "-ref").c_str());
    }
  } remove_sockets{run_tag, c.placement.rollout_engines};
  messaging::Gateway trainer_gw({"trainer", remote ? "ipc://" + run_tag + "-trainer" : ""});
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
  trainer_gw.add_route("weight_sync/0", rollout_gw.endpoint());
  // Sends the policy as `version`; returns the tensors the receiver verified. `copy`: send
  // copies (async mode: the trainer keeps writing its parameters while the engine loads).
  // Multi-process placement: the rollout engine lives in a `kiln node` child process that
  // joins this process's gateway as graph root and hosts rollout/0.
  // placement.rollout_engines nodes, rollout/0..N-1, each its own process.
  std::vector<std::unique_ptr<RolloutNode>> nodes;
  if (remote) {
    for (int64_t i = 0; i < c.placement.rollout_engines; ++i) {
      nodes.push_back(std::make_unique<RolloutNode>());
      auto err = nodes.back()->start(trainer_gw, run_tag, c, dir, i);
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
      auto r = weight_sync::send_weights(trainer_gw, to, tensors, version, uint64_t(c.weight_sync.bucket_mib * (1 << 20)),
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
  auto push_weights = [&](int64_t version, bool copy) { return send_to_engines(snapshot(copy), version); };
  auto apply_to_engine = [&](std::vector<messaging::Tensor> tensors, int64_t version) {
    if (remote) return;
    engine.pause();  // between decode steps
    engine.update_weights(tensors, version);
    engine.resume();
  };
  RefNode ref_node;
  const bool remote_ref = c.placement.reference == "process";
  if (remote_ref) {  // the frozen reference: the initial policy's weights, checked by the node
    auto err = ref_node.start(trainer_gw, run_tag, c, dir);
    if (err.empty()) {
      auto r = weight_sync::send_weights(trainer_gw, RefNode::kActor, snapshot(false), 0,
                                         uint64_t(c.weight_sync.bucket_mib * (1 << 20)), std::chrono::seconds(120));
      if (!r) err = std::string("reference node: weight sync: ") + r.error().what();
    }
    if (!err.empty()) {
      std::fprintf(stderr, "kiln run: %s\n", err.c_str());
      return 2;
    }
  }
  if (remote) {
    try {
      push_weights(trainer.version(), false);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kiln run: %s\n", e.what());
      return 1;
    }
  }
  int64_t first_step = 1;
  if (!c.run.resume_from.empty()) {
    try {
      fs::path ck(c.run.resume_from);
      std::ifstream in(ck / "state.json");
      if (!in) throw std::invalid_argument("no state.json in '" + ck.string() + "'");
      auto state = nlohmann::json::parse(in);
      policy->load_hf_checkpoint(ck.string());
      torch::load(trainer.optimizer(), (ck / "optimizer.pt").string());
      trainer.reload_master_weights();
      if (trainer.uses_master_weights() && fs::exists(ck / "master_weights.pt")) {
        std::vector<torch::Tensor> saved;
        torch::load(saved, (ck / "master_weights.pt").string());
        const auto& masters = trainer.master_parameters();
        if (saved.size() != masters.size())
          throw std::invalid_argument("master_weights.pt in '" + ck.string() + "' holds " +
                                      std::to_string(saved.size()) + " tensors, the policy " +
                                      std::to_string(masters.size()));
        torch::NoGradGuard no_grad;
        for (std::size_t i = 0; i < saved.size(); ++i) masters[i].copy_(saved[i]);
      }
      trainer.set_version(state.at("policy_version").get<int64_t>());
      std::istringstream r(state.at("prompt_rng").get<std::string>());
      r >> rng;
      first_step = state.at("step").get<int64_t>() + 1;
      apply_to_engine(push_weights(trainer.version(), false), trainer.version());
      std::fprintf(stderr, "kiln run: resumed from %s at step %lld\n", ck.c_str(), (long long)first_step);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kiln run: cannot resume from '%s': %s\n", c.run.resume_from.c_str(), e.what());
      return 2;
    }
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
        pending.push_back(nodes[std::size_t(i)]->send_generate(trainer_gw, share));
      }
      for (int64_t i = 0; i < N; ++i)  // throws on a lost node, naming it
        for (auto& comp : nodes[std::size_t(i)]->collect(pending[std::size_t(i)])) b.completions.push_back(std::move(comp));
      std::sort(b.completions.begin(), b.completions.end(), [](const auto& x, const auto& y) { return x.id < y.id; });
      b.rollout_time = since(t0);
      return b;
    }
    for (auto& r : requests) engine.submit(std::move(r));
    while (engine.has_work()) {
      for (auto& comp : engine.step()) b.completions.push_back(std::move(comp));
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
    // thread sends them to the engine processes before its next request (only it talks to them).
    AsyncRollout::Apply apply = [&](std::vector<messaging::Tensor> w, int64_t version) {
      if (remote) send_to_engines(std::move(w), version);
      else apply_to_engine(std::move(w), version);
    };
    async = std::make_unique<AsyncRollout>(apply, generate_batch, first_step, c.run.steps, a.staleness);
  }
  // A lost rollout or reference node: keep everything trained so far (checkpoint of steps
  // 1..step-1 with the data cursor before this step), say how to continue, exit 1.
  auto checkpoint_and_stop = [&](int64_t step, const std::string& what) {
    std::fprintf(stderr, "kiln run: step %lld: %s\n", (long long)step, what.c_str());
    if (remote) {
      char name[32];
      std::snprintf(name, sizeof name, "step_%06lld", (long long)(step - 1));
      auto ck = dir / "checkpoints" / name;
      save_checkpoint(ck, *policy, trainer, step - 1, rng_consumed);
      std::fprintf(stderr, "kiln run: saved %s (steps 1..%lld trained); continue with --set run.resume_from=%s\n",
                   ck.c_str(), (long long)(step - 1), ck.c_str());
    }
    return 1;
  };
  for (int64_t step = first_step; step <= c.run.steps; ++step) {
    Batch batch;
    try {
      batch = async ? async->take(step) : generate_batch(step, [] {});
    } catch (const std::exception& e) {
      return checkpoint_and_stop(step, e.what());
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
        ++staleness[trainer.version() - comp.policy_versions[i]];
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
        ref = remote_ref ? ref_node.logprobs(trainer_gw, completions, a.routing_replay)
                         : trainer::completion_logprobs(*ref_model, all, a.max_tokens_per_microbatch, a.routing_replay,
                                                        a.temperature);
      } catch (const std::exception& e) {
        return checkpoint_and_stop(step, e.what());
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
          too_stale |= trainer.version() - v > a.staleness;
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
    if (!samples.empty() && a.recompute_old_logprobs) {  // pi_old in its own pass (verl/slime "log_probs")
      auto tl = Clock::now();
      auto old = trainer::completion_logprobs(*policy, samples, a.max_tokens_per_microbatch, a.routing_replay,
                                              a.temperature);
      for (std::size_t i = 0; i < samples.size(); ++i) samples[i].old_logprobs = std::move(old[i]);
      log_probs_time = since(tl);
    }
    if (!samples.empty()) {
      m = trainer.train_step(samples);
      if (a.update_delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(a.update_delay_ms));
      try {
        auto tu = Clock::now();
        if (async && remote) new_weights = snapshot(/*copy=*/true);               // sent by the rollout thread
        else if (async) new_weights = push_weights(trainer.version(), /*copy=*/true);  // applied by the rollout thread
        else apply_to_engine(push_weights(trainer.version(), /*copy=*/false), trainer.version());
        update_time = since(tu);
      } catch (const std::exception& e) {
        // The step is trained: record it, checkpoint it, then stop (nothing trained is lost).
        sync_error = e.what();
        update_time = -1;
      }
    }
    if (async && sync_error.empty()) async->consumed(step, std::move(new_weights), trainer.version());
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
    j["policy_version"] = trainer.version();
    j["elapsed_s"] = since(run_start);
    metrics << j.dump() << "\n" << std::flush;
    tsv << step << "\t" << reward_mean << "\t" << m.kl << "\n" << std::flush;
    if (!sync_error.empty()) {
      char name[32];
      std::snprintf(name, sizeof name, "step_%06lld", (long long)step);
      auto ck = dir / "checkpoints" / name;
      save_checkpoint(ck, *policy, trainer, step, batch.rng_after);
      std::fprintf(stderr, "kiln run: step %lld: %s\nkiln run: saved %s (steps 1..%lld trained); continue with --set run.resume_from=%s\n",
                   (long long)step, sync_error.c_str(), ck.c_str(), (long long)step, ck.c_str());
      return 1;
    }
    if (c.run.checkpoint_every > 0 && step % c.run.checkpoint_every == 0) {
      char name[32];
      std::snprintf(name, sizeof name, "step_%06lld", (long long)step);
      save_checkpoint(dir / "checkpoints" / name, *policy, trainer, step, batch.rng_after);
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

#include "actors/controller/config.hpp"
#include "actors/shown_value.hpp"

#include <map>
#include <stdexcept>

namespace kiln::controller {

namespace {

void need(bool ok, const std::string& key, const std::string& why) {
  if (!ok) throw std::invalid_argument("experiment: key '" + key + "' " + printable(why));  // a value's \r or ESC shown, not run
}

// "cuda:N" in torch's own spelling: N without leading zeros and within c10::DeviceIndex
// (int8_t, so <= 127); "cuda:01" would pass a digits-only check, then fail in torch, and
// dodge the one-GPU-each check below as a name other than "cuda:1".
bool is_device(const std::string& d) {
  if (d == "cpu" || d == "cuda") return true;
  if (d.rfind("cuda:", 0) != 0) return false;
  const auto n = d.substr(5);
  return !n.empty() && n.size() <= 3 && n.find_first_not_of("0123456789") == std::string::npos &&
         (n == "0" || n[0] != '0') && std::stoi(n) <= 127;
}

// Where the actors run: placement.*, model.device and model.dtype.
void validate_placement(const Config& c) {
  need(c.placement.mode == "single_process" || c.placement.mode == "multi_process" || c.placement.mode == "colocated",
       "placement.mode",
       "must be \"single_process\", \"multi_process\" (rollout engine in a kiln node child process) or \"colocated\" "
       "(an engine in each trainer rank over the trainer's own weights)");
  if (c.placement.mode == "colocated") {  // rollout::ColocatedEngine, docs/parallel.md
    const std::string why = " with placement.mode \"colocated\" (the engines run over the trainer's parameters, "
                            "between its steps)";
    need(c.rollout.backend == "engine", "rollout.backend", "must be \"engine\"" + why);
    need(c.placement.trainer == "controller", "placement.trainer", "must be \"controller\"" + why);
    need(c.algorithm.staleness == 0, "algorithm.staleness",
         "must be 0" + why + ": rollouts cannot run ahead of a trainer they share the weights with, got " +
             shown(c.algorithm.staleness));
    need(!c.trainer.fsdp, "parallel.fsdp",
         "must be false" + why + ": fully sharded decoder layers are shards between steps");
    need(!c.rollout.engine.cuda_graphs || c.parallel.ep == 1, "rollout.cuda_graphs",
         "must be false with placement.mode \"colocated\" and parallel.ep > 1: an expert-parallel decode step reads "
         "the other ranks' row counts on the host, which a graph cannot capture");
  }
  need(is_device(c.model.device), "model.device",
       "must be \"cpu\", \"cuda\" or \"cuda:N\" (N in [0, 127], no leading zeros), got \"" + c.model.device + "\"");
  need(c.placement.rollout_engines >= 1 && c.placement.rollout_engines <= 64, "placement.rollout_engines",
       "must be in [1, 64], got " + shown(c.placement.rollout_engines));
  need(c.placement.rollout_engines == 1 || c.placement.mode == "multi_process", "placement.rollout_engines",
       "must be 1 unless placement.mode is \"multi_process\" (several engines run as kiln node processes), got "
       "placement.mode \"" + c.placement.mode + "\"");
  need(c.placement.rollout_device.empty() || c.placement.mode == "multi_process", "placement.rollout_device",
       "needs placement.mode \"multi_process\" (engines in their own processes)");
  for (const auto& d : c.placement.rollout_device)
    need(is_device(d), "placement.rollout_device",
         "must be \"cpu\", \"cuda\" or \"cuda:N\" (N in [0, 127], no leading zeros; one for every engine, or a "
         "list of one per engine), got \"" + d + "\"");
  need(c.placement.rollout_device.size() <= 1 ||
           int64_t(c.placement.rollout_device.size()) == c.placement.rollout_engines,
       "placement.rollout_device",
       "lists " + std::to_string(c.placement.rollout_device.size()) + " devices for " +
           std::to_string(c.placement.rollout_engines) + (c.placement.rollout_engines == 1 ? " engine" : " engines") +
           " (placement.rollout_engines): give one device for every engine (a string, or a list of one) or one per "
           "engine");
  need(c.placement.reference_device.empty() || is_device(c.placement.reference_device), "placement.reference_device",
       "must be \"\" (model.device), \"cpu\", \"cuda\" or \"cuda:N\" (N in [0, 127], no leading zeros), got \"" +
           c.placement.reference_device + "\"");
  need(c.placement.reference_device.empty() || c.placement.reference == "process", "placement.reference_device",
       "needs placement.reference \"process\" (the reference in its own process)");
  need(c.model.dtype == "fp32" || c.model.dtype == "bf16", "model.dtype",
       "must be \"fp32\" or \"bf16\", got \"" + c.model.dtype + "\"");
  need(c.placement.reference == "controller" || c.placement.reference == "process" ||
           c.placement.reference == "colocated",
       "placement.reference",
       "must be \"controller\", \"process\" or \"colocated\" (a frozen copy in each trainer rank)");
  need(c.placement.reference != "process" || c.placement.mode == "multi_process", "placement.reference",
       "\"process\" needs placement.mode \"multi_process\"");
  need(c.placement.reference != "colocated" || c.placement.trainer == "controller", "placement.reference",
       "\"colocated\" needs placement.trainer \"controller\" (the reference lives in the trainer's ranks)");
  need(c.placement.trainer == "controller" || c.placement.trainer == "process", "placement.trainer",
       "must be \"controller\" or \"process\"");
  need(c.placement.trainer == "controller" || (c.placement.mode == "multi_process" && c.placement.reference == "process"),
       "placement.trainer",
       "\"process\" needs placement.mode \"multi_process\" and placement.reference \"process\" "
       "(the controller then holds no model)");
  need(c.placement.rollout_engines <= c.algorithm.prompts_per_step, "placement.rollout_engines",
       "must be <= algorithm.prompts_per_step (each engine gets whole prompt groups), got " +
           std::to_string(c.placement.rollout_engines) + " engines for " + std::to_string(c.algorithm.prompts_per_step) +
           " prompts");
  need(c.placement.engine_restarts >= 0 && c.placement.engine_restarts <= 20, "placement.engine_restarts",
       "must be in [0, 20], got " + shown(c.placement.engine_restarts));
}


// Config::validate by section, in the order the keys are checked.
void validate_run_and_algorithm(const Config& c) {
  const auto& a = c.algorithm;
  need(c.run.steps >= 1, "run.steps", "must be >= 1, got " + shown(c.run.steps));
  need(!c.run.output_dir.empty(), "run.output_dir", "must not be empty");
  need(c.run.checkpoint_every >= 0, "run.checkpoint_every", "must be >= 0, got " + shown(c.run.checkpoint_every));
  need(a.prompts_per_step >= 1, "algorithm.prompts_per_step", "must be >= 1, got " + shown(a.prompts_per_step));
  need(a.samples_per_prompt >= 2, "algorithm.samples_per_prompt",
       "must be >= 2 (GRPO compares samples of one prompt), got " + shown(a.samples_per_prompt));
  need(a.max_new_tokens >= 1, "algorithm.max_new_tokens", "must be >= 1, got " + shown(a.max_new_tokens));
  need(a.staleness >= 0, "algorithm.staleness", "must be >= 0, got " + shown(a.staleness));
  need(a.update_delay_ms >= 0, "algorithm.update_delay_ms", "must be >= 0, got " + shown(a.update_delay_ms));
  need(a.max_nonfinite_steps >= 0, "algorithm.max_nonfinite_steps",
       "must be >= 0 (0: never stop for them), got " + shown(a.max_nonfinite_steps));
  need(a.top_p > 0 && a.top_p <= 1, "algorithm.top_p", "must be in (0, 1], got " + shown(a.top_p));
  need(a.top_k >= 0, "algorithm.top_k", "must be >= 0 (0: off), got " + shown(a.top_k));
  // The trainer's keys live in [algorithm] too; its own check names them.
  c.trainer_for_run().validate([](const std::string& field) {
    const bool parallel = field == "reduce_dtype";  // (fsdp and reshard_after_forward are booleans: always valid)
    return "experiment: key '" + std::string(parallel ? "parallel." : "algorithm.") + field + "'";
  });
}

void validate_rollout(const Config& c) {
  const auto& a = c.algorithm;
  const auto& e = c.rollout.engine;
  need(e.step_delay_ms >= 0, "rollout.step_delay_ms", "must be >= 0, got " + shown(e.step_delay_ms));
  need(e.cache_blocks >= 1, "rollout.cache_blocks", "must be >= 1, got " + shown(e.cache_blocks));
  need(e.block_size >= 1, "rollout.block_size", "must be >= 1, got " + shown(e.block_size));
  need(e.max_batch >= 1, "rollout.max_batch", "must be >= 1, got " + shown(e.max_batch));
  need(e.cache_blocks <= (int64_t(1) << 32), "rollout.cache_blocks", "must be <= 2^32, got " + shown(e.cache_blocks));
  need(e.block_size <= 4096, "rollout.block_size", "must be <= 4096 tokens, got " + shown(e.block_size));
  const int64_t cache_tokens = e.cache_blocks * e.block_size;
  need(a.max_new_tokens < cache_tokens, "algorithm.max_new_tokens",
       std::to_string(a.max_new_tokens) + " cannot fit the engine's cache of " + std::to_string(cache_tokens) +
           " tokens with a prompt (rollout.cache_blocks x rollout.block_size)");
  need(c.rollout.backend == "engine" || c.rollout.backend == "http", "rollout.backend",
       "must be \"engine\" (kiln's engine) or \"http\" (servers at rollout.urls), got \"" + c.rollout.backend + "\"");
  if (c.rollout.backend == "http") {
    need(!c.rollout.urls.empty(), "rollout.urls", "must list at least one server with rollout.backend \"http\"");
    for (const auto& u : c.rollout.urls)
      need(u.rfind("http://", 0) == 0 && u.size() > 7, "rollout.urls",
           "must hold http://HOST:PORT addresses, got \"" + u + "\"");
    need(int64_t(c.rollout.urls.size()) <= a.prompts_per_step, "rollout.urls",
         "must list at most algorithm.prompts_per_step servers (each gets whole prompt groups)");
    need(c.placement.trainer == "controller", "placement.trainer",
         "must be \"controller\" with rollout.backend \"http\" (the controller writes the weights the servers load)");
    need(c.placement.rollout_engines == 1, "placement.rollout_engines",
         "must be 1 with rollout.backend \"http\" (the servers at rollout.urls are the engines)");
    need(c.weight_sync.transport == "messages", "weight_sync.transport",
         "must be \"messages\" with rollout.backend \"http\" (rollout.weight_update says how the servers get weights)");
    need(c.rollout.http_timeout_s >= 1, "rollout.http_timeout_s",
         "must be >= 1, got " + shown(c.rollout.http_timeout_s));
    need(c.rollout.http_retry_s >= 0, "rollout.http_retry_s", "must be >= 0, got " + shown(c.rollout.http_retry_s));
    need(c.rollout.weight_update == "disk" || c.rollout.weight_update == "distributed", "rollout.weight_update",
         "must be \"disk\" (files under rollout.weights_dir) or \"distributed\" (a c10d broadcast group with the "
         "servers), got \"" + c.rollout.weight_update + "\"");
    need(!c.rollout.weight_update_address.empty(), "rollout.weight_update_address", "must not be empty");
  } else {
    need(c.rollout.urls.empty(), "rollout.urls", "is read by rollout.backend \"http\" only");
    need(c.rollout.weight_update == "disk", "rollout.weight_update", "is read by rollout.backend \"http\" only");
  }
  need(c.rollout.weight_update_timeout_s >= 1, "rollout.weight_update_timeout_s",
       "must be >= 1, got " + shown(c.rollout.weight_update_timeout_s));
  if (c.trainer.logprobs.true_on_policy) {
    // The mode needs kiln's engine to run the trainer's formula in batch-invariant kernels.
    need(c.rollout.backend == "engine", "algorithm.true_on_policy",
         "needs rollout.backend \"engine\" (kiln's engine runs the batch-invariant kernels; servers at rollout.urls "
         "do not)");
    need(!e.absorbed_decode, "algorithm.true_on_policy",
         "contradicts rollout.absorbed_decode = true: the mode decodes with the expanded attention, the trainer's "
         "formula (latent-space decode is another one); set rollout.absorbed_decode = false");
    need(!e.cuda_graphs, "algorithm.true_on_policy",
         "contradicts rollout.cuda_graphs = true: the captured decode step attends in latent space, not with the "
         "trainer's formula; set rollout.cuda_graphs = false");
  }
}

void validate_parallel(const Config& c) {
  const auto& par = c.parallel;
  need(par.dp >= 1 && par.dp <= 1024, "parallel.dp", "must be in [1, 1024], got " + shown(par.dp));
  need(par.ep >= 1 && par.ep <= 1024, "parallel.ep", "must be in [1, 1024], got " + shown(par.ep));
  need(par.dp * par.ep == 1 || c.placement.trainer == "controller", "parallel.dp",
       "and parallel.ep must be 1 with placement.trainer \"process\" (trainer rank 0 is the controller's process)");
  need(par.dp * par.ep == 1 || c.model.device == "cpu" || c.model.device == "cuda", "model.device",
       "must be \"cpu\" or \"cuda\" with several trainer ranks (each rank takes the GPU of its LOCAL_RANK)");
  need(par.master_port >= 0 && par.master_port <= 65535, "parallel.master_port",
       "must be in [0, 65535] (0: a free port), got " + shown(par.master_port));
  need(par.store_timeout_s >= 1 && par.store_timeout_s <= 86400, "parallel.store_timeout_s",
       "must be in [1, 86400], got " + shown(par.store_timeout_s));
  need(par.collective_timeout_s >= 1 && par.collective_timeout_s <= 86400, "parallel.collective_timeout_s",
       "must be in [1, 86400], got " + shown(par.collective_timeout_s));
}

void validate_weight_sync(const Config& c) {
  const auto& a = c.algorithm;
  need(c.weight_sync.bucket_mib > 0, "weight_sync.bucket_mib", "must be > 0, got " + shown(c.weight_sync.bucket_mib));
  need(c.weight_sync.transport == "messages" || c.weight_sync.transport == "collective", "weight_sync.transport",
       "must be \"messages\" or \"collective\"");
  if (c.weight_sync.transport == "collective") {
    need(c.placement.mode == "multi_process" && c.placement.trainer == "controller", "weight_sync.transport",
         "\"collective\" needs placement.mode \"multi_process\" and placement.trainer \"controller\" (the trainer "
         "broadcasts to engine processes)");
    need(a.staleness == 0, "weight_sync.transport",
         "\"collective\" needs algorithm.staleness = 0 (it broadcasts the trainer's live weights)");
    // NCCL's group holds trainer rank 0 and every engine, one process per GPU.
    std::map<std::string, std::string> gpu_of;  // "cuda:N" -> who holds it
    if (c.model.device != "cpu")
      gpu_of[c.model.device == "cuda" ? "cuda:0" : c.model.device] = "trainer rank 0 (model.device)";
    for (int64_t i = 0; i < c.placement.rollout_engines; ++i) {
      const auto r = c.placement.engine_device(std::size_t(i), c.model.device);
      need((r == "cpu") == (c.model.device == "cpu"), "placement.rollout_device",
           "must be a GPU when model.device is one, and \"cpu\" when it is \"cpu\", for weight_sync.transport "
           "\"collective\" (NCCL between GPUs, Gloo between CPU processes)");
      if (r == "cpu") continue;
      const auto [at, fresh] = gpu_of.emplace(r == "cuda" ? "cuda:0" : r, "engine " + std::to_string(i));
      need(fresh, "placement.rollout_device",
           "puts engine " + std::to_string(i) + " on " + at->first + " beside " + at->second +
               ": weight_sync.transport \"collective\" needs every engine and trainer rank 0 on GPUs of their own "
               "(one process per GPU in NCCL's group)");
    }
  }
}

void validate_task(const Config& c) {
  const auto& name = c.task.name;
  need(name == "next_digit" || name == "arithmetic" || name == "countdown" || name == "jsonl",
       "task.name",
       "must be \"next_digit\", \"arithmetic\", \"countdown\" or \"jsonl\", got \"" + c.task.name + "\"");
  if (c.task.name == "arithmetic") {
    const bool min_ok = c.task.min_digits >= 1 && c.task.min_digits <= 9;
    need(min_ok, "task.min_digits", "must be in [1, 9] with task.name \"arithmetic\", got " + shown(c.task.min_digits));
    need(c.task.max_digits >= c.task.min_digits && c.task.max_digits <= 9, "task.max_digits",
         "must be in [task.min_digits, 9] = [" + shown(c.task.min_digits) + ", 9] with task.name \"arithmetic\", got " +
             shown(c.task.max_digits));
    need(!c.task.operators.empty() && c.task.operators.find_first_not_of("+-*") == std::string::npos, "task.operators",
         "must be a non-empty string of \"+\", \"-\" and \"*\" with task.name \"arithmetic\", got \"" + c.task.operators +
             "\"");
  }
  need(c.task.name != "jsonl" || !c.task.path.empty(), "task.path", "must name a JSONL file with task.name \"jsonl\"");
  need(c.task.name == "jsonl" || c.task.path.empty(), "task.path",
       "is read by task.name \"jsonl\" only (task.name is \"" + c.task.name + "\")");
  need(!c.task.prompt_field.empty(), "task.prompt_field", "must not be empty");
  need(!c.task.answer_field.empty(), "task.answer_field", "must not be empty");
  need(c.task.chat_template == "glm47" || c.task.chat_template == "glm4" || c.task.chat_template == "none",
       "task.chat_template", "must be \"glm47\", \"glm4\" or \"none\" (got \"" + c.task.chat_template + "\")");
  need(c.task.chat_template == "none" || !c.task.tokenizer.empty(), "task.chat_template",
       "\"" + c.task.chat_template + "\" needs task.tokenizer (a tokenizer.json with the chat markers as tokens)");
}
}  // namespace

void Config::validate() const {
  validate_run_and_algorithm(*this);
  validate_rollout(*this);
  validate_placement(*this);
  validate_parallel(*this);
  validate_weight_sync(*this);
  validate_task(*this);
}

rollout::EngineOptions Config::engine_for_run() const {
  auto e = rollout.engine;
  e.true_on_policy = trainer.logprobs.true_on_policy;
  return e;
}

trainer::TrainerConfig Config::trainer_for_run() const {
  auto t = trainer;
  t.total_steps = run.steps;
  return t;
}

}  // namespace kiln::controller

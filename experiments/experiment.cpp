#include "experiments/experiment.hpp"

#include <charconv>
#include <cmath>
#include <cstdio>

#include <functional>
#include <map>
#include <stdexcept>
#include <toml++/toml.h>

namespace kiln::experiments {

namespace {
struct Field {
  std::function<void(const toml::node&, const std::string& where)> set;
  std::function<std::string()> show;
};

[[noreturn]] void bad(const std::string& where, const std::string& key, const std::string& why) {
  throw std::invalid_argument(where + ": key '" + key + "' " + why);
}

// A TOML basic string: quotes, backslashes and control characters escaped, so that to_toml()
// reads back (a name with a '"' made the run directory's config.toml unreadable).
std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20 || c == 0x7f) {
      char esc[8];
      std::snprintf(esc, sizeof esc, "\\u%04X", c);
      out += esc;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

std::map<std::string, Field> fields(ExperimentConfig& c) {
  std::map<std::string, Field> f;
  auto integer = [&](const std::string& key, int64_t& ref) {
    f[key] = {[&ref, key](const toml::node& n, const std::string& w) {
                if (!n.is_integer()) bad(w, key, "must be an integer");
                ref = n.as_integer()->get();
              },
              [&ref] { return std::to_string(ref); }};
  };
  auto real = [&](const std::string& key, double& ref) {
    f[key] = {[&ref, key](const toml::node& n, const std::string& w) {
                if (n.is_integer()) ref = double(n.as_integer()->get());
                else if (n.is_floating_point()) ref = n.as_floating_point()->get();
                else bad(w, key, "must be a number");
                if (!std::isfinite(ref)) bad(w, key, "must be a finite number");
              },
              [&ref] {
                // Shortest text that reads back to the same double (<< kept 6 digits).
                char buf[64];
                auto t = std::string(buf, std::to_chars(buf, buf + sizeof buf, ref).ptr);
                return t.find_first_of(".e") == std::string::npos ? t + ".0" : t;
              }};
  };
  auto boolean = [&](const std::string& key, bool& ref) {
    f[key] = {[&ref, key](const toml::node& n, const std::string& w) {
                if (!n.is_boolean()) bad(w, key, "must be true or false");
                ref = n.as_boolean()->get();
              },
              [&ref] { return std::string(ref ? "true" : "false"); }};
  };
  auto text = [&](const std::string& key, std::string& ref) {
    f[key] = {[&ref, key](const toml::node& n, const std::string& w) {
                if (!n.is_string()) bad(w, key, "must be a string");
                ref = n.as_string()->get();
              },
              [&ref] { return quoted(ref); }};
  };
  text("run.name", c.run.name);
  text("run.output_dir", c.run.output_dir);
  integer("run.seed", c.run.seed);
  integer("run.steps", c.run.steps);
  integer("run.checkpoint_every", c.run.checkpoint_every);
  text("run.resume_from", c.run.resume_from);
  text("model.package", c.model.package);
  text("model.flavor", c.model.flavor);
  text("model.checkpoint", c.model.checkpoint);
  text("model.device", c.model.device);
  text("model.dtype", c.model.dtype);
  text("task.name", c.task.name);
  integer("task.min_digits", c.task.min_digits);
  integer("task.max_digits", c.task.max_digits);
  text("task.operators", c.task.operators);
  auto& a = c.algorithm;
  integer("algorithm.prompts_per_step", a.prompts_per_step);
  integer("algorithm.samples_per_prompt", a.samples_per_prompt);
  real("algorithm.temperature", a.temperature);
  real("algorithm.top_p", a.top_p);
  integer("algorithm.top_k", a.top_k);
  integer("algorithm.max_new_tokens", a.max_new_tokens);
  boolean("algorithm.normalize_std", a.normalize_std);
  boolean("algorithm.filter_zero_variance", a.filter_zero_variance);
  integer("algorithm.staleness", a.staleness);
  real("algorithm.lr", a.lr);
  real("algorithm.weight_decay", a.weight_decay);
  real("algorithm.grad_clip", a.grad_clip);
  text("algorithm.lr_schedule", a.lr_schedule);
  integer("algorithm.warmup_steps", a.warmup_steps);
  real("algorithm.clip_low", a.clip_low);
  real("algorithm.clip_high", a.clip_high);
  real("algorithm.kl_coef", a.kl_coef);
  text("algorithm.kl_estimator", a.kl_estimator);
  text("algorithm.aggregation", a.aggregation);
  real("algorithm.tis_cap", a.tis_cap);
  real("algorithm.entropy_coef", a.entropy_coef);
  integer("algorithm.max_tokens_per_microbatch", a.max_tokens_per_microbatch);
  boolean("algorithm.routing_replay", a.routing_replay);
  boolean("algorithm.recompute_old_logprobs", a.recompute_old_logprobs);
  integer("algorithm.update_delay_ms", a.update_delay_ms);
  text("rollout.backend", c.rollout.backend);
  integer("rollout.cache_blocks", c.rollout.cache_blocks);
  integer("rollout.block_size", c.rollout.block_size);
  integer("rollout.max_batch", c.rollout.max_batch);
  integer("rollout.step_delay_ms", c.rollout.step_delay_ms);
  real("weight_sync.bucket_mib", c.weight_sync.bucket_mib);
  text("placement.mode", c.placement.mode);
  integer("placement.rollout_engines", c.placement.rollout_engines);
  text("placement.reference", c.placement.reference);
  text("placement.trainer", c.placement.trainer);
  boolean("logging.progress", c.logging.progress);
  boolean("logging.plot", c.logging.plot);
  return f;
}

void apply_table(ExperimentConfig& c, const toml::table& root, const std::string& where) {
  auto f = fields(c);
  for (auto&& [section, node] : root) {
    std::string s(section.str());
    if (!node.is_table()) bad(where, s, "must be a [section] (keys live in run, model, task, algorithm, rollout, weight_sync, placement, logging)");
    for (auto&& [key, value] : *node.as_table()) {
      std::string full = s + "." + std::string(key.str());
      auto it = f.find(full);
      if (it == f.end()) bad(where, full, "is not an experiment key (see docs/experiments.md)");
      it->second.set(value, where);
    }
  }
}
}  // namespace

ExperimentConfig ExperimentConfig::from_file(const std::string& path) {
  ExperimentConfig c;
  toml::table t;
  try {
    t = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    throw std::invalid_argument("experiment file '" + path + "' line " + std::to_string(e.source().begin.line) + ": " +
                                std::string(e.description()));
  }
  apply_table(c, t, "experiment file '" + path + "'");
  return c;
}

void ExperimentConfig::set(const std::string& assignment) {
  auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) throw std::invalid_argument("--set '" + assignment + "': expected section.key=value");
  std::string key = assignment.substr(0, eq), value = assignment.substr(eq + 1);
  auto dot = key.find('.');
  if (dot == std::string::npos) throw std::invalid_argument("--set '" + assignment + "': key must be section.key");
  toml::table v;
  try {
    v = toml::parse("v = " + value);
  } catch (const toml::parse_error&) {
    try {  // bare text: read as a quoted string, which also refuses bytes that are not UTF-8
      v = toml::parse("v = " + quoted(value));
    } catch (const toml::parse_error& e) {
      throw std::invalid_argument("--set '" + key + "': the value is not valid TOML, nor text in UTF-8 (" +
                                  std::string(e.description()) + ")");
    }
  }
  toml::table root{{key.substr(0, dot), toml::table{{key.substr(dot + 1), *v["v"].node()}}}};
  apply_table(*this, root, "--set " + key);
}

void ExperimentConfig::validate() const {
  auto need = [](bool ok, const std::string& key, const std::string& why) {
    if (!ok) throw std::invalid_argument("experiment: key '" + key + "' " + why);
  };
  need(run.steps >= 1, "run.steps", "must be >= 1");
  need(!run.output_dir.empty(), "run.output_dir", "must not be empty");
  need(run.checkpoint_every >= 0, "run.checkpoint_every", "must be >= 0");
  need(algorithm.prompts_per_step >= 1, "algorithm.prompts_per_step", "must be >= 1");
  need(algorithm.samples_per_prompt >= 2, "algorithm.samples_per_prompt", "must be >= 2 (GRPO compares samples of one prompt)");
  need(algorithm.max_new_tokens >= 1, "algorithm.max_new_tokens", "must be >= 1");
  need(algorithm.temperature > 0, "algorithm.temperature", "must be > 0 for RL sampling");
  need(algorithm.staleness >= 0, "algorithm.staleness", "must be >= 0");
  need(algorithm.update_delay_ms >= 0, "algorithm.update_delay_ms", "must be >= 0");
  need(rollout.step_delay_ms >= 0, "rollout.step_delay_ms", "must be >= 0");
  need(algorithm.lr > 0, "algorithm.lr", "must be > 0");
  need(algorithm.top_p > 0 && algorithm.top_p <= 1, "algorithm.top_p", "must be in (0, 1]");
  need(algorithm.top_k >= 0, "algorithm.top_k", "must be >= 0 (0: off)");
  need(algorithm.weight_decay >= 0, "algorithm.weight_decay", "must be >= 0");
  need(algorithm.grad_clip >= 0, "algorithm.grad_clip", "must be >= 0 (0: no clipping)");
  need(algorithm.kl_coef >= 0, "algorithm.kl_coef", "must be >= 0");
  need(algorithm.entropy_coef >= 0, "algorithm.entropy_coef", "must be >= 0");
  need(algorithm.tis_cap > 0, "algorithm.tis_cap", "must be > 0");
  need(algorithm.warmup_steps >= 0, "algorithm.warmup_steps", "must be >= 0");
  need(algorithm.clip_low >= 0 && algorithm.clip_low < 1, "algorithm.clip_low", "must be in [0, 1)");
  need(algorithm.clip_high >= 0, "algorithm.clip_high", "must be >= 0");
  need(algorithm.max_tokens_per_microbatch >= 1, "algorithm.max_tokens_per_microbatch", "must be >= 1");
  need(rollout.cache_blocks >= 1 && rollout.block_size >= 1 && rollout.max_batch >= 1, "rollout.cache_blocks",
       "rollout.cache_blocks, block_size and max_batch must be >= 1");
  need(algorithm.kl_estimator == "k1" || algorithm.kl_estimator == "k2" || algorithm.kl_estimator == "k3",
       "algorithm.kl_estimator", "must be \"k1\", \"k2\" or \"k3\"");
  need(algorithm.aggregation == "token_mean" || algorithm.aggregation == "sequence_mean", "algorithm.aggregation",
       "must be \"token_mean\" or \"sequence_mean\"");
  need(rollout.backend == "engine", "rollout.backend", "must be \"engine\" (the in-process engine is the only backend so far)");
  need(placement.mode == "single_process" || placement.mode == "multi_process", "placement.mode",
       "must be \"single_process\" or \"multi_process\" (rollout engine in a kiln node child process)");
  need(model.device == "cpu" || model.device == "cuda" || (model.device.rfind("cuda:", 0) == 0 && model.device.size() > 5 &&
       model.device.find_first_not_of("0123456789", 5) == std::string::npos),
       "model.device", "must be \"cpu\", \"cuda\" or \"cuda:N\"");
  need(model.dtype == "fp32" || model.dtype == "bf16", "model.dtype", "must be \"fp32\" or \"bf16\"");
  need(placement.mode == "single_process" || model.device == "cpu", "model.device",
       "must be \"cpu\" with placement.mode \"multi_process\" (remote engines run on the CPU so far)");
  need(placement.reference == "controller" || placement.reference == "process", "placement.reference",
       "must be \"controller\" or \"process\"");
  need(placement.reference == "controller" || placement.mode == "multi_process", "placement.reference",
       "must be \"controller\" with placement.mode \"single_process\"");
  need(placement.trainer == "controller" || placement.trainer == "process", "placement.trainer",
       "must be \"controller\" or \"process\"");
  need(placement.trainer == "controller" || (placement.mode == "multi_process" && placement.reference == "process"),
       "placement.trainer", "\"process\" needs placement.mode \"multi_process\" and placement.reference \"process\" "
       "(the controller then holds no model)");
  need(placement.rollout_engines >= 1 && placement.rollout_engines <= 64, "placement.rollout_engines", "must be in [1, 64]");
  need(placement.rollout_engines == 1 || placement.mode == "multi_process", "placement.rollout_engines",
       "must be 1 with placement.mode \"single_process\" (several engines run as kiln node processes)");
  need(placement.rollout_engines <= algorithm.prompts_per_step, "placement.rollout_engines",
       "must be <= algorithm.prompts_per_step (each engine gets whole prompt groups)");
  need(weight_sync.bucket_mib > 0, "weight_sync.bucket_mib", "must be > 0");
  need(task.name == "next_digit" || task.name == "arithmetic" || task.name == "countdown", "task.name",
       "must be \"next_digit\", \"arithmetic\" or \"countdown\"");
}

std::string ExperimentConfig::to_toml() const {
  auto copy = *this;
  auto f = fields(copy);
  std::string out, section;
  for (const auto& [key, field] : f) {
    auto dot = key.find('.');
    auto s = key.substr(0, dot);
    if (s != section) {
      out += (out.empty() ? "" : "\n") + std::string("[") + s + "]\n";
      section = s;
    }
    out += key.substr(dot + 1) + " = " + field.show() + "\n";
  }
  return out;
}

}  // namespace kiln::experiments

#include "experiments/experiment.hpp"
#include "actors/shown_value.hpp"

#include <charconv>
#include <cmath>
#include <cstdio>

#include <filesystem>
#include <functional>
#include <map>
#include <sstream>
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
std::string toml_quoted(const std::string& text) {
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

// A wrong-typed value as the error shows it: a string quoted, a number or boolean as written,
// a table or array by kind (not its whole text).
std::string got(const toml::node& n) {
  if (n.is_table()) return "a table";
  if (n.is_array()) return "an array";
  if (n.is_string()) return toml_quoted(n.as_string()->get());
  std::ostringstream os;
  n.visit([&](const auto& v) {
    if constexpr (!toml::is_table<decltype(v)> && !toml::is_array<decltype(v)>) os << v;
  });
  return os.str();
}

// Text of an integer outside int64 (TOML cannot hold it, so --set reads it as text).
bool integer_text_out_of_range(const toml::node& n) {
  if (!n.is_string()) return false;
  const auto& t = n.as_string()->get();
  const char* first = t.data() + (!t.empty() && t[0] == '+' ? 1 : 0);
  int64_t v = 0;
  const auto r = std::from_chars(first, t.data() + t.size(), v);
  return r.ec == std::errc::result_out_of_range && r.ptr == t.data() + t.size();
}

std::map<std::string, Field> fields(ExperimentConfig& c) {
  std::map<std::string, Field> f;
  auto integer = [&](const std::string& key, int64_t& ref) {
    f[key] = {[&ref, key](const toml::node& n, const std::string& w) {
                if (integer_text_out_of_range(n)) bad(w, key, "must be an integer in [-2^63, 2^63), got " + n.as_string()->get());
                if (!n.is_integer()) bad(w, key, "must be an integer, got " + got(n));
                ref = n.as_integer()->get();
              },
              [&ref] { return std::to_string(ref); }};
  };
  auto real = [&](const std::string& key, double& ref) {
    f[key] = {[&ref, key](const toml::node& n, const std::string& w) {
                double v = 0;  // the key keeps its value when this one is refused
                if (n.is_integer()) v = double(n.as_integer()->get());
                else if (n.is_floating_point()) v = n.as_floating_point()->get();
                else bad(w, key, "must be a number, got " + got(n));
                if (!std::isfinite(v)) bad(w, key, "must be a finite number, got " + got(n));
                ref = v;
              },
              [&ref] {
                const auto t = shown(ref);  // shortest text that reads back to the same double
                return t.find_first_of(".e") == std::string::npos ? t + ".0" : t;  // a TOML float
              }};
  };
  auto boolean = [&](const std::string& key, bool& ref) {
    f[key] = {[&ref, key](const toml::node& n, const std::string& w) {
                if (!n.is_boolean()) bad(w, key, "must be true or false, got " + got(n));
                ref = n.as_boolean()->get();
              },
              [&ref] { return std::string(ref ? "true" : "false"); }};
  };
  auto text = [&](const std::string& key, std::string& ref) {
    f[key] = {[&ref, key](const toml::node& n, const std::string& w) {
                if (!n.is_string()) bad(w, key, "must be a string, got " + got(n));
                ref = n.as_string()->get();
              },
              [&ref] { return toml_quoted(ref); }};
  };
  auto text_list = [&](const std::string& key, std::vector<std::string>& ref) {
    f[key] = {[&ref, key](const toml::node& n, const std::string& w) {
                if (n.is_string()) {  // one item; "" none (the text form of an empty list in earlier files)
                  const auto& one = n.as_string()->get();
                  ref = one.empty() ? std::vector<std::string>{} : std::vector<std::string>{one};
                  return;
                }
                if (!n.is_array()) bad(w, key, "must be a string or a list of strings, e.g. \"a\" or [\"a\", \"b\"]");
                std::vector<std::string> v;
                for (const auto& x : *n.as_array()) {
                  if (!x.is_string()) bad(w, key, "must be a string or a list of strings, e.g. \"a\" or [\"a\", \"b\"]");
                  v.push_back(x.as_string()->get());
                }
                ref = std::move(v);
              },
              [&ref] {
                std::string out = "[";
                for (std::size_t i = 0; i < ref.size(); ++i) out += (i ? ", " : "") + toml_quoted(ref[i]);
                return out + "]";
              }};
  };
  text("run.name", c.run.name);
  text("run.output_dir", c.run.output_dir);
  integer("run.seed", c.run.seed);
  integer("run.steps", c.run.steps);
  integer("run.checkpoint_every", c.run.checkpoint_every);
  text("run.resume_from", c.run.resume_from);
  boolean("run.overwrite", c.run.overwrite);
  text("model.package", c.model.package);
  text("model.flavor", c.model.flavor);
  text("model.checkpoint", c.model.checkpoint);
  text("model.device", c.model.device);
  text("model.dtype", c.model.dtype);
  text("task.name", c.task.name);
  integer("task.min_digits", c.task.min_digits);
  integer("task.max_digits", c.task.max_digits);
  text("task.operators", c.task.operators);
  text("task.path", c.task.path);
  text("task.prompt_field", c.task.prompt_field);
  text("task.answer_field", c.task.answer_field);
  text("task.tokenizer", c.task.tokenizer);
  text("task.chat_template", c.task.chat_template);
  auto& a = c.algorithm;
  integer("algorithm.prompts_per_step", a.prompts_per_step);
  integer("algorithm.samples_per_prompt", a.samples_per_prompt);
  real("algorithm.top_p", a.top_p);
  integer("algorithm.top_k", a.top_k);
  integer("algorithm.max_new_tokens", a.max_new_tokens);
  boolean("algorithm.normalize_std", a.normalize_std);
  boolean("algorithm.filter_zero_variance", a.filter_zero_variance);
  integer("algorithm.staleness", a.staleness);
  integer("algorithm.update_delay_ms", a.update_delay_ms);
  integer("algorithm.max_nonfinite_steps", a.max_nonfinite_steps);
  // The trainer's settings (trainer::TrainerConfig) share the [algorithm] section.
  auto& t = c.trainer;
  real("algorithm.temperature", t.logprobs.temperature);
  integer("algorithm.max_tokens_per_microbatch", t.logprobs.max_tokens_per_microbatch);
  boolean("algorithm.routing_replay", t.logprobs.routing_replay);
  boolean("algorithm.true_on_policy", t.logprobs.true_on_policy);
  real("algorithm.lr", t.lr);
  real("algorithm.weight_decay", t.weight_decay);
  real("algorithm.grad_clip", t.grad_clip);
  text("algorithm.lr_schedule", t.lr_schedule);
  integer("algorithm.warmup_steps", t.warmup_steps);
  boolean("algorithm.recompute_old_logprobs", t.recompute_old_logprobs);
  boolean("algorithm.activation_checkpointing", t.activation_checkpointing);
  integer("algorithm.activation_checkpointing_layers", t.activation_checkpointing_layers);
  real("algorithm.keep_logits_gib", t.keep_logits_gib);
  boolean("algorithm.train_indexer", t.train_indexer);
  real("algorithm.mtp_loss_weight", t.mtp_loss_weight);
  integer("algorithm.mtp_depths", t.mtp_depths);
  real("algorithm.clip_low", t.loss.clip_low);
  real("algorithm.clip_high", t.loss.clip_high);
  real("algorithm.kl_coef", t.loss.kl_coef);
  text("algorithm.kl_estimator", t.loss.kl_estimator);
  text("algorithm.aggregation", t.loss.aggregation);
  real("algorithm.tis_cap", t.loss.tis_cap);
  real("algorithm.entropy_coef", t.loss.entropy_coef);
  text("rollout.backend", c.rollout.backend);
  integer("rollout.cache_blocks", c.rollout.engine.cache_blocks);
  integer("rollout.block_size", c.rollout.engine.block_size);
  integer("rollout.max_batch", c.rollout.engine.max_batch);
  integer("rollout.step_delay_ms", c.rollout.engine.step_delay_ms);
  boolean("rollout.absorbed_decode", c.rollout.engine.absorbed_decode);
  boolean("rollout.cuda_graphs", c.rollout.engine.cuda_graphs);
  boolean("rollout.mla_decode_kernel", c.rollout.engine.mla_decode_kernel);
  boolean("rollout.sampling_kernel", c.rollout.engine.sampling_kernel);
  boolean("rollout.moe_decode_kernel", c.rollout.engine.moe_decode_kernel);
  boolean("rollout.overlap_schedule", c.rollout.engine.overlap_schedule);
  boolean("rollout.share_prompts", c.rollout.engine.share_prompts);
  text_list("rollout.urls", c.rollout.urls);
  integer("rollout.http_timeout_s", c.rollout.http_timeout_s);
  integer("rollout.http_retry_s", c.rollout.http_retry_s);
  text("rollout.weights_dir", c.rollout.weights_dir);
  text("rollout.weight_update", c.rollout.weight_update);
  text("rollout.weight_update_address", c.rollout.weight_update_address);
  integer("rollout.weight_update_timeout_s", c.rollout.weight_update_timeout_s);
  real("weight_sync.bucket_mib", c.weight_sync.bucket_mib);
  text("weight_sync.transport", c.weight_sync.transport);
  text("placement.mode", c.placement.mode);
  integer("placement.rollout_engines", c.placement.rollout_engines);
  integer("placement.engine_restarts", c.placement.engine_restarts);
  text("placement.reference", c.placement.reference);
  text("placement.trainer", c.placement.trainer);
  text_list("placement.rollout_device", c.placement.rollout_device);
  text("placement.reference_device", c.placement.reference_device);
  integer("parallel.dp", c.parallel.dp);
  integer("parallel.ep", c.parallel.ep);
  boolean("parallel.fsdp", t.fsdp);
  boolean("parallel.reshard_after_forward", t.reshard_after_forward);
  text("parallel.reduce_dtype", t.reduce_dtype);
  integer("parallel.master_port", c.parallel.master_port);
  integer("parallel.store_timeout_s", c.parallel.store_timeout_s);
  integer("parallel.collective_timeout_s", c.parallel.collective_timeout_s);
  boolean("logging.progress", c.logging.progress);
  boolean("logging.plot", c.logging.plot);
  return f;
}

void apply_table(ExperimentConfig& c, const toml::table& root, const std::string& where) {
  auto f = fields(c);
  for (auto&& [section, node] : root) {
    std::string s(section.str());
    if (!node.is_table()) bad(where, s, "must be a [section] (keys live in run, model, task, algorithm, rollout, weight_sync, placement, parallel, logging)");
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
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw std::invalid_argument("experiment file '" + path + "' " +
                                (std::filesystem::is_directory(path, ec) ? "is a directory (give a .toml file)"
                                 : std::filesystem::exists(path, ec)     ? "is not a regular file (give a .toml file)"
                                                                         : "does not exist"));
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
  } catch (const toml::parse_error& e) {
    const auto first = value.find_first_not_of(" \t");
    const char c = first == std::string::npos ? ' ' : value[first];
    if (c == '[' || c == '{' || c == '"' || c == '\'')  // a list, table or string cut short, not bare text
      throw std::invalid_argument("--set '" + key + "': '" + value + "' starts as a TOML " +
                                  (c == '[' ? "array" : c == '{' ? "inline table" : "string") + " but does not parse (" +
                                  std::string(e.description()) + ")" +
                                  (c == '[' || c == '{' ? "; to give text that starts so, quote it (\"...\")" : ""));
    try {  // bare text: read as a quoted string, which also refuses bytes that are not UTF-8
      v = toml::parse("v = " + toml_quoted(value));
    } catch (const toml::parse_error& e) {
      throw std::invalid_argument("--set '" + key + "': the value is not valid TOML, nor text in UTF-8 (" +
                                  std::string(e.description()) + ")");
    }
  }
  toml::table root{{key.substr(0, dot), toml::table{{key.substr(dot + 1), *v["v"].node()}}}};
  apply_table(*this, root, "--set " + key);
}

std::string ExperimentConfig::to_toml() const {
  auto copy = *this;
  auto f = fields(copy);
  std::string out, section;
  for (const auto& [key, field] : f) {
    auto dot = key.find('.');
    auto s = key.substr(0, dot);
    if (s != section) {
      if (!out.empty()) out += '\n';
      out.append("[").append(s).append("]\n");
      section = s;
    }
    out += key.substr(dot + 1) + " = " + field.show() + "\n";
  }
  return out;
}

}  // namespace kiln::experiments

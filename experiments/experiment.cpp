#include "experiments/experiment.hpp"
#include "actors/shown_value.hpp"

#include <algorithm>
#include <cctype>
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
  throw std::invalid_argument(printable(where) + ": key '" + printable(key) + "' " + printable(why));
}

// A character of a bare TOML key: A-Z a-z 0-9 _ -.
bool bare_key_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-'; }

// Whether a line opens as a TOML key-value pair, its key bare, quoted or dotted: "algorithm.lr = 5",
// "run . seed=1", "\"run\".seed = 1". A line without '=' after such a key (a path's, a command's)
// does not.
bool looks_like_toml_key(const std::string& line) {
  size_t i = 0;
  auto spaces = [&] { while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i; };
  for (;;) {
    spaces();
    const size_t start = i;
    if (i < line.size() && (line[i] == '"' || line[i] == '\'')) {  // a quoted part: "run".seed, 'run'.seed
      const char q = line[i];
      for (++i; i < line.size() && line[i] != q; ++i)
        if (q == '"' && line[i] == '\\') ++i;  // an escape in a basic string
      if (i >= line.size()) return false;
      ++i;
    } else {
      while (i < line.size() && bare_key_char(line[i])) ++i;
    }
    if (i == start) return false;
    spaces();
    if (i < line.size() && line[i] == '.') {
      ++i;
      continue;
    }
    return i < line.size() && line[i] == '=';
  }
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
  if (n.is_string()) return "\"" + n.as_string()->get() + "\"";  // bad() shows it printable
  std::ostringstream os;
  n.visit([&](const auto& v) {
    if constexpr (!toml::is_table<decltype(v)> && !toml::is_array<decltype(v)>) os << v;
  });
  return os.str();
}

// A NUL ("\u0000" in TOML) would cut a path, a name or a message short where the text reaches C
// (a run directory "/tmp/a" made for "/tmp/a\u0000b").
void no_nul(const std::string& text, const std::string& where, const std::string& key) {
  if (text.find('\0') != std::string::npos) bad(where, key, "must not hold U+0000 (NUL), got \"" + text + "\"");
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

// An experiment key's reader (TOML value -> field, refusing by key) and writer (field -> TOML
// text), by the field's type.
Field field(const std::string& key, int64_t& ref) {
  return {[&ref, key](const toml::node& n, const std::string& w) {
            if (integer_text_out_of_range(n)) bad(w, key, "must be an integer in [-2^63, 2^63), got " + n.as_string()->get());
            if (!n.is_integer()) bad(w, key, "must be an integer, got " + got(n));
            ref = n.as_integer()->get();
          },
          [&ref] { return std::to_string(ref); }};
}

Field field(const std::string& key, double& ref) {
  return {[&ref, key](const toml::node& n, const std::string& w) {
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
}

Field field(const std::string& key, bool& ref) {
  return {[&ref, key](const toml::node& n, const std::string& w) {
            if (!n.is_boolean()) bad(w, key, "must be true or false, got " + got(n));
            ref = n.as_boolean()->get();
          },
          [&ref] { return std::string(ref ? "true" : "false"); }};
}

Field field(const std::string& key, std::string& ref) {
  return {[&ref, key](const toml::node& n, const std::string& w) {
            if (!n.is_string()) bad(w, key, "must be a string, got " + got(n));
            no_nul(n.as_string()->get(), w, key);
            ref = n.as_string()->get();
          },
          [&ref] { return toml_quoted(ref); }};
}

Field field(const std::string& key, std::vector<std::string>& ref) {
  return {[&ref, key](const toml::node& n, const std::string& w) {
            if (n.is_string()) {  // one item; "" none (the text form of an empty list in earlier files)
              const auto& one = n.as_string()->get();
              no_nul(one, w, key);
              ref = one.empty() ? std::vector<std::string>{} : std::vector<std::string>{one};
              return;
            }
            if (!n.is_array()) bad(w, key, "must be a string or a list of strings, e.g. \"a\" or [\"a\", \"b\"]");
            std::vector<std::string> v;
            for (const auto& x : *n.as_array()) {
              if (!x.is_string()) bad(w, key, "must be a string or a list of strings, e.g. \"a\" or [\"a\", \"b\"]");
              no_nul(x.as_string()->get(), w, key);
              v.push_back(x.as_string()->get());
            }
            ref = std::move(v);
          },
          [&ref] {
            std::string out = "[";
            for (std::size_t i = 0; i < ref.size(); ++i) out += (i ? ", " : "") + toml_quoted(ref[i]);
            return out + "]";
          }};
}

template <typename T>
void add(std::map<std::string, Field>& f, const std::string& key, T& ref) {
  f[key] = field(key, ref);
}

// [run], [model], [task].
void add_run_model_task_keys(std::map<std::string, Field>& f, ExperimentConfig& c) {
  add(f, "run.name", c.run.name);
  add(f, "run.output_dir", c.run.output_dir);
  add(f, "run.seed", c.run.seed);
  add(f, "run.steps", c.run.steps);
  add(f, "run.checkpoint_every", c.run.checkpoint_every);
  add(f, "run.resume_from", c.run.resume_from);
  add(f, "run.overwrite", c.run.overwrite);
  add(f, "model.package", c.model.package);
  add(f, "model.flavor", c.model.flavor);
  add(f, "model.checkpoint", c.model.checkpoint);
  add(f, "model.device", c.model.device);
  add(f, "model.dtype", c.model.dtype);
  add(f, "task.name", c.task.name);
  add(f, "task.min_digits", c.task.min_digits);
  add(f, "task.max_digits", c.task.max_digits);
  add(f, "task.operators", c.task.operators);
  add(f, "task.path", c.task.path);
  add(f, "task.prompt_field", c.task.prompt_field);
  add(f, "task.answer_field", c.task.answer_field);
  add(f, "task.tokenizer", c.task.tokenizer);
  add(f, "task.chat_template", c.task.chat_template);
}

// [algorithm]: the controller's keys, then the trainer's (trainer::TrainerConfig shares the section).
void add_algorithm_keys(std::map<std::string, Field>& f, ExperimentConfig& c) {
  add(f, "algorithm.prompts_per_step", c.algorithm.prompts_per_step);
  add(f, "algorithm.samples_per_prompt", c.algorithm.samples_per_prompt);
  add(f, "algorithm.top_p", c.algorithm.top_p);
  add(f, "algorithm.top_k", c.algorithm.top_k);
  add(f, "algorithm.max_new_tokens", c.algorithm.max_new_tokens);
  add(f, "algorithm.normalize_std", c.algorithm.normalize_std);
  add(f, "algorithm.filter_zero_variance", c.algorithm.filter_zero_variance);
  add(f, "algorithm.staleness", c.algorithm.staleness);
  add(f, "algorithm.update_delay_ms", c.algorithm.update_delay_ms);
  add(f, "algorithm.max_nonfinite_steps", c.algorithm.max_nonfinite_steps);
  add(f, "algorithm.temperature", c.trainer.logprobs.temperature);
  add(f, "algorithm.max_tokens_per_microbatch", c.trainer.logprobs.max_tokens_per_microbatch);
  add(f, "algorithm.routing_replay", c.trainer.logprobs.routing_replay);
  add(f, "algorithm.true_on_policy", c.trainer.logprobs.true_on_policy);
  add(f, "algorithm.lr", c.trainer.lr);
  add(f, "algorithm.weight_decay", c.trainer.weight_decay);
  add(f, "algorithm.grad_clip", c.trainer.grad_clip);
  add(f, "algorithm.lr_schedule", c.trainer.lr_schedule);
  add(f, "algorithm.warmup_steps", c.trainer.warmup_steps);
  add(f, "algorithm.recompute_old_logprobs", c.trainer.recompute_old_logprobs);
  add(f, "algorithm.activation_checkpointing", c.trainer.activation_checkpointing);
  add(f, "algorithm.activation_checkpointing_layers", c.trainer.activation_checkpointing_layers);
  add(f, "algorithm.keep_logits_gib", c.trainer.keep_logits_gib);
  add(f, "algorithm.train_indexer", c.trainer.train_indexer);
  add(f, "algorithm.mtp_loss_weight", c.trainer.mtp_loss_weight);
  add(f, "algorithm.mtp_depths", c.trainer.mtp_depths);
  add(f, "algorithm.clip_low", c.trainer.loss.clip_low);
  add(f, "algorithm.clip_high", c.trainer.loss.clip_high);
  add(f, "algorithm.kl_coef", c.trainer.loss.kl_coef);
  add(f, "algorithm.kl_estimator", c.trainer.loss.kl_estimator);
  add(f, "algorithm.aggregation", c.trainer.loss.aggregation);
  add(f, "algorithm.tis_cap", c.trainer.loss.tis_cap);
  add(f, "algorithm.entropy_coef", c.trainer.loss.entropy_coef);
}

// [rollout], [weight_sync].
void add_rollout_and_sync_keys(std::map<std::string, Field>& f, ExperimentConfig& c) {
  add(f, "rollout.backend", c.rollout.backend);
  add(f, "rollout.cache_blocks", c.rollout.engine.cache_blocks);
  add(f, "rollout.block_size", c.rollout.engine.block_size);
  add(f, "rollout.max_batch", c.rollout.engine.max_batch);
  add(f, "rollout.step_delay_ms", c.rollout.engine.step_delay_ms);
  add(f, "rollout.absorbed_decode", c.rollout.engine.absorbed_decode);
  add(f, "rollout.cuda_graphs", c.rollout.engine.cuda_graphs);
  add(f, "rollout.mla_decode_kernel", c.rollout.engine.mla_decode_kernel);
  add(f, "rollout.sampling_kernel", c.rollout.engine.sampling_kernel);
  add(f, "rollout.moe_decode_kernel", c.rollout.engine.moe_decode_kernel);
  add(f, "rollout.overlap_schedule", c.rollout.engine.overlap_schedule);
  add(f, "rollout.share_prompts", c.rollout.engine.share_prompts);
  add(f, "rollout.urls", c.rollout.urls);
  add(f, "rollout.http_timeout_s", c.rollout.http_timeout_s);
  add(f, "rollout.http_retry_s", c.rollout.http_retry_s);
  add(f, "rollout.weights_dir", c.rollout.weights_dir);
  add(f, "rollout.weight_update", c.rollout.weight_update);
  add(f, "rollout.weight_update_address", c.rollout.weight_update_address);
  add(f, "rollout.weight_update_timeout_s", c.rollout.weight_update_timeout_s);
  add(f, "weight_sync.bucket_mib", c.weight_sync.bucket_mib);
  add(f, "weight_sync.transport", c.weight_sync.transport);
}

// [placement], [parallel] (fsdp, reshard and the reduction dtype are the trainer's), [logging].
void add_placement_parallel_logging_keys(std::map<std::string, Field>& f, ExperimentConfig& c) {
  add(f, "placement.mode", c.placement.mode);
  add(f, "placement.rollout_engines", c.placement.rollout_engines);
  add(f, "placement.engine_restarts", c.placement.engine_restarts);
  add(f, "placement.reference", c.placement.reference);
  add(f, "placement.trainer", c.placement.trainer);
  add(f, "placement.rollout_device", c.placement.rollout_device);
  add(f, "placement.reference_device", c.placement.reference_device);
  add(f, "parallel.dp", c.parallel.dp);
  add(f, "parallel.ep", c.parallel.ep);
  add(f, "parallel.fsdp", c.trainer.fsdp);
  add(f, "parallel.reshard_after_forward", c.trainer.reshard_after_forward);
  add(f, "parallel.reduce_dtype", c.trainer.reduce_dtype);
  add(f, "parallel.master_port", c.parallel.master_port);
  add(f, "parallel.store_timeout_s", c.parallel.store_timeout_s);
  add(f, "parallel.collective_timeout_s", c.parallel.collective_timeout_s);
  add(f, "logging.progress", c.logging.progress);
  add(f, "logging.plot", c.logging.plot);
}

std::map<std::string, Field> fields(ExperimentConfig& c) {
  std::map<std::string, Field> f;
  add_run_model_task_keys(f, c);
  add_algorithm_keys(f, c);
  add_rollout_and_sync_keys(f, c);
  add_placement_parallel_logging_keys(f, c);
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
  // Spaces, tabs and line ends around the key and the value are not theirs, as in a TOML file
  // ("run.steps = 2", a script's "\r\n"); inside quotes they stay.
  auto trimmed = [](const std::string& s) {
    const auto b = s.find_first_not_of(" \t\r\n"), e = s.find_last_not_of(" \t\r\n");
    return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
  };
  auto eq = assignment.find('=');
  std::string key = eq == std::string::npos ? std::string() : trimmed(assignment.substr(0, eq));
  if (key.empty()) {
    // "kiln run --set a=1 exp.toml": --set takes every value after it, the file among them.
    std::error_code ec;
    const bool file = eq == std::string::npos &&
                      (assignment.ends_with(".toml") || std::filesystem::is_regular_file(assignment, ec));
    throw std::invalid_argument("--set '" + printable(assignment) + "': expected section.key=value" +
                                (file ? " (an experiment file goes before --set: kiln run FILE --set KEY=VALUE)" : ""));
  }
  std::string value = trimmed(assignment.substr(eq + 1));
  auto dot = key.find('.');
  if (dot == std::string::npos) throw std::invalid_argument("--set '" + printable(assignment) + "': key must be section.key");
  if (value.empty())  // TOML has no empty value; bare text would have made it "" unasked
    throw std::invalid_argument("--set '" + printable(key) + "': no value after '=' (give one; for empty text write \"\")");
  // Parsed as the line name = value, so that the parser's messages name the key's own last part
  // (a value "1\n[name]" redefines it), not a stand-in; a name that is no bare TOML key (no
  // experiment key's is) as v, and refused by name below.
  const std::string name = key.substr(dot + 1);
  const bool bare = !name.empty() && std::all_of(name.begin(), name.end(), bare_key_char);
  const std::string slot = bare ? name : "v", line_key = slot + " = ";
  toml::table v;
  try {
    v = toml::parse(line_key + value);
  } catch (const toml::parse_error& e) {
    const auto first = value.find_first_not_of(" \t");
    const char c = first == std::string::npos ? ' ' : value[first];
    if (c == '[' || c == '{' || c == '"' || c == '\'')  // a list, table or string cut short, not bare text
      throw std::invalid_argument("--set '" + printable(key) + "': '" + printable(value) + "' starts as a TOML " +
                                  (c == '[' ? "array" : c == '{' ? "inline table" : "string") + " but does not parse (" +
                                  std::string(e.description()) + ")" +
                                  (c == '[' || c == '{' ? "; to give text that starts so, quote it (\"...\")" : ""));
    // Bare text may hold a line break (a path may), but a later line that reads as a TOML key
    // ("abc<LF>algorithm.lr = 5") is a second key, which would be dropped into the text.
    for (size_t b = value.find('\n'); b != std::string::npos; b = value.find('\n', b + 1)) {
      const auto line = trimmed(value.substr(b + 1, value.find('\n', b + 1) - b - 1));
      if (looks_like_toml_key(line))
        throw std::invalid_argument("--set '" + printable(key) + "': the value's line '" + printable(line) +
                                    "' reads as another key: give one key per --set (in quoted text write a line "
                                    "break as \\n)");
    }
    try {  // bare text: read as a quoted string, which also refuses bytes that are not UTF-8
      v = toml::parse(line_key + toml_quoted(value));
    } catch (const toml::parse_error& e) {
      throw std::invalid_argument("--set '" + printable(key) + "': the value is not valid TOML, nor text in UTF-8 (" +
                                  std::string(e.description()) + ")");
    }
  }
  // "1\nalgorithm.lr = 5" parses as two keys: the second was dropped without a word.
  if (v.size() != 1)
    throw std::invalid_argument("--set '" + printable(key) + "': the value holds more than one TOML key-value pair (a line break " +
                                "starts another: give one value; in quoted text write a line break as \\n)");
  toml::table root{{key.substr(0, dot), toml::table{{name, *v[slot].node()}}}};
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

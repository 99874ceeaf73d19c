#pragma once
// Experiment files (TOML) over the run configuration (actors/controller/config.hpp): every
// key has a default (the built-in default experiment), a file overrides some, `--set
// section.key=value` overrides any. Unknown sections or keys and values of the wrong type or
// range are rejected by name. docs/experiments.md lists every key.
#include <string>

#include "actors/controller/config.hpp"

namespace kiln::experiments {

/// The run configuration, read from and written as an experiment file.
struct ExperimentConfig : controller::Config {
  /// Reads a TOML file over the defaults. Throws std::invalid_argument naming the file and
  /// the key for unknown keys, wrong types, bad values, or TOML syntax errors (with line).
  static ExperimentConfig from_file(const std::string& path);
  /// Applies "section.key=value" (value in TOML syntax: 3, 0.5, true, "text" or bare text).
  void set(const std::string& assignment);
  /// Every key with its current value, TOML (written into the run directory).
  std::string to_toml() const;
};

}  // namespace kiln::experiments

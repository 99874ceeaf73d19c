#pragma once
// `kiln serve [EXPERIMENT] [--set key=value]`: the rollout engine of an experiment's [model]
// and [rollout] keys behind SGLang's native HTTP API (actors/rollout/http_server.hpp).
// docs/serving.md is the user's page.
#include <string>
#include <vector>

#include "actors/rollout/http_server.hpp"

namespace kiln::experiments {

struct ServeCommand {
  std::string experiment;               ///< experiment file; "": the built-in default
  std::vector<std::string> overrides;   ///< --set section.key=value
  rollout::ListenOptions listen;       ///< --host, --port, --port-file, --threads
};

/// Builds the model (model.checkpoint, else model.flavor seeded with run.seed as `kiln run`'s
/// initial policy is), its engine (rollout.cache_blocks, block_size, max_batch, ...), the
/// tokenizer of task.tokenizer (else the character tokenizer), and serves until SIGINT or
/// SIGTERM. Returns the exit code: 2 for a bad experiment or model (reported on stderr).
int run_serve(const ServeCommand& command);

}  // namespace kiln::experiments

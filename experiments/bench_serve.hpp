#pragma once
// `kiln bench serve`: requests/s and generated tokens/s of `kiln serve` (a child process on
// loopback, SGLang's /generate) at several numbers of concurrent clients, against the
// in-process engine driven with the same number of requests in flight, on the same prompts
// and seeds in the same run; every completion over HTTP is checked equal to the in-process one
// before speed is compared.
#include <cstdint>
#include <string>
#include <vector>

namespace kiln::experiments {

struct ServeBenchOptions {
  std::vector<int64_t> clients = {1, 16, 64};  ///< concurrent clients (requests in flight)
  int64_t requests = 128;                      ///< per measurement
  int64_t prompt_tokens = 16;
  int64_t new_tokens = 32;                     ///< generated per request (no stop token)
  std::string flavor = "debug";                ///< glm4_moe_lite flavor, CPU
};

/// Prints one table; returns 0, or 1 when a completion over HTTP differs or the server fails.
int run_serve_bench(const ServeBenchOptions& options);

}  // namespace kiln::experiments

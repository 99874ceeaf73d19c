#pragma once
// `kiln run` over several processes (parallel.dp > 1; docs/parallel.md): one process per
// rank, from one of three launches:
//   - none: `kiln run FILE` starts ranks 1..dp-1 itself (this program again, with torchrun's
//     variables RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1,
//     MASTER_PORT=parallel.master_port or a free port), each in a process group of its own and
//     stopped when this process dies;
//   - torchrun (`torchrun ... --no-python kiln run FILE`) or Slurm (`srun kiln run FILE`): every
//     rank is started by the launcher; its world size must equal parallel.dp.
// All ranks meet in a c10d TCPStore (parallel/process_group.hpp). Rank 0 runs the controller
// (actors/controller/loop.hpp) with the trainer's rank 0 (actors/controller/trainer_ranks.hpp);
// every other rank serves trainer/R (a TrainerService over the dp group) on a ZeroMQ endpoint it
// publishes in the store, until rank 0 says the run is over (store key run_over). A rank other
// than 0 ignores SIGINT: Ctrl-C reaches rank 0, which finishes the step and checkpoints with
// every rank before they all exit.
#include <string>
#include <vector>

#include "actors/controller/config.hpp"

namespace kiln::experiments {

/// Runs `config` as this process's rank (see above). `argv`: this program's command line, for
/// the ranks it starts itself. Returns the exit code: rank 0's run's (loop.hpp); a rank other
/// than 0 returns rank 0's too, or 1 when rank 0 is gone without saying so; 2 for a bad
/// configuration or launch (named on stderr), or a rendezvous that failed.
int run_ranks(const controller::Config& config, const std::string& config_toml, const std::vector<std::string>& argv);

}  // namespace kiln::experiments

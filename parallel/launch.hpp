#pragma once
// Where this process sits in a multi-process job, read from the launcher's environment:
// torchrun (RANK, WORLD_SIZE, ...), Slurm's srun (SLURM_PROCID, SLURM_NTASKS, ...) or nothing
// (one process, world 1). No LibTorch here, so that the torch-free sanitizer build tests it.
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::parallel {

/// Which launcher started this process (the environment it was read from).
enum class Launcher { single, torchrun, slurm };

/// "single", "torchrun" or "slurm".
const char* launcher_name(Launcher launcher);

/// One process's place in the job. Ranks count processes: one per GPU (or per CPU rank).
struct LaunchInfo {
  Launcher launcher = Launcher::single;
  int rank = 0;              ///< global rank, 0 <= rank < world_size
  int world_size = 1;        ///< processes in the job
  int local_rank = 0;        ///< rank on this node, 0 <= local_rank < local_world_size
  int local_world_size = 1;  ///< processes on this node (<= world_size)
  std::string master_addr = "127.0.0.1";  ///< host of the rendezvous TCPStore
  /// Port of the rendezvous TCPStore; 0 only for a single process (the store picks a free one).
  int master_port = 0;
  /// The torchrun agent already serves the TCPStore at master_addr:master_port, so every rank
  /// (rank 0 included) connects as a client (TORCHELASTIC_USE_AGENT_STORE=True).
  bool use_agent_store = false;
};

/// Looks a variable up: its value, or nullopt when it is not set.
using EnvLookup = std::function<std::optional<std::string>(std::string_view name)>;

/// The port used under Slurm when MASTER_PORT is not set (torchrun's default too).
inline constexpr int kDefaultSlurmMasterPort = 29500;

/// Reads the launch from `env`. torchrun when RANK is set; else Slurm when SLURM_PROCID is set;
/// else a single process. Variables read:
/// - torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (both absent: this node holds
///   every rank, LOCAL_RANK = RANK), MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE
///   (True/False, true/false, 1/0; absent = False).
/// - Slurm: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE or else
///   SLURM_TASKS_PER_NODE (compressed, "2(x3),1") at index SLURM_NODEID; master = MASTER_ADDR
///   if set, else the first host of SLURM_JOB_NODELIST (else SLURM_NODELIST); port =
///   MASTER_PORT if set, else kDefaultSlurmMasterPort.
/// - single: world 1, master 127.0.0.1 port 0; a WORLD_SIZE other than 1 or a LOCAL_RANK
///   other than 0 without RANK is refused (a launcher that forgot RANK).
/// Throws std::invalid_argument naming the variable and its value for a malformed number, a
/// missing variable, a rank outside its world, a local world larger than the world, a port
/// outside 1..65535 and a malformed node list.
LaunchInfo read_launch(const EnvLookup& env);

/// read_launch over this process's environment (getenv).
LaunchInfo read_launch_from_environment();

/// A TCP port on 127.0.0.1 that was free a moment ago (for a store this process serves next),
/// drawn at random from 15000 up to below the kernel's ephemeral range (ip_local_port_range):
/// a port from that range can be taken by any process's outgoing connection before the store
/// binds it. Falls back to the kernel's choice when the range below is narrower than 1000
/// ports or 200 draws are taken. Throws std::runtime_error when the system hands out none.
int free_loopback_port();

/// Expands a Slurm host list: "gpu[01-03,07],cpu5" -> gpu01 gpu02 gpu03 gpu07 cpu5. Keeps the
/// zero padding of each range; several bracket groups in one name multiply
/// ("r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2). `source` names the variable in errors. Throws
/// std::invalid_argument for an unbalanced or nested bracket, an empty name or range, a bound
/// that is not a number, a descending range, or more than 1,000,000 hosts.
std::vector<std::string> expand_slurm_nodelist(std::string_view nodelist, std::string_view source);

/// Expands Slurm's tasks-per-node list: "2(x3),1" -> 2 2 2 1. Throws std::invalid_argument
/// naming `source` and the value for anything else (a count < 1, a repeat < 1, a bad number).
std::vector<int> expand_slurm_tasks_per_node(std::string_view value, std::string_view source);

}  // namespace kiln::parallel

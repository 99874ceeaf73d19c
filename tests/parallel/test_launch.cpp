// The launcher's environment read into LaunchInfo: torchrun, Slurm (node list forms), a single
// process, and every malformed or inconsistent value refused by name.
#include "parallel/launch.hpp"

#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <set>
#include <stdexcept>

using namespace kiln::parallel;

namespace {

using Vars = std::map<std::string, std::string>;

LaunchInfo read(const Vars& vars) {
  return read_launch([&](std::string_view name) -> std::optional<std::string> {
    auto it = vars.find(std::string(name));
    return it == vars.end() ? std::nullopt : std::optional<std::string>(it->second);
  });
}

// The message read() throws for `vars`, which must be refused.
std::string refusal(const Vars& vars) {
  try {
    read(vars);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  FAIL("accepted an environment that must be refused");
  return "";
}

const Vars kTorchrun = {{"RANK", "5"},          {"WORLD_SIZE", "8"},        {"LOCAL_RANK", "1"},
                        {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29400"},
                        {"TORCHELASTIC_USE_AGENT_STORE", "True"}};

const Vars kSlurm = {{"SLURM_PROCID", "3"},         {"SLURM_NTASKS", "4"},
                     {"SLURM_LOCALID", "1"},        {"SLURM_NODEID", "1"},
                     {"SLURM_TASKS_PER_NODE", "2(x2)"}, {"SLURM_JOB_NODELIST", "gpu[07-08]"}};

Vars with(Vars vars, const std::string& name, const std::string& value) {
  vars[name] = value;
  return vars;
}

Vars without(Vars vars, const std::string& name) {
  vars.erase(name);
  return vars;
}

}  // namespace

TEST_CASE("launch: torchrun's variables give rank world local rank master and the agent store") {
  const auto info = read(kTorchrun);
  CHECK(info.launcher == Launcher::torchrun);
  CHECK(info.rank == 5);
  CHECK(info.world_size == 8);
  CHECK(info.local_rank == 1);
  CHECK(info.local_world_size == 4);
  CHECK(info.master_addr == "node0");
  CHECK(info.master_port == 29400);
  CHECK(info.use_agent_store);
  CHECK_FALSE(read(with(kTorchrun, "TORCHELASTIC_USE_AGENT_STORE", "False")).use_agent_store);
  CHECK_FALSE(read(without(kTorchrun, "TORCHELASTIC_USE_AGENT_STORE")).use_agent_store);
  // A hand launch with RANK and WORLD_SIZE only: every rank on this node.
  const auto hand = read(without(without(kTorchrun, "LOCAL_RANK"), "LOCAL_WORLD_SIZE"));
  CHECK(hand.local_rank == 5);
  CHECK(hand.local_world_size == 8);
}

TEST_CASE("launch: torchrun refuses each bad value by name") {
  CHECK(refusal(with(kTorchrun, "RANK", "x1")).find("RANK='x1' (torchrun environment) is not an integer") !=
        std::string::npos);
  CHECK(refusal(with(kTorchrun, "RANK", "8")).find("RANK=8 is not below WORLD_SIZE=8") != std::string::npos);
  CHECK(refusal(with(kTorchrun, "RANK", "-1")).find("RANK='-1'") != std::string::npos);
  CHECK(refusal(with(kTorchrun, "RANK", "+1")).find("RANK='+1'") != std::string::npos);
  CHECK(refusal(with(kTorchrun, "RANK", " 1")).find("RANK=' 1'") != std::string::npos);
  CHECK(refusal(with(kTorchrun, "RANK", "99999999999999999999")).find("is outside") != std::string::npos);
  CHECK(refusal(with(kTorchrun, "WORLD_SIZE", "0")).find("WORLD_SIZE='0' (torchrun environment) is outside") !=
        std::string::npos);
  CHECK(refusal(without(kTorchrun, "WORLD_SIZE")).find("WORLD_SIZE is not set (torchrun environment)") !=
        std::string::npos);
  CHECK(refusal(with(kTorchrun, "LOCAL_RANK", "4")).find("LOCAL_RANK=4 is not below LOCAL_WORLD_SIZE=4") !=
        std::string::npos);
  CHECK(refusal(with(kTorchrun, "LOCAL_WORLD_SIZE", "9")).find("LOCAL_WORLD_SIZE=9 is larger than WORLD_SIZE=8") !=
        std::string::npos);
  CHECK(refusal(with(with(kTorchrun, "RANK", "0"), "LOCAL_RANK", "1")).find("LOCAL_RANK=1 is larger than RANK=0") !=
        std::string::npos);
  CHECK(refusal(without(kTorchrun, "LOCAL_WORLD_SIZE")).find("LOCAL_RANK is set but LOCAL_WORLD_SIZE is not") !=
        std::string::npos);
  CHECK(refusal(without(kTorchrun, "MASTER_ADDR")).find("MASTER_ADDR is not set") != std::string::npos);
  CHECK(refusal(with(kTorchrun, "MASTER_ADDR", "")).find("MASTER_ADDR='' (torchrun environment) is empty") !=
        std::string::npos);
  CHECK(refusal(without(kTorchrun, "MASTER_PORT")).find("MASTER_PORT is not set") != std::string::npos);
  CHECK(refusal(with(kTorchrun, "MASTER_PORT", "65536")).find("MASTER_PORT='65536' (torchrun environment) is outside 1..65535") !=
        std::string::npos);
  CHECK(refusal(with(kTorchrun, "MASTER_PORT", "0")).find("MASTER_PORT='0'") != std::string::npos);
  CHECK(refusal(with(kTorchrun, "MASTER_PORT", "29500x")).find("MASTER_PORT='29500x'") != std::string::npos);
  CHECK(refusal(with(kTorchrun, "TORCHELASTIC_USE_AGENT_STORE", "yes"))
            .find("TORCHELASTIC_USE_AGENT_STORE='yes' (torchrun environment) is not True/False") != std::string::npos);
}

TEST_CASE("launch: Slurm's variables give ranks and the master from the first node of the list") {
  const auto info = read(kSlurm);
  CHECK(info.launcher == Launcher::slurm);
  CHECK(info.rank == 3);
  CHECK(info.world_size == 4);
  CHECK(info.local_rank == 1);
  CHECK(info.local_world_size == 2);
  CHECK(info.master_addr == "gpu07");
  CHECK(info.master_port == kDefaultSlurmMasterPort);
  CHECK_FALSE(info.use_agent_store);
  // SLURM_NTASKS_PER_NODE wins over the compressed list; MASTER_ADDR/PORT override the node list.
  const auto explicit_master =
      read(with(with(with(kSlurm, "SLURM_NTASKS_PER_NODE", "3"), "MASTER_ADDR", "10.0.0.1"), "MASTER_PORT", "12345"));
  CHECK(explicit_master.local_world_size == 3);
  CHECK(explicit_master.master_addr == "10.0.0.1");
  CHECK(explicit_master.master_port == 12345);
  // SLURM_NODELIST when SLURM_JOB_NODELIST is absent.
  CHECK(read(with(without(kSlurm, "SLURM_JOB_NODELIST"), "SLURM_NODELIST", "cpu5,gpu[01-02]")).master_addr == "cpu5");
  // The heterogeneous list "3,1": node 1 holds one task.
  const auto uneven = read(with(with(with(with(kSlurm, "SLURM_TASKS_PER_NODE", "3,1"), "SLURM_LOCALID", "0"),
                                     "SLURM_PROCID", "3"), "SLURM_NODEID", "1"));
  CHECK(uneven.local_world_size == 1);
  // torchrun inside a Slurm allocation: RANK wins.
  auto both = kTorchrun;
  both.insert(kSlurm.begin(), kSlurm.end());
  CHECK(read(both).launcher == Launcher::torchrun);
}

TEST_CASE("launch: Slurm refuses each bad value by name") {
  CHECK(refusal(with(kSlurm, "SLURM_PROCID", "4")).find("SLURM_PROCID=4 is not below SLURM_NTASKS=4 (slurm environment)") !=
        std::string::npos);
  CHECK(refusal(with(kSlurm, "SLURM_NTASKS", "four")).find("SLURM_NTASKS='four' (slurm environment) is not an integer") !=
        std::string::npos);
  CHECK(refusal(without(kSlurm, "SLURM_LOCALID")).find("SLURM_LOCALID is not set (slurm environment)") !=
        std::string::npos);
  CHECK(refusal(with(kSlurm, "SLURM_LOCALID", "2")).find("SLURM_LOCALID=2 is not below SLURM_TASKS_PER_NODE=2") !=
        std::string::npos);
  CHECK(refusal(with(with(kSlurm, "SLURM_NTASKS_PER_NODE", "5"), "SLURM_LOCALID", "0"))
            .find("SLURM_NTASKS_PER_NODE=5 is larger than SLURM_NTASKS=4") != std::string::npos);
  CHECK(refusal(with(kSlurm, "SLURM_NODEID", "2")).find("SLURM_NODEID=2 has no entry in SLURM_TASKS_PER_NODE='2(x2)'") !=
        std::string::npos);
  CHECK(refusal(without(kSlurm, "SLURM_NODEID")).find("SLURM_NODEID is not set") != std::string::npos);
  CHECK(refusal(with(kSlurm, "SLURM_TASKS_PER_NODE", "2(x2")).find("SLURM_TASKS_PER_NODE='2(x2'") != std::string::npos);
  CHECK(refusal(with(kSlurm, "SLURM_TASKS_PER_NODE", "0(x2)")).find("(count '0')") != std::string::npos);
  CHECK(refusal(with(kSlurm, "SLURM_TASKS_PER_NODE", "2(x0)")).find("(repeat '0')") != std::string::npos);
  CHECK(refusal(with(kSlurm, "SLURM_TASKS_PER_NODE", "2,,2")).find("has an empty entry") != std::string::npos);
  CHECK(refusal(without(kSlurm, "SLURM_JOB_NODELIST")).find("SLURM_NODELIST is not set (slurm environment)") !=
        std::string::npos);
  CHECK(refusal(with(kSlurm, "SLURM_JOB_NODELIST", "gpu[08-07]"))
            .find("SLURM_JOB_NODELIST='gpu[08-07]' has the descending range '08-07'") != std::string::npos);
  CHECK(refusal(with(kSlurm, "MASTER_PORT", "70000")).find("MASTER_PORT='70000' (slurm environment)") !=
        std::string::npos);
  CHECK(refusal(with(kSlurm, "MASTER_ADDR", "")).find("MASTER_ADDR='' (slurm environment) is empty") !=
        std::string::npos);
}

TEST_CASE("launch: Slurm node lists expand with zero padding ranges and several bracket groups") {
  using V = std::vector<std::string>;
  CHECK(expand_slurm_nodelist("gpu[01-03,07],cpu5", "X") == V{"gpu01", "gpu02", "gpu03", "gpu07", "cpu5"});
  CHECK(expand_slurm_nodelist("node7", "X") == V{"node7"});
  CHECK(expand_slurm_nodelist("a,b", "X") == V{"a", "b"});
  CHECK(expand_slurm_nodelist("n[9-11]", "X") == V{"n9", "n10", "n11"});
  CHECK(expand_slurm_nodelist("n[098-101]", "X") == V{"n098", "n099", "n100", "n101"});
  CHECK(expand_slurm_nodelist("r[1-2]n[1-2]-ib", "X") == V{"r1n1-ib", "r1n2-ib", "r2n1-ib", "r2n2-ib"});
  CHECK(expand_slurm_nodelist("x[3]", "X") == V{"x3"});
  CHECK(expand_slurm_tasks_per_node("2(x3),1", "X") == std::vector<int>{2, 2, 2, 1});
  CHECK(expand_slurm_tasks_per_node("8", "X") == std::vector<int>{8});
}

TEST_CASE("launch: a malformed node list is refused naming the variable and the fault") {
  const auto refused = [](const char* list) {
    try {
      expand_slurm_nodelist(list, "SLURM_JOB_NODELIST");
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  CHECK(refused("gpu[01-03") == "launch: SLURM_JOB_NODELIST='gpu[01-03' has a '[' without ']'");
  CHECK(refused("gpu01]") == "launch: SLURM_JOB_NODELIST='gpu01]' has a ']' without '['");
  CHECK(refused("gpu[0[1]]") == "launch: SLURM_JOB_NODELIST='gpu[0[1]]' has a nested '['");
  CHECK(refused("gpu[]") == "launch: SLURM_JOB_NODELIST='gpu[]' has an empty range");
  CHECK(refused("gpu[1,]") == "launch: SLURM_JOB_NODELIST='gpu[1,]' has an empty range");
  CHECK(refused("a,,b") == "launch: SLURM_JOB_NODELIST='a,,b' has an empty host name");
  CHECK(refused("") == "launch: SLURM_JOB_NODELIST='' has an empty host name");
  CHECK(refused("gpu[a-b]").find("(bound 'a') is not an integer") != std::string::npos);
  CHECK(refused("gpu[3-1]") == "launch: SLURM_JOB_NODELIST='gpu[3-1]' has the descending range '3-1'");
  CHECK(refused("gpu[0-99999999]") == "launch: SLURM_JOB_NODELIST='gpu[0-99999999]' names more than 1000000 hosts");
  CHECK(refused("a[0-999]b[0-9999]") == "launch: SLURM_JOB_NODELIST='a[0-999]b[0-9999]' names more than 1000000 hosts");
}

TEST_CASE("launch: a single process is world 1 and a WORLD_SIZE or LOCAL_RANK without RANK is refused") {
  const auto info = read({});
  CHECK(info.launcher == Launcher::single);
  CHECK(info.rank == 0);
  CHECK(info.world_size == 1);
  CHECK(info.local_rank == 0);
  CHECK(info.local_world_size == 1);
  CHECK(info.master_addr == "127.0.0.1");
  CHECK(info.master_port == 0);
  CHECK(read({{"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}}).world_size == 1);
  CHECK(refusal({{"WORLD_SIZE", "4"}}) ==
        "launch: WORLD_SIZE='4' (single-process environment) is set but RANK is not: set RANK too, or launch with torchrun");
  CHECK(refusal({{"LOCAL_RANK", "2"}}).find("LOCAL_RANK='2' (single-process environment) is set but RANK is not") !=
        std::string::npos);
}

TEST_CASE("launch: free_loopback_port gives distinct ports below the kernel's ephemeral range that a listener binds") {
  int ephemeral_low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> ephemeral_low;
  std::set<int> seen;
  for (int i = 0; i < 20; ++i) {
    const int port = free_loopback_port();
    if (ephemeral_low - 15000 >= 1000) {
      CHECK(port >= 15000);
      CHECK(port < ephemeral_low);
    }
    seen.insert(port);
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(fd >= 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    CHECK(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    CHECK(::listen(fd, 1) == 0);
    ::close(fd);
  }
  CHECK(seen.size() >= 15);  // random draws, not one port handed out again and again
}

#include "parallel/launch.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <charconv>
#include <fstream>
#include <random>
#include <cstdlib>
#include <stdexcept>

namespace kiln::parallel {

namespace {

constexpr std::size_t kMaxHosts = 1'000'000;

[[noreturn]] void refuse(const std::string& why) { throw std::invalid_argument("launch: " + why); }

std::string quoted(std::string_view s) {
  std::string out;  // appended, not "'" + text: gcc 12's -Wrestrict misreads that insert at the front
  out.reserve(s.size() + 2);
  out += '\'';
  out += s;
  out += '\'';
  return out;
}

// A decimal integer in [lo, hi], the whole string (no sign, no spaces).
long long parse_integer(std::string_view text, long long lo, long long hi, const std::string& what) {
  long long v = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || text.front() == '+' || ec == std::errc::invalid_argument || ptr != end)
    refuse(what + " is not an integer");
  if (ec == std::errc::result_out_of_range || v < lo || v > hi)
    refuse(what + " is outside " + std::to_string(lo) + ".." + std::to_string(hi));
  return v;
}

struct Env {
  const EnvLookup& lookup;
  const char* launcher;

  std::optional<std::string> get(std::string_view name) const { return lookup(name); }
  std::string describe(std::string_view name, std::string_view value) const {
    return std::string(name) + "=" + quoted(value) + " (" + launcher + " environment)";
  }
  std::string require(std::string_view name) const {
    auto v = get(name);
    if (!v) refuse(std::string(name) + " is not set (" + launcher + " environment)");
    return *v;
  }
  int integer(std::string_view name, std::string_view value, int lo, int hi = 1 << 30) const {
    return static_cast<int>(parse_integer(value, lo, hi, describe(name, value)));
  }
  int required_integer(std::string_view name, int lo, int hi = 1 << 30) const {
    return integer(name, require(name), lo, hi);
  }
};

bool parse_bool(const Env& env, std::string_view name, const std::optional<std::string>& value) {
  if (!value) return false;
  if (*value == "True" || *value == "true" || *value == "1") return true;
  if (*value == "False" || *value == "false" || *value == "0") return false;
  refuse(env.describe(name, *value) + " is not True/False");
}

// The rank invariants every launcher must meet; names the variables it read them from.
void check_ranks(const LaunchInfo& info, const char* rank, const char* world, const char* local_rank,
                 const char* local_world) {
  const auto n = [](const char* name, int v) { return std::string(name) + "=" + std::to_string(v); };
  const std::string src = std::string(" (") + launcher_name(info.launcher) + " environment)";
  if (info.rank >= info.world_size) refuse(n(rank, info.rank) + " is not below " + n(world, info.world_size) + src);
  if (info.local_rank >= info.local_world_size)
    refuse(n(local_rank, info.local_rank) + " is not below " + n(local_world, info.local_world_size) + src);
  if (info.local_world_size > info.world_size)
    refuse(n(local_world, info.local_world_size) + " is larger than " + n(world, info.world_size) + src);
  if (info.local_rank > info.rank)
    refuse(n(local_rank, info.local_rank) + " is larger than " + n(rank, info.rank) + src);
}

void read_master(const Env& env, LaunchInfo& info) {
  info.master_addr = env.require("MASTER_ADDR");
  if (info.master_addr.empty()) refuse(env.describe("MASTER_ADDR", "") + " is empty");
  info.master_port = env.required_integer("MASTER_PORT", 1, 65535);
}

LaunchInfo read_torchrun(const Env& env) {
  LaunchInfo info;
  info.launcher = Launcher::torchrun;
  info.rank = env.required_integer("RANK", 0);
  info.world_size = env.required_integer("WORLD_SIZE", 1);
  auto local_rank = env.get("LOCAL_RANK"), local_world = env.get("LOCAL_WORLD_SIZE");
  if (local_rank.has_value() != local_world.has_value())
    refuse(std::string(local_rank ? "LOCAL_RANK" : "LOCAL_WORLD_SIZE") + " is set but " +
           (local_rank ? "LOCAL_WORLD_SIZE" : "LOCAL_RANK") + " is not (torchrun environment)");
  info.local_rank = local_rank ? env.integer("LOCAL_RANK", *local_rank, 0) : info.rank;
  info.local_world_size = local_world ? env.integer("LOCAL_WORLD_SIZE", *local_world, 1) : info.world_size;
  read_master(env, info);
  info.use_agent_store = parse_bool(env, "TORCHELASTIC_USE_AGENT_STORE", env.get("TORCHELASTIC_USE_AGENT_STORE"));
  check_ranks(info, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  return info;
}

LaunchInfo read_slurm(const Env& env) {
  LaunchInfo info;
  info.launcher = Launcher::slurm;
  info.rank = env.required_integer("SLURM_PROCID", 0);
  info.world_size = env.required_integer("SLURM_NTASKS", 1);
  info.local_rank = env.required_integer("SLURM_LOCALID", 0);
  const char* local_world_name = "SLURM_NTASKS_PER_NODE";
  if (auto per_node = env.get("SLURM_NTASKS_PER_NODE")) {
    info.local_world_size = env.integer("SLURM_NTASKS_PER_NODE", *per_node, 1);
  } else {
    local_world_name = "SLURM_TASKS_PER_NODE";
    const auto list = expand_slurm_tasks_per_node(env.require("SLURM_TASKS_PER_NODE"), "SLURM_TASKS_PER_NODE");
    const int node = env.required_integer("SLURM_NODEID", 0);
    if (static_cast<std::size_t>(node) >= list.size())
      refuse("SLURM_NODEID=" + std::to_string(node) + " has no entry in " +
             env.describe("SLURM_TASKS_PER_NODE", *env.get("SLURM_TASKS_PER_NODE")) + ", which names " +
             std::to_string(list.size()) + " nodes");
    info.local_world_size = list[node];
  }
  if (auto addr = env.get("MASTER_ADDR")) {
    if (addr->empty()) refuse(env.describe("MASTER_ADDR", "") + " is empty");
    info.master_addr = *addr;
  } else {
    const char* name = env.get("SLURM_JOB_NODELIST") ? "SLURM_JOB_NODELIST" : "SLURM_NODELIST";
    info.master_addr = expand_slurm_nodelist(env.require(name), name).front();
  }
  auto port = env.get("MASTER_PORT");
  info.master_port = port ? env.integer("MASTER_PORT", *port, 1, 65535) : kDefaultSlurmMasterPort;
  check_ranks(info, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", local_world_name);
  return info;
}

LaunchInfo read_single(const Env& env) {
  if (auto world = env.get("WORLD_SIZE"); world && *world != "1")
    refuse(env.describe("WORLD_SIZE", *world) + " is set but RANK is not: set RANK too, or launch with torchrun");
  if (auto local = env.get("LOCAL_RANK"); local && *local != "0")
    refuse(env.describe("LOCAL_RANK", *local) + " is set but RANK is not: set RANK too, or launch with torchrun");
  return LaunchInfo{};
}

// Splits at commas outside brackets.
std::vector<std::string_view> split_top_level(std::string_view s, std::string_view source) {
  std::vector<std::string_view> parts;
  int depth = 0;
  std::size_t start = 0;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '[' && ++depth > 1) refuse(std::string(source) + "=" + quoted(s) + " has a nested '['");
    if (s[i] == ']' && --depth < 0) refuse(std::string(source) + "=" + quoted(s) + " has a ']' without '['");
    if (s[i] == ',' && depth == 0) {
      parts.push_back(s.substr(start, i - start));
      start = i + 1;
    }
  }
  if (depth != 0) refuse(std::string(source) + "=" + quoted(s) + " has a '[' without ']'");
  parts.push_back(s.substr(start));
  return parts;
}

// "01-03,07" -> 01 02 03 07 (zero padding of the lower bound kept).
std::vector<std::string> expand_ranges(std::string_view ranges, const std::string& what) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= ranges.size()) {
    std::size_t comma = ranges.find(',', start);
    if (comma == std::string_view::npos) comma = ranges.size();
    std::string_view item = ranges.substr(start, comma - start);
    if (item.empty()) refuse(what + " has an empty range");
    const std::size_t dash = item.find('-');
    std::string_view lo_text = item.substr(0, dash);
    std::string_view hi_text = dash == std::string_view::npos ? lo_text : item.substr(dash + 1);
    const long long lo = parse_integer(lo_text, 0, 999'999'999, what + " (bound " + quoted(lo_text) + ")");
    const long long hi = parse_integer(hi_text, 0, 999'999'999, what + " (bound " + quoted(hi_text) + ")");
    if (hi < lo) refuse(what + " has the descending range " + quoted(item));
    if (static_cast<std::size_t>(hi - lo) >= kMaxHosts) refuse(what + " names more than 1000000 hosts");
    for (long long v = lo; v <= hi; ++v) {
      std::string digits = std::to_string(v);
      if (digits.size() < lo_text.size()) digits.insert(0, lo_text.size() - digits.size(), '0');
      out.push_back(std::move(digits));
    }
    start = comma + 1;
  }
  return out;
}

}  // namespace

const char* launcher_name(Launcher launcher) {
  switch (launcher) {
    case Launcher::single: return "single";
    case Launcher::torchrun: return "torchrun";
    case Launcher::slurm: return "slurm";
  }
  return "?";
}

std::vector<std::string> expand_slurm_nodelist(std::string_view nodelist, std::string_view source) {
  const std::string what = std::string(source) + "=" + quoted(nodelist);
  std::vector<std::string> hosts;
  for (std::string_view item : split_top_level(nodelist, source)) {
    if (item.empty()) refuse(what + " has an empty host name");
    // Each bracket group multiplies the names built so far (row-major, like Slurm).
    std::vector<std::string> names{""};
    std::size_t pos = 0;
    while (pos < item.size()) {
      const std::size_t open = item.find('[', pos);
      const std::string_view literal = item.substr(pos, open == std::string_view::npos ? item.npos : open - pos);
      for (auto& n : names) n += literal;
      if (open == std::string_view::npos) break;
      const std::size_t close = item.find(']', open);
      const auto ranges = expand_ranges(item.substr(open + 1, close - open - 1), what);
      if (names.size() * ranges.size() + hosts.size() > kMaxHosts) refuse(what + " names more than 1000000 hosts");
      std::vector<std::string> next;
      next.reserve(names.size() * ranges.size());
      for (const auto& n : names)
        for (const auto& r : ranges) next.push_back(n + r);
      names = std::move(next);
      pos = close + 1;
    }
    hosts.insert(hosts.end(), names.begin(), names.end());
  }
  return hosts;
}

std::vector<int> expand_slurm_tasks_per_node(std::string_view value, std::string_view source) {
  const std::string what = std::string(source) + "=" + quoted(value);
  std::vector<int> counts;
  for (std::string_view item : split_top_level(value, source)) {
    if (item.empty()) refuse(what + " has an empty entry");
    std::string_view count_text = item, repeat_text = "1";
    if (const auto paren = item.find("(x"); paren != std::string_view::npos) {
      if (item.back() != ')') refuse(what + ": entry " + quoted(item) + " does not end in ')'");
      count_text = item.substr(0, paren);
      repeat_text = item.substr(paren + 2, item.size() - paren - 3);
    }
    const int count = static_cast<int>(parse_integer(count_text, 1, 1 << 20, what + " (count " + quoted(count_text) + ")"));
    const auto repeat = parse_integer(repeat_text, 1, kMaxHosts, what + " (repeat " + quoted(repeat_text) + ")");
    if (counts.size() + static_cast<std::size_t>(repeat) > kMaxHosts) refuse(what + " names more than 1000000 nodes");
    counts.insert(counts.end(), static_cast<std::size_t>(repeat), count);
  }
  return counts;
}

LaunchInfo read_launch(const EnvLookup& lookup) {
  if (lookup("RANK")) return read_torchrun(Env{lookup, "torchrun"});
  if (lookup("SLURM_PROCID")) return read_slurm(Env{lookup, "slurm"});
  return read_single(Env{lookup, "single-process"});
}

LaunchInfo read_launch_from_environment() {
  return read_launch([](std::string_view name) -> std::optional<std::string> {
    const char* v = std::getenv(std::string(name).c_str());
    return v ? std::optional<std::string>(v) : std::nullopt;
  });
}

namespace {

// Binds a TCP socket on 127.0.0.1 at `port` (0: the kernel picks) and returns the port bound,
// or -1 when it is taken.
int bind_loopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("cannot open a socket to find a free TCP port");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof a;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  return ok ? ntohs(a.sin_port) : -1;
}

// The lowest port the kernel hands out to outgoing connections (ip_local_port_range).
int ephemeral_port_low() {
  std::ifstream f("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0;
  return (f >> low) && low > 0 ? low : 32768;  // Linux's default
}

}  // namespace

int free_loopback_port() {
  // The kernel's own choice (port 0) comes from the range it also gives every connect(), so a
  // connection elsewhere can take it before the store binds it (EADDRINUSE at rendezvous, seen
  // under ctest -j). Draw from below that range instead and check the port is free.
  constexpr int kLowest = 15000;  // above the ports services commonly listen on
  const int highest = ephemeral_port_low() - 1;
  if (highest - kLowest >= 1000) {
    std::mt19937 rng(std::random_device{}());
    std::uniform_int_distribution<int> pick(kLowest, highest);
    for (int attempt = 0; attempt < 200; ++attempt)
      if (const int port = bind_loopback(pick(rng)); port > 0) return port;
  }
  const int port = bind_loopback(0);  // a narrow or exhausted range: the kernel's choice
  if (port <= 0) throw std::runtime_error("cannot find a free TCP port on 127.0.0.1");
  return port;
}

}  // namespace kiln::parallel

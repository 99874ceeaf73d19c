#pragma once
// `kiln node`: a process that joins an actor graph and hosts the actors it is given, of the
// kinds registered with messaging/hosting.hpp.
#include <cstdint>
#include <string>
#include <vector>

namespace kiln::experiments {

struct NodeOptions {
  std::string name;                 ///< node name (logs, directory); kiln node: node-PID
  std::string bind;                 ///< endpoint to bind, e.g. tcp://127.0.0.1:0 or ipc:///tmp/n.sock
  std::string join;                 ///< root gateway endpoint to join; empty: this node is the root
  std::vector<std::string> actors;  ///< logical names to host, "<kind>/<index>", e.g. diag/0
  int join_timeout_ms = 10000;
  /// > 0: stop (as on SIGTERM) when this parent process dies (Linux PR_SET_PDEATHSIG); the
  /// node exits at once if that process is already gone. Set by `kiln run` for its children.
  int64_t exit_with_parent = 0;
};

/// Runs the node until SIGINT or SIGTERM. Prints "kiln node NAME ready at ENDPOINT" on
/// stdout once it hosts its actors and has joined. Returns the process exit code; a bad
/// option (unknown actor kind, endpoint that cannot be bound, root that does not answer)
/// is reported on stderr with exit code 2.
int run_node(const NodeOptions& options);

}  // namespace kiln::experiments

#pragma once
// The gateway's graph directory (part of messaging/gateway.hpp): where each actor lives, as
// this gateway knows it. Actors are hosted here (serve), behind an endpoint (a route, added by
// hand or learned from the root), or unknown. A gateway that has joined a graph asks the root
// about unknown actors; the root's own directory is the routes every node announced when it
// joined, plus the actors it hosts itself (docs/actors.md, "Graphs: the root and join").
//
// Plain data, no sockets; the gateway touches it on its I/O thread only.
#include <chrono>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "messaging/schema.hpp"

namespace kiln::messaging {

/// The built-in actor every gateway hosts: graph.join, graph.lookup and ping.
inline constexpr const char* kGraphActor = "graph";
/// Longest wait for the root's answer to a graph.lookup made to resolve a receiver.
inline constexpr std::chrono::milliseconds kLookupTimeout{2000};

class Directory {
 public:
  /// Where an envelope for an actor goes: here, to `endpoint`, or nowhere known (both unset).
  struct Location {
    bool local = false;
    std::string endpoint;
  };

  /// `self` is this gateway's bound endpoint ("" when it binds none).
  explicit Directory(std::string self) : self_(std::move(self)) {}

  /// Actor `actor` is hosted by this gateway.
  void serve(const std::string& actor) { local_.insert(actor); }
  /// Actor `actor` lives behind `endpoint` (replaces an earlier route).
  void add_route(const std::string& actor, const std::string& endpoint) { routes_[actor] = endpoint; }
  /// Joined the graph whose root is bound at `endpoint`: graph.* requests go there from now on.
  void set_root(const std::string& endpoint) { root_ = endpoint; }
  /// The root's endpoint; "" when not joined.
  const std::string& root() const { return root_; }
  bool joined() const { return !root_.empty(); }

  /// Where `actor` is. The graph actor is the root's once joined, this gateway's before.
  Location locate(const std::string& actor) const;
  /// Hosted here or routed (no lookup needed).
  bool knows(const std::string& actor) const { return local_.count(actor) > 0 || routes_.count(actor) > 0; }
  /// The actors hosted here, in name order (announced by join).
  std::vector<std::string> local_actors() const { return {local_.begin(), local_.end()}; }

  /// Learns routes from a root's directory (actor -> endpoint); entries for actors hosted
  /// here or for this gateway's own endpoint are skipped.
  void merge(const std::map<std::string, std::string>& actors);
  /// This gateway's directory: every route, plus the actors hosted here at its endpoint.
  std::map<std::string, std::string> actors() const;
  /// The root's side of graph.join: records the node's actors at its endpoint and returns the
  /// directory, or a bad_message naming each actor the graph already has at another endpoint.
  Expected<std::map<std::string, std::string>> join(const GraphJoin& request);

 private:
  std::string self_;
  std::string root_;
  std::set<std::string> local_;
  std::map<std::string, std::string> routes_;  // actor -> endpoint
};

}  // namespace kiln::messaging

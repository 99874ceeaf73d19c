// The graph directory: locating actors, merging a root's directory, answering a join.
#include "messaging/directory.hpp"

namespace kiln::messaging {

Directory::Location Directory::locate(const std::string& actor) const {
  if (local_.count(actor) > 0 || (actor == kGraphActor && root_.empty())) return {true, {}};
  if (actor == kGraphActor) return {false, root_};
  if (auto r = routes_.find(actor); r != routes_.end()) return {false, r->second};
  return {};
}

void Directory::merge(const std::map<std::string, std::string>& actors) {
  for (const auto& [actor, endpoint] : actors)
    if (!local_.count(actor) && endpoint != self_) routes_[actor] = endpoint;
}

std::map<std::string, std::string> Directory::actors() const {
  auto d = routes_;
  if (!self_.empty())
    for (const auto& name : local_) d[name] = self_;
  return d;
}

Expected<std::map<std::string, std::string>> Directory::join(const GraphJoin& request) {
  std::string conflicts;
  auto known = actors();
  for (const auto& a : request.actors)
    if (auto it = known.find(a); it != known.end() && it->second != request.endpoint)
      conflicts += " '" + a + "' (at " + it->second + ")";
  if (!conflicts.empty())
    return make_error(ErrorCode::bad_message,
                      "node '" + request.node + "' cannot join: actors already in the graph:" + conflicts);
  for (const auto& a : request.actors) routes_[a] = request.endpoint;
  return actors();
}

}  // namespace kiln::messaging

// Pending requests: the table of requests waiting for an answer, and the ways they leave it.
#include "messaging/pending_requests.hpp"

#include <spdlog/spdlog.h>

#include <vector>

#include "messaging/schema.hpp"

namespace kiln::messaging {

std::optional<PendingRequest> PendingRequests::take(uint64_t id) {
  auto node = waiting_.extract(id);
  if (node.empty()) return std::nullopt;
  return std::move(node.mapped());
}

void PendingRequests::complete(Envelope reply) {
  auto request = take(reply.correlation_id);
  if (!request) {
    spdlog::debug("gateway '{}': late or unknown reply id {} ('{}')", node_, reply.correlation_id, reply.type);
    return;
  }
  if (reply.kind == Kind::error) request->done(error_from_reply(reply));
  else request->done(std::move(reply));
}

std::optional<PendingRequests::Clock::time_point> PendingRequests::next_deadline() const {
  std::optional<Clock::time_point> first;
  for (const auto& [id, r] : waiting_)
    if (!first || r.deadline < *first) first = r.deadline;
  return first;
}

// The callbacks below may add or complete other requests (a lookup's callback sends the
// request it resolved), so ids are collected first and each is taken out before it runs.
void PendingRequests::expire(Clock::time_point now) {
  std::vector<uint64_t> late;
  for (const auto& [id, r] : waiting_)
    if (r.deadline <= now) late.push_back(id);
  for (auto id : late) {
    auto r = take(id);
    if (!r) continue;
    std::string where = r->peer.empty() ? "local actor" : "peer " + r->peer;
    r->done(make_error(ErrorCode::timeout, r->what + " got no answer from " + where + " in time"));
  }
}

void PendingRequests::fail_peer(const std::string& endpoint) {
  std::vector<uint64_t> ids;
  for (const auto& [id, r] : waiting_)
    if (r.peer == endpoint) ids.push_back(id);
  if (!ids.empty())
    spdlog::warn("gateway '{}': peer {} disconnected; failing {} waiting request(s)", node_, endpoint, ids.size());
  for (auto id : ids) {
    auto r = take(id);
    if (!r) continue;
    r->done(make_error(ErrorCode::peer_lost,
                       r->what + ": peer " + endpoint + " disconnected (process died or stopped answering heartbeats)"));
  }
}

void PendingRequests::fail_all() {
  while (!waiting_.empty()) {
    auto batch = std::move(waiting_);
    waiting_.clear();
    for (auto& [id, r] : batch)
      r.done(make_error(ErrorCode::shutdown, "gateway '" + node_ + "' stopped before " + r.what + " was answered"));
  }
}

}  // namespace kiln::messaging

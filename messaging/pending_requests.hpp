#pragma once
// The gateway's requests that wait for an answer (part of messaging/gateway.hpp): each has a
// correlation id, a deadline and the peer it went to. A request leaves this table exactly once:
// answered (complete), overdue (expire -> timeout), its peer disconnected (fail_peer ->
// peer_lost), or the gateway stopped (fail_all -> shutdown).
//
// Ids are handed out from any thread (next_id); everything else runs on the I/O thread.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>

#include "messaging/envelope.hpp"

namespace kiln::messaging {

/// One request waiting for its answer.
struct PendingRequest {
  using Clock = std::chrono::steady_clock;
  std::function<void(Expected<Envelope>)> done;  ///< runs exactly once, on the I/O thread
  Clock::time_point deadline;
  std::string peer;  ///< endpoint the request went to; "" for a local actor
  std::string what;  ///< "request 'type' to 'receiver'", for error messages
};

class PendingRequests {
 public:
  using Clock = PendingRequest::Clock;

  /// `node` names this gateway in log lines and error messages.
  explicit PendingRequests(std::string node) : node_(std::move(node)) {}

  /// A fresh correlation id (1, 2, ...); safe from any thread.
  uint64_t next_id() { return next_id_++; }

  /// Waits for the answer to request `id`.
  void add(uint64_t id, PendingRequest request) { waiting_.emplace(id, std::move(request)); }
  /// Removes request `id` without completing it; nullopt if it is not waiting.
  std::optional<PendingRequest> take(uint64_t id);
  /// Completes the request `reply` answers (by its correlation id) with the reply, or with the
  /// Error an `error` envelope carries. A late or unknown reply is logged and dropped.
  void complete(Envelope reply);

  /// The earliest deadline of a waiting request; nullopt if none waits.
  std::optional<Clock::time_point> next_deadline() const;
  /// Completes every request whose deadline is not after `now` with `timeout`.
  void expire(Clock::time_point now);
  /// Completes every request sent to `endpoint` with `peer_lost`.
  void fail_peer(const std::string& endpoint);
  /// Completes every waiting request with `shutdown`.
  void fail_all();

 private:
  std::string node_;
  std::atomic<uint64_t> next_id_{1};
  std::unordered_map<uint64_t, PendingRequest> waiting_;
};

}  // namespace kiln::messaging

#pragma once
// The per-process gateway: delivers incoming envelopes to local actors by logical name
// ("rollout/0") and sends outgoing ones over ZeroMQ. One I/O thread owns every socket.
//
// Sockets (docs/wire-format.md, "Transport"):
//   ROUTER, bound at Options::bind       incoming requests/tells from any peer; replies go
//                                        back to the requesting connection by routing id
//   DEALER per peer endpoint, connected  outgoing requests/tells; their replies arrive here
// Peer loss: each DEALER has a socket monitor and ZMTP heartbeats; a disconnect (process
// died, or stopped answering heartbeats) fails every request waiting on that peer with
// peer_lost; a request that gets no answer fails with timeout. Nothing waits forever.
#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "messaging/envelope.hpp"
#include "messaging/schema.hpp"

namespace kiln::messaging {

/// Counters since start (messages, bytes incl. tensor frames).
struct GatewayStats {
  uint64_t sent = 0, received = 0, sent_bytes = 0, received_bytes = 0;
  uint64_t rejected = 0;  ///< incoming messages that failed to decode
};

class Gateway {
 public:
  struct Options {
    std::string node = "node";  ///< this process's node name (logs, Pong, directory)
    /// Endpoint to bind: "inproc://name", "ipc:///path", "tcp://127.0.0.1:0" (0 = any port).
    /// Empty: no incoming connections (the gateway can still send and get replies).
    std::string bind;
    std::chrono::milliseconds heartbeat_interval{500};
    std::chrono::milliseconds heartbeat_timeout{3000};  ///< silent peer -> peer_lost
    DecodeLimits limits;
  };
  /// Receives envelopes addressed to a local actor, on the gateway thread: it must not block
  /// (hand the envelope to an actor or queue). Requests are answered with reply().
  using Handler = std::function<void(Envelope)>;
  /// Completion of a request, on the gateway thread: the reply or an Error (timeout,
  /// peer_lost, unknown_actor, remote_error with the remote's message, shutdown, ...).
  using ReplyCallback = std::function<void(Expected<Envelope>)>;

  /// Starts the gateway thread and binds. Throws std::runtime_error naming the endpoint
  /// if it cannot be bound.
  explicit Gateway(Options options);
  /// Stops the thread; pending requests complete with `shutdown`.
  ~Gateway();
  Gateway(const Gateway&) = delete;
  Gateway& operator=(const Gateway&) = delete;

  const std::string& node() const { return options_.node; }
  /// The bound endpoint with a resolved port ("tcp://127.0.0.1:41234"); empty if unbound.
  const std::string& endpoint() const { return endpoint_; }

  /// Hosts actor `name` in this process.
  void serve(const std::string& name, Handler handler);
  /// Tells the gateway that actor `name` lives behind `endpoint`.
  void add_route(const std::string& name, const std::string& endpoint);
  /// Joins the graph whose root gateway is bound at `root_endpoint`: announces the actors
  /// served here, learns the root's directory, and resolves unknown actors through it
  /// from then on. Blocks the caller up to `timeout`.
  Expected<GraphDirectory> join(const std::string& root_endpoint, std::chrono::milliseconds timeout);
  /// Waits until `actor` has a known location (local, route, or the root's directory).
  Expected<bool> wait_for_actor(const std::string& actor, std::chrono::milliseconds timeout);

  /// One-way send. Errors (unknown actor, invalid envelope) are logged, never thrown.
  void tell(Envelope env);
  /// Sends a request; `done` runs exactly once. env.correlation_id is assigned here.
  void request(Envelope env, std::chrono::milliseconds timeout, ReplyCallback done);
  std::future<Expected<Envelope>> request(Envelope env, std::chrono::milliseconds timeout);
  /// Answers `request` (as delivered to a Handler) with `reply` (kind set to reply).
  void reply(const Envelope& request, Envelope reply);
  /// Answers `request` with an error envelope.
  void reply_error(const Envelope& request, const Error& error);

  GatewayStats stats() const;

 private:
  struct Impl;
  Options options_;
  std::string endpoint_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::messaging

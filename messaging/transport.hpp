#pragma once
// The gateway's transport (part of messaging/gateway.hpp): the ZeroMQ sockets, the one I/O
// thread that owns them, and the command queue through which other threads hand it work.
//
//   ROUTER, bound at Options::bind       incoming envelopes; replies to them go back to the
//                                        requesting connection by routing id
//   DEALER per peer endpoint, connected  outgoing envelopes; the peer's replies arrive on it
//   PAIR per DEALER (socket monitor)     connect/disconnect events -> Listener::peer_lost
//   eventfd                              wakes the poll when a command is posted
//
// Size limits (Options::limits): every socket's ZMQ_MAXMSGSIZE is max_frame_bytes(limits),
// so over tcp:// and ipc:// ZeroMQ itself drops a larger frame, and the connection that sent
// it, before buffering it (inproc:// hands messages over without that check; the decoder
// refuses them). Frame 0 over max_envelope_bytes is refused before it is sent, too.
//
// Received messages are decoded here; one that does not decode is logged and counted as
// rejected, and a request among them is answered with the error when its id can be read from
// frame 0 (a frame 0 over max_envelope_bytes is not read: refusing it costs O(1)).
#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "messaging/gateway.hpp"

namespace kiln::messaging {

class Transport {
 public:
  using Clock = std::chrono::steady_clock;

  /// What the I/O thread reports to the gateway; every call runs on the I/O thread.
  class Listener {
   public:
    virtual ~Listener() = default;
    /// An envelope that arrived on the ROUTER; its return path leads back to its connection.
    virtual void received(Envelope env) = 0;
    /// An envelope that arrived on the DEALER connected to `endpoint`.
    virtual void received_from(const std::string& endpoint, Envelope env) = 0;
    /// A request that arrived on the ROUTER and did not decode, known by its correlation id,
    /// sender and return path only: answer it with `error`.
    virtual void rejected(Envelope request, const Error& error) = 0;
    /// The DEALER connected to `endpoint` lost its connection, or its connection attempt was
    /// refused (nothing listens there).
    virtual void peer_lost(const std::string& endpoint) = 0;
    /// The latest time the poll may sleep until (the earliest request deadline); nullopt:
    /// nothing is due (the poll wakes every 100 ms anyway).
    virtual std::optional<Clock::time_point> next_deadline() const = 0;
    /// After every poll, with the current time: the moment to fail what is overdue.
    virtual void tick(Clock::time_point now) = 0;
    /// The loop has ended and run its last commands; the sockets close after this returns.
    virtual void stopped() = 0;
  };

  /// Binds the ROUTER at options.bind (no ROUTER if it is empty), on the calling thread; the
  /// sockets move to the I/O thread at start(). Throws std::runtime_error naming the endpoint
  /// if it cannot be bound.
  explicit Transport(const Gateway::Options& options);
  /// stop()s the I/O thread if it runs, and closes every socket.
  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  /// Starts the I/O thread; it reports to `listener` (which must outlive stop()).
  void start(Listener& listener);
  /// Ends the loop once the commands posted so far have run, reports Listener::stopped,
  /// closes every socket (releasing the bound endpoint at once) and joins the thread.
  void stop();

  /// The bound endpoint with a resolved port ("tcp://127.0.0.1:41234"); empty if unbound.
  const std::string& endpoint() const { return endpoint_; }

  /// Runs `fn` on the I/O thread, in posting order; returns at once. Any thread.
  void post(std::function<void()> fn);
  /// Runs `fn` on the I/O thread and returns its result. Any thread but the I/O thread.
  template <class F>
  auto run_sync(F fn) -> decltype(fn()) {
    std::promise<decltype(fn())> p;
    auto f = p.get_future();
    post([&] { p.set_value(fn()); });
    return f.get();
  }

  // ---- I/O thread only ------------------------------------------------------------------
  /// Connects the DEALER for `endpoint` on first use. Error (transport): the endpoint cannot
  /// be connected (unsupported transport, malformed address).
  Expected<bool> connect(const std::string& endpoint);
  /// Whether the peer at `endpoint` disconnected, or refused a connection attempt, and has not
  /// (re)connected since.
  bool lost(const std::string& endpoint) const;
  /// Sends `env` on the DEALER for `endpoint` (connect() first). Errors: bad_message when
  /// frame 0 would exceed limits.max_envelope_bytes (its receiver would drop it), transport
  /// when ZeroMQ refuses; both name the type and the endpoint.
  Expected<bool> send(const std::string& endpoint, const Envelope& env);
  /// Sends `reply` on the ROUTER to the connection its return path names. Errors as send().
  Expected<bool> send_reply(const Envelope& reply);

  /// Counters since start; any thread.
  GatewayStats stats() const;

 private:
  struct Peer;

  void run();
  void run_commands();
  std::chrono::milliseconds poll_timeout() const;
  Expected<bool> send_on(zmq::socket_t& s, const std::string* routing_id, bool delimiter, const Envelope& env);
  void configure(zmq::socket_t& s) const;
  std::optional<Envelope> receive(std::vector<zmq::message_t>& parts, std::size_t first, ReturnPath rp);
  void on_router();
  void on_dealer(Peer& p);
  void on_monitor(Peer& p);
  void close_sockets();

  Gateway::Options opt_;
  std::string endpoint_;
  int wake_fd_ = -1;
  std::mutex mu_;
  std::vector<std::function<void()>> commands_;  // guarded by mu_
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> sent_{0}, received_{0}, sent_bytes_{0}, received_bytes_{0}, rejected_{0};
  Listener* listener_ = nullptr;
  std::thread thread_;

  // Below: touched by the I/O thread only (once start() has run).
  std::unique_ptr<zmq::socket_t> router_;
  std::map<std::string, std::unique_ptr<Peer>> peers_;  // by endpoint
};

/// The largest frame `limits` allow, in bytes: frame 0 up to max_envelope_bytes, a tensor frame
/// up to max_tensor_bytes. The sockets' ZMQ_MAXMSGSIZE (a per-frame limit).
int64_t max_frame_bytes(const DecodeLimits& limits);

}  // namespace kiln::messaging

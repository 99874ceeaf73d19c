// Transport: the ROUTER, the per-peer DEALERs and their monitors, owned by one I/O thread that
// polls them together with an eventfd woken by post().
#include "messaging/transport.hpp"

#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cstring>

namespace kiln::messaging {

namespace {
// One ZeroMQ context per process: inproc:// only connects sockets of the same context.
// Never destroyed (zmq_ctx_term at static-destruction time can block on lingering sockets).
zmq::context_t& process_context() {
  static auto* ctx = new zmq::context_t(2);
  return *ctx;
}

std::atomic<uint64_t> g_monitor_seq{0};

void release_owner(void*, void* hint) { delete static_cast<std::shared_ptr<const void>*>(hint); }

// A ZeroMQ message over the tensor's bytes without copying them: the tensor's owner is
// held until ZeroMQ frees the message (for inproc, until the receiver drops it).
zmq::message_t tensor_message(const Tensor& t) {
  if (t.nbytes == 0) return zmq::message_t();
  if (!t.owner) return zmq::message_t(t.data, t.nbytes);  // caller-managed memory: copy
  auto* hint = new std::shared_ptr<const void>(t.owner);
  return zmq::message_t(const_cast<std::byte*>(t.data), t.nbytes, release_owner, hint);
}

bool recv_multipart(zmq::socket_t& s, std::vector<zmq::message_t>& parts) {
  parts.clear();
  zmq::message_t m;
  if (!s.recv(m, zmq::recv_flags::dontwait)) return false;
  bool more = m.more();
  parts.push_back(std::move(m));
  while (more) {
    zmq::message_t next;
    (void)s.recv(next);  // the rest of a multipart message is already here (atomic delivery)
    more = next.more();
    parts.push_back(std::move(next));
  }
  return true;
}
}  // namespace

int64_t max_frame_bytes(const DecodeLimits& limits) {
  auto n = std::max(limits.max_envelope_bytes, limits.max_tensor_bytes);
  return static_cast<int64_t>(std::min<std::size_t>(n, INT64_MAX));
}

struct Transport::Peer {
  std::string endpoint;
  zmq::socket_t dealer;
  zmq::socket_t monitor;
  bool lost = false;  ///< disconnected and not connected again: new requests fail at once
};

Transport::Transport(const Gateway::Options& options) : opt_(options) {
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) throw std::runtime_error("gateway: eventfd failed");
  if (opt_.bind.empty()) return;
  try {
    router_ = std::make_unique<zmq::socket_t>(process_context(), zmq::socket_type::router);
    router_->set(zmq::sockopt::router_mandatory, 1);  // unknown routing id -> error, not silent drop
    configure(*router_);
    router_->bind(opt_.bind);
    endpoint_ = router_->get(zmq::sockopt::last_endpoint);
  } catch (const std::exception& e) {
    router_.reset();
    ::close(wake_fd_);
    throw std::runtime_error("gateway '" + opt_.node + "' cannot bind '" + opt_.bind + "': " + e.what());
  }
}

Transport::~Transport() {
  stop();
  close_sockets();  // never started: the sockets are still the constructing thread's
  ::close(wake_fd_);
}

void Transport::configure(zmq::socket_t& s) const {
  s.set(zmq::sockopt::sndhwm, 0);  // never drop an accepted message
  s.set(zmq::sockopt::rcvhwm, 0);
  s.set(zmq::sockopt::linger, 1000);
  s.set(zmq::sockopt::heartbeat_ivl, static_cast<int>(opt_.heartbeat_interval.count()));
  s.set(zmq::sockopt::heartbeat_timeout, static_cast<int>(opt_.heartbeat_timeout.count()));
  s.set(zmq::sockopt::maxmsgsize, max_frame_bytes(opt_.limits));  // a larger frame: dropped by ZeroMQ
}

void Transport::start(Listener& listener) {
  listener_ = &listener;
  thread_ = std::thread([this] { run(); });
}

void Transport::stop() {
  if (!thread_.joinable()) return;
  stopping_ = true;
  post([] {});
  thread_.join();
}

void Transport::post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    commands_.push_back(std::move(fn));
  }
  uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_fd_, &one, sizeof one);
}

void Transport::run_commands() {
  std::vector<std::function<void()>> batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    batch.swap(commands_);
  }
  for (auto& fn : batch) fn();
}

std::chrono::milliseconds Transport::poll_timeout() const {
  auto t = std::chrono::milliseconds(100);
  if (auto due = listener_->next_deadline()) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*due - Clock::now()) +
                std::chrono::milliseconds(1);
    if (left < t) t = std::max(left, std::chrono::milliseconds(0));
  }
  return t;
}

void Transport::run() {
  std::vector<zmq_pollitem_t> items;
  std::vector<Peer*> item_peer;
  while (!stopping_.load()) {
    run_commands();
    items.clear();
    item_peer.clear();
    items.push_back({nullptr, wake_fd_, ZMQ_POLLIN, 0});
    item_peer.push_back(nullptr);
    if (router_) {
      items.push_back({static_cast<void*>(*router_), 0, ZMQ_POLLIN, 0});
      item_peer.push_back(nullptr);
    }
    for (auto& [ep, p] : peers_) {
      items.push_back({static_cast<void*>(p->dealer), 0, ZMQ_POLLIN, 0});
      item_peer.push_back(p.get());
      items.push_back({static_cast<void*>(p->monitor), 0, ZMQ_POLLIN, 0});
      item_peer.push_back(p.get());
    }
    try {
      zmq::poll(items.data(), items.size(), poll_timeout());
    } catch (const zmq::error_t& e) {
      if (e.num() == EINTR) continue;
      spdlog::error("gateway '{}': poll failed: {}", opt_.node, e.what());
      break;
    }
    if (items[0].revents & ZMQ_POLLIN) {
      uint64_t v;
      [[maybe_unused]] auto n = ::read(wake_fd_, &v, sizeof v);
    }
    // Commands first: an actor served (or a route added) before a message arrived must
    // be in place when that message is delivered.
    run_commands();
    std::size_t i = 1;
    if (router_) {
      if (items[i].revents & ZMQ_POLLIN) on_router();
      ++i;
    }
    for (; i < items.size(); i += 2) {
      if (items[i].revents & ZMQ_POLLIN) on_dealer(*item_peer[i]);
      if (items[i + 1].revents & ZMQ_POLLIN) on_monitor(*item_peer[i + 1]);
    }
    listener_->tick(Clock::now());
  }
  run_commands();
  listener_->stopped();
  close_sockets();
}

void Transport::close_sockets() {
  for (auto& [ep, p] : peers_) {
    zmq_socket_monitor(static_cast<void*>(p->dealer), nullptr, 0);
    p->monitor.close();
    p->dealer.close();
  }
  peers_.clear();
  if (router_) {
    // Release the endpoint now (close releases inproc names asynchronously), so that a
    // new gateway can bind the same endpoint right away.
    try {
      router_->unbind(endpoint_);
    } catch (const zmq::error_t&) {
    }
    router_->close();
    router_.reset();
  }
}

Expected<bool> Transport::connect(const std::string& endpoint) {
  if (peers_.count(endpoint)) return true;
  auto p = std::make_unique<Peer>();
  p->endpoint = endpoint;
  p->dealer = zmq::socket_t(process_context(), zmq::socket_type::dealer);
  configure(p->dealer);
  std::string mon = "inproc://kiln-monitor-" + std::to_string(g_monitor_seq++);
  zmq_socket_monitor(static_cast<void*>(p->dealer), mon.c_str(),
                     ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_CONNECTED | ZMQ_EVENT_CONNECT_RETRIED);
  p->monitor = zmq::socket_t(process_context(), zmq::socket_type::pair);
  p->monitor.connect(mon);
  try {
    p->dealer.connect(endpoint);
  } catch (const zmq::error_t& e) {
    zmq_socket_monitor(static_cast<void*>(p->dealer), nullptr, 0);
    return make_error(ErrorCode::transport, "cannot connect to '" + endpoint + "': " + e.what());
  }
  peers_.emplace(endpoint, std::move(p));
  return true;
}

bool Transport::lost(const std::string& endpoint) const {
  auto it = peers_.find(endpoint);
  return it != peers_.end() && it->second->lost;
}

Expected<bool> Transport::send(const std::string& endpoint, const Envelope& env) {
  auto it = peers_.find(endpoint);
  assert(it != peers_.end() && "connect() comes first: the gateway connects before it sends");
  auto sent = send_on(it->second->dealer, nullptr, false, env);
  if (sent) return sent;
  Error e = sent.error();
  e.message = "sending '" + env.type + "' to " + endpoint + ": " + e.message;
  return e;
}

Expected<bool> Transport::send_reply(const Envelope& reply) {
  if (!router_) return make_error(ErrorCode::transport, "this gateway binds no ROUTER");
  return send_on(*router_, &reply.return_path.routing_id, reply.return_path.req_delimiter, reply);
}

Expected<bool> Transport::send_on(zmq::socket_t& s, const std::string* routing_id, bool delimiter,
                                  const Envelope& env) {
  std::string header = encode_header(env);
  if (header.size() > opt_.limits.max_envelope_bytes)  // the receiver would drop it unread
    return make_error(ErrorCode::bad_message, "frame 0 (envelope) is " + std::to_string(header.size()) +
                                                  " bytes, limit " + std::to_string(opt_.limits.max_envelope_bytes));
  const std::size_t nt = env.tensors.size();
  const auto more = zmq::send_flags::sndmore | zmq::send_flags::dontwait;
  const auto last = zmq::send_flags::dontwait;
  auto would_block = [] { return make_error(ErrorCode::transport, "would block"); };
  uint64_t bytes = header.size();
  try {
    if (routing_id && !s.send(zmq::message_t(routing_id->data(), routing_id->size()), more)) return would_block();
    if (delimiter) s.send(zmq::message_t(), more);
    if (!s.send(zmq::message_t(header.data(), header.size()), nt ? more : last)) return would_block();
    for (std::size_t i = 0; i < nt; ++i) {
      s.send(tensor_message(env.tensors[i]), i + 1 < nt ? more : last);
      bytes += env.tensors[i].nbytes;
    }
  } catch (const zmq::error_t& e) {
    return make_error(ErrorCode::transport, e.what());
  }
  sent_++;
  sent_bytes_ += bytes;
  return true;
}

std::optional<Envelope> Transport::receive(std::vector<zmq::message_t>& parts, std::size_t first, ReturnPath rp) {
  std::vector<Frame> frames;
  frames.reserve(parts.size() - first);
  uint64_t bytes = 0;
  for (std::size_t i = first; i < parts.size(); ++i) {
    auto holder = std::make_shared<zmq::message_t>(std::move(parts[i]));
    bytes += holder->size();
    frames.push_back(Frame{static_cast<const std::byte*>(holder->data()), holder->size(), holder});
  }
  received_++;
  received_bytes_ += bytes;
  auto env = decode(frames, opt_.limits);
  if (env) {
    env->return_path = std::move(rp);
    return std::move(*env);
  }
  rejected_++;
  spdlog::warn("gateway '{}': rejected an incoming message: {}", opt_.node, env.error().what());
  if (rp.via == ReturnPath::Via::router && !frames.empty()) {
    if (auto origin = peek_request(frames[0], opt_.limits)) {  // never reads a frame over the limit
      Envelope request;
      request.correlation_id = origin->correlation_id;
      request.sender = std::move(origin->sender);
      request.return_path = std::move(rp);
      listener_->rejected(std::move(request), env.error());
    }
  }
  return std::nullopt;
}

void Transport::on_router() {
  std::vector<zmq::message_t> parts;
  for (int n = 0; n < 256 && recv_multipart(*router_, parts); ++n) {
    if (parts.size() < 2) continue;  // identity only: nothing to decode
    ReturnPath rp{ReturnPath::Via::router, parts[0].to_string(), false};
    std::size_t first = 1;
    if (parts[1].size() == 0 && parts.size() > 2) {  // REQ peers put an empty delimiter first
      rp.req_delimiter = true;
      first = 2;
    }
    if (auto env = receive(parts, first, std::move(rp))) listener_->received(std::move(*env));
  }
}

void Transport::on_dealer(Peer& p) {
  std::vector<zmq::message_t> parts;
  for (int n = 0; n < 256 && recv_multipart(p.dealer, parts); ++n)
    if (auto env = receive(parts, 0, ReturnPath{})) listener_->received_from(p.endpoint, std::move(*env));
}

void Transport::on_monitor(Peer& p) {
  zmq::message_t ev, addr;
  while (p.monitor.recv(ev, zmq::recv_flags::dontwait)) {
    if (ev.more()) (void)p.monitor.recv(addr);
    uint16_t event = 0;
    if (ev.size() >= 2) std::memcpy(&event, ev.data(), 2);
    if (event == ZMQ_EVENT_DISCONNECTED) {
      p.lost = true;
      listener_->peer_lost(p.endpoint);
    } else if (event == ZMQ_EVENT_CONNECT_RETRIED && !p.lost) {
      // A connection attempt was refused (nothing listens there: a peer that died before this
      // gateway's first connection, which no heartbeat can notice): what waits on it fails now.
      p.lost = true;
      listener_->peer_lost(p.endpoint);
    } else if (event == ZMQ_EVENT_CONNECTED) {
      p.lost = false;  // back (a restarted process on the same endpoint)
    }
  }
}

GatewayStats Transport::stats() const {
  return GatewayStats{sent_.load(), received_.load(), sent_bytes_.load(), received_bytes_.load(), rejected_.load()};
}

}  // namespace kiln::messaging

// Gateway: one I/O thread owns the ROUTER, the per-peer DEALERs and their monitors; other
// threads hand it work through a command queue woken by an eventfd in the poll set.
#include "messaging/gateway.hpp"

#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <zmq.hpp>

namespace kiln::messaging {

namespace {
using Clock = std::chrono::steady_clock;
constexpr const char* kGraphActor = "graph";
constexpr auto kLookupTimeout = std::chrono::milliseconds(2000);

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

// Best effort for a rejected message: its correlation id and sender, so that the error can
// be sent back instead of leaving the sender to time out.
std::optional<std::pair<uint64_t, std::string>> peek_request(const zmq::message_t& head) {
  try {
    std::size_t n = head.size(), off = 0;
    msgpack::unpack_limit limit(n, n / 2 + 1, n, n, n, 4096);  // deep enough for any bad request
    auto h = msgpack::unpack(static_cast<const char*>(head.data()), n, off, nullptr, nullptr, limit);
    const auto& m = h.get();
    if (m.type != msgpack::type::MAP) return std::nullopt;
    std::optional<uint64_t> id;
    std::string from;
    bool is_request = false;
    for (uint32_t i = 0; i < m.via.map.size; ++i) {
      const auto& kv = m.via.map.ptr[i];
      if (kv.key.type != msgpack::type::STR) continue;
      std::string_view k(kv.key.via.str.ptr, kv.key.via.str.size);
      if (k == "id" && kv.val.type == msgpack::type::POSITIVE_INTEGER) id = kv.val.via.u64;
      if (k == "from" && kv.val.type == msgpack::type::STR) from.assign(kv.val.via.str.ptr, kv.val.via.str.size);
      if (k == "kind" && kv.val.type == msgpack::type::STR)
        is_request = std::string_view(kv.val.via.str.ptr, kv.val.via.str.size) == "request";
    }
    if (id && is_request) return std::make_pair(*id, from);
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

struct Pending {
  Gateway::ReplyCallback done;
  Clock::time_point deadline;
  std::string peer;  // endpoint the request went to; "" for a local actor
  std::string what;  // "'type' to 'receiver'" for error messages
};

struct Peer {
  std::string endpoint;
  zmq::socket_t dealer;
  zmq::socket_t monitor;
  bool lost = false;  ///< disconnected and not connected again: new requests fail at once
};
}  // namespace

struct Gateway::Impl {
  Options opt;
  std::string self_endpoint;
  int wake_fd = -1;
  std::mutex mu;
  std::vector<std::function<void()>> commands;  // guarded by mu
  std::atomic<bool> stopping{false};
  std::atomic<uint64_t> next_id{1};
  std::atomic<uint64_t> sent{0}, received{0}, sent_bytes{0}, received_bytes{0}, rejected{0};
  std::thread thread;

  // Below: touched by the I/O thread only.
  std::unique_ptr<zmq::socket_t> router;
  std::map<std::string, std::unique_ptr<Peer>> peers;  // by endpoint
  std::map<std::string, Handler> local;               // actor -> handler
  std::map<std::string, std::string> routes;          // actor -> endpoint
  std::string root;                                   // root endpoint once joined
  std::unordered_map<uint64_t, Pending> pending;

  void post(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu);
      commands.push_back(std::move(fn));
    }
    uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(wake_fd, &one, sizeof one);
  }

  template <class F>
  auto run_sync(F fn) -> decltype(fn()) {
    std::promise<decltype(fn())> p;
    auto f = p.get_future();
    post([&] { p.set_value(fn()); });
    return f.get();
  }

  // ---- I/O thread ------------------------------------------------------------------
  void run(std::promise<std::string> bound) {
    try {
      if (!opt.bind.empty()) {
        router = std::make_unique<zmq::socket_t>(process_context(), zmq::socket_type::router);
        router->set(zmq::sockopt::router_mandatory, 1);  // unknown routing id -> error, not silent drop
        router->set(zmq::sockopt::sndhwm, 0);            // never drop an accepted message
        router->set(zmq::sockopt::rcvhwm, 0);
        router->set(zmq::sockopt::linger, 1000);
        router->set(zmq::sockopt::heartbeat_ivl, static_cast<int>(opt.heartbeat_interval.count()));
        router->set(zmq::sockopt::heartbeat_timeout, static_cast<int>(opt.heartbeat_timeout.count()));
        router->bind(opt.bind);
        self_endpoint = router->get(zmq::sockopt::last_endpoint);
      }
      bound.set_value(self_endpoint);
    } catch (const std::exception& e) {
      bound.set_exception(std::make_exception_ptr(
          std::runtime_error("gateway '" + opt.node + "' cannot bind '" + opt.bind + "': " + e.what())));
      return;
    }
    std::vector<zmq_pollitem_t> items;
    std::vector<Peer*> item_peer;
    while (!stopping.load()) {
      run_commands();
      items.clear();
      item_peer.clear();
      items.push_back({nullptr, wake_fd, ZMQ_POLLIN, 0});
      item_peer.push_back(nullptr);
      if (router) {
        items.push_back({static_cast<void*>(*router), 0, ZMQ_POLLIN, 0});
        item_peer.push_back(nullptr);
      }
      for (auto& [ep, p] : peers) {
        items.push_back({static_cast<void*>(p->dealer), 0, ZMQ_POLLIN, 0});
        item_peer.push_back(p.get());
        items.push_back({static_cast<void*>(p->monitor), 0, ZMQ_POLLIN, 0});
        item_peer.push_back(p.get());
      }
      try {
        zmq::poll(items.data(), items.size(), poll_timeout());
      } catch (const zmq::error_t& e) {
        if (e.num() == EINTR) continue;
        spdlog::error("gateway '{}': poll failed: {}", opt.node, e.what());
        break;
      }
      if (items[0].revents & ZMQ_POLLIN) {
        uint64_t v;
        [[maybe_unused]] auto n = ::read(wake_fd, &v, sizeof v);
      }
      // Commands first: an actor served (or a route added) before a message arrived must
      // be in place when that message is delivered.
      run_commands();
      std::size_t i = 1;
      if (router) {
        if (items[i].revents & ZMQ_POLLIN) on_router();
        ++i;
      }
      for (; i < items.size(); i += 2) {
        if (items[i].revents & ZMQ_POLLIN) on_dealer(*item_peer[i]);
        if (items[i + 1].revents & ZMQ_POLLIN) on_monitor(*item_peer[i + 1]);
      }
      expire(Clock::now());
    }
    run_commands();
    for (auto& [id, p] : pending)
      p.done(make_error(ErrorCode::shutdown, "gateway '" + opt.node + "' stopped before " + p.what + " was answered"));
    pending.clear();
    for (auto& [ep, p] : peers) {
      zmq_socket_monitor(static_cast<void*>(p->dealer), nullptr, 0);
      p->monitor.close();
      p->dealer.close();
    }
    peers.clear();
    if (router) {
      // Release the endpoint now (close releases inproc names asynchronously), so that a
      // new gateway can bind the same endpoint right away.
      try {
        router->unbind(self_endpoint);
      } catch (const zmq::error_t&) {
      }
      router->close();
    }
  }

  std::chrono::milliseconds poll_timeout() const {
    auto t = std::chrono::milliseconds(100);
    auto now = Clock::now();
    for (const auto& [id, p] : pending) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(p.deadline - now) +
                  std::chrono::milliseconds(1);
      if (left < t) t = std::max(left, std::chrono::milliseconds(0));
    }
    return t;
  }

  void run_commands() {
    std::vector<std::function<void()>> batch;
    {
      std::lock_guard<std::mutex> lock(mu);
      batch.swap(commands);
    }
    for (auto& fn : batch) fn();
  }

  void expire(Clock::time_point now) {
    std::vector<uint64_t> late;
    for (const auto& [id, p] : pending)
      if (p.deadline <= now) late.push_back(id);
    for (auto id : late) {
      auto node = pending.extract(id);
      Pending& p = node.mapped();
      std::string where = p.peer.empty() ? "local actor" : "peer " + p.peer;
      p.done(make_error(ErrorCode::timeout, p.what + " got no answer from " + where + " in time"));
    }
  }

  // The DEALER for `endpoint`, connected on first use; nullptr (and `err`) when the endpoint
  // cannot be connected (unsupported transport, malformed address).
  Peer* peer(const std::string& endpoint, std::string& err) {
    auto it = peers.find(endpoint);
    if (it != peers.end()) return it->second.get();
    auto p = std::make_unique<Peer>();
    p->endpoint = endpoint;
    p->dealer = zmq::socket_t(process_context(), zmq::socket_type::dealer);
    p->dealer.set(zmq::sockopt::sndhwm, 0);
    p->dealer.set(zmq::sockopt::rcvhwm, 0);
    p->dealer.set(zmq::sockopt::linger, 1000);
    p->dealer.set(zmq::sockopt::heartbeat_ivl, static_cast<int>(opt.heartbeat_interval.count()));
    p->dealer.set(zmq::sockopt::heartbeat_timeout, static_cast<int>(opt.heartbeat_timeout.count()));
    std::string mon = "inproc://kiln-monitor-" + std::to_string(g_monitor_seq++);
    zmq_socket_monitor(static_cast<void*>(p->dealer), mon.c_str(),
                       ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_CONNECTED);
    p->monitor = zmq::socket_t(process_context(), zmq::socket_type::pair);
    p->monitor.connect(mon);
    try {
      p->dealer.connect(endpoint);
    } catch (const zmq::error_t& e) {
      zmq_socket_monitor(static_cast<void*>(p->dealer), nullptr, 0);
      err = "cannot connect to '" + endpoint + "': " + e.what();
      return nullptr;
    }
    auto* ref = p.get();
    peers.emplace(endpoint, std::move(p));
    return ref;
  }

  void fail(std::optional<Pending>& p, const Error& e, const Envelope& env) {
    if (p) p->done(e);
    else spdlog::warn("gateway '{}': dropped '{}' to '{}': {}", opt.node, env.type, env.receiver, e.what());
  }

  void complete(Envelope env) {
    auto it = pending.find(env.correlation_id);
    if (it == pending.end()) {
      spdlog::debug("gateway '{}': late or unknown reply id {} ('{}')", opt.node, env.correlation_id, env.type);
      return;
    }
    Pending p = std::move(it->second);
    pending.erase(it);
    if (env.kind == Kind::error) p.done(error_from_reply(env));
    else p.done(std::move(env));
  }

  // Sends or delivers an outgoing envelope; `p` is set for requests.
  void dispatch(Envelope env, std::optional<Pending> p, bool looked_up = false) {
    if (auto ok = validate(env, opt.limits); !ok) return fail(p, ok.error(), env);
    if (env.kind == Kind::reply || env.kind == Kind::error) return send_reply(std::move(env));
    auto lh = local.find(env.receiver);
    if (lh != local.end() || (env.receiver == kGraphActor && root.empty())) {
      env.return_path = ReturnPath{ReturnPath::Via::local, {}, false};
      if (p) pending.emplace(env.correlation_id, std::move(*p));
      deliver(std::move(env));
      return;
    }
    std::string ep;
    if (env.receiver == kGraphActor) ep = root;
    else if (auto r = routes.find(env.receiver); r != routes.end()) ep = r->second;
    if (ep.empty()) {
      if (!root.empty() && !looked_up) return lookup_then(std::move(env), std::move(p));
      return fail(p, make_error(ErrorCode::unknown_actor,
                                "no actor '" + env.receiver + "' is known to node '" + opt.node + "'" +
                                    (root.empty() ? " (not joined to a graph)" : " or to the graph root at " + root)),
                  env);
    }
    std::string err;
    Peer* peer_ptr = peer(ep, err);
    if (!peer_ptr) return fail(p, make_error(ErrorCode::transport, err), env);
    Peer& peer_ref = *peer_ptr;
    if (peer_ref.lost && p)  // a request would wait for its timeout: say now that the peer is gone
      return fail(p, make_error(ErrorCode::peer_lost, "request '" + env.type + "' to '" + env.receiver + "': peer " + ep +
                                                           " disconnected earlier (process died or stopped answering heartbeats)"),
                  env);
    uint64_t id = env.correlation_id;
    if (p) {
      p->peer = ep;
      pending.emplace(id, std::move(*p));
    }
    if (!send(peer_ref.dealer, nullptr, false, env, err)) {
      auto node = pending.extract(id);
      std::optional<Pending> back;
      if (!node.empty()) back = std::move(node.mapped());
      fail(back, make_error(ErrorCode::transport, "sending '" + env.type + "' to " + ep + ": " + err), env);
    }
  }

  void lookup_then(Envelope env, std::optional<Pending> p) {
    Envelope q = make_envelope(GraphLookup{env.receiver}, Kind::request, opt.node, kGraphActor);
    q.correlation_id = next_id++;
    auto deadline = Clock::now() + kLookupTimeout;
    if (p && p->deadline < deadline) deadline = p->deadline;
    Pending lp;
    lp.deadline = deadline;
    lp.what = "lookup of '" + env.receiver + "'";
    lp.done = [this, env = std::move(env), p = std::move(p)](Expected<Envelope> r) mutable {
      if (r) {
        if (auto dir = payload_as<GraphDirectory>(*r)) merge(dir->actors);
      } else {
        Error e = r.error();
        e.message = "resolving '" + env.receiver + "' through the graph root failed: " + e.message;
        return fail(p, e, env);
      }
      dispatch(std::move(env), std::move(p), /*looked_up=*/true);
    };
    dispatch(std::move(q), std::move(lp));
  }

  void merge(const std::map<std::string, std::string>& dir) {
    for (const auto& [actor, ep] : dir)
      if (!local.count(actor) && ep != self_endpoint) routes[actor] = ep;
  }

  std::map<std::string, std::string> directory() const {
    auto d = routes;
    if (!self_endpoint.empty())
      for (const auto& [name, h] : local) d[name] = self_endpoint;
    return d;
  }

  void deliver(Envelope env) {
    if (env.kind == Kind::reply || env.kind == Kind::error) return complete(std::move(env));
    if (auto h = local.find(env.receiver); h != local.end()) return h->second(std::move(env));
    if (env.receiver == kGraphActor) return on_graph(std::move(env));
    if (env.kind == Kind::request) {
      std::string hosted;
      for (const auto& [name, h] : local) hosted += (hosted.empty() ? "" : ", ") + name;
      send_reply(make_error_reply(env,
                                  make_error(ErrorCode::unknown_actor, "node '" + opt.node + "' hosts no actor '" +
                                                                           env.receiver + "' (it hosts: " + hosted + ")"),
                                  kGraphActor));
    } else {
      spdlog::warn("gateway '{}': tell '{}' for unknown actor '{}' dropped", opt.node, env.type, env.receiver);
    }
  }

  // The built-in "graph" actor: directory service (join, lookup) and ping.
  void on_graph(Envelope env) {
    if (env.kind != Kind::request) return;
    Envelope out;
    if (env.type == GraphJoin::kType) {
      auto j = payload_as<GraphJoin>(env);
      if (!j) return send_reply(make_error_reply(env, j.error(), kGraphActor));
      std::string conflicts;
      auto dir = directory();
      for (const auto& a : j->actors)
        if (auto it = dir.find(a); it != dir.end() && it->second != j->endpoint)
          conflicts += " '" + a + "' (at " + it->second + ")";
      if (!conflicts.empty())
        return send_reply(make_error_reply(
            env, make_error(ErrorCode::bad_message, "node '" + j->node + "' cannot join: actors already in the graph:" + conflicts),
            kGraphActor));
      for (const auto& a : j->actors) routes[a] = j->endpoint;
      spdlog::info("gateway '{}': node '{}' joined at {} with {} actor(s)", opt.node, j->node, j->endpoint,
                   j->actors.size());
      out = make_envelope(GraphDirectory{directory()}, Kind::reply, kGraphActor, env.sender);
    } else if (env.type == GraphLookup::kType) {
      out = make_envelope(GraphDirectory{directory()}, Kind::reply, kGraphActor, env.sender);
    } else if (env.type == Ping::kType) {
      auto ping = payload_as<Ping>(env);
      out = make_envelope(Pong{opt.node, kGraphActor, ping ? ping->note : ""}, Kind::reply, kGraphActor, env.sender);
    } else {
      return send_reply(make_error_reply(
          env, make_error(ErrorCode::unknown_type, "actor 'graph' does not handle '" + env.type + "'"), kGraphActor));
    }
    out.correlation_id = env.correlation_id;
    out.return_path = env.return_path;
    send_reply(std::move(out));
  }

  void send_reply(Envelope r) {
    switch (r.return_path.via) {
      case ReturnPath::Via::local:
        return complete(std::move(r));
      case ReturnPath::Via::router: {
        std::string err;
        if (!router || !send(*router, &r.return_path.routing_id, r.return_path.req_delimiter, r, err))
          spdlog::warn("gateway '{}': reply '{}' to '{}' not sent (requester gone?): {}", opt.node, r.type,
                       r.receiver, err);
        return;
      }
      case ReturnPath::Via::none:
        spdlog::warn("gateway '{}': reply '{}' to '{}' has no return path (not built from a received request)",
                     opt.node, r.type, r.receiver);
    }
  }

  bool send(zmq::socket_t& s, const std::string* routing_id, bool delim, const Envelope& env, std::string& err) {
    std::string header = encode_header(env);
    const std::size_t nt = env.tensors.size();
    const auto more = zmq::send_flags::sndmore | zmq::send_flags::dontwait;
    const auto last = zmq::send_flags::dontwait;
    uint64_t bytes = header.size();
    try {
      if (routing_id && !s.send(zmq::message_t(routing_id->data(), routing_id->size()), more)) {
        err = "would block";
        return false;
      }
      if (delim) s.send(zmq::message_t(), more);
      if (!s.send(zmq::message_t(header.data(), header.size()), nt ? more : last)) {
        err = "would block";
        return false;
      }
      for (std::size_t i = 0; i < nt; ++i) {
        s.send(tensor_message(env.tensors[i]), i + 1 < nt ? more : last);
        bytes += env.tensors[i].nbytes;
      }
    } catch (const zmq::error_t& e) {
      err = e.what();
      return false;
    }
    sent++;
    sent_bytes += bytes;
    return true;
  }

  std::optional<Envelope> receive(std::vector<zmq::message_t>& parts, std::size_t first, ReturnPath rp) {
    std::vector<Frame> frames;
    frames.reserve(parts.size() - first);
    uint64_t bytes = 0;
    for (std::size_t i = first; i < parts.size(); ++i) {
      auto holder = std::make_shared<zmq::message_t>(std::move(parts[i]));
      bytes += holder->size();
      frames.push_back(Frame{static_cast<const std::byte*>(holder->data()), holder->size(), holder});
    }
    received++;
    received_bytes += bytes;
    auto env = decode(frames, opt.limits);
    if (!env) {
      rejected++;
      spdlog::warn("gateway '{}': rejected an incoming message: {}", opt.node, env.error().what());
      if (rp.via == ReturnPath::Via::router && !frames.empty()) {
        auto* head = static_cast<zmq::message_t*>(const_cast<void*>(frames[0].owner.get()));
        if (auto req = peek_request(*head)) {
          Envelope fake;
          fake.correlation_id = req->first;
          fake.sender = req->second;
          fake.return_path = rp;
          send_reply(make_error_reply(fake, env.error(), kGraphActor));
        }
      }
      return std::nullopt;
    }
    env->return_path = std::move(rp);
    return std::move(*env);
  }

  void on_router() {
    std::vector<zmq::message_t> parts;
    for (int n = 0; n < 256 && recv_multipart(*router, parts); ++n) {
      if (parts.size() < 2) continue;  // identity only: nothing to decode
      ReturnPath rp{ReturnPath::Via::router, parts[0].to_string(), false};
      std::size_t first = 1;
      if (parts[1].size() == 0 && parts.size() > 2) {  // REQ peers put an empty delimiter first
        rp.req_delimiter = true;
        first = 2;
      }
      if (auto env = receive(parts, first, std::move(rp))) deliver(std::move(*env));
    }
  }

  void on_dealer(Peer& p) {
    std::vector<zmq::message_t> parts;
    for (int n = 0; n < 256 && recv_multipart(p.dealer, parts); ++n)
      if (auto env = receive(parts, 0, ReturnPath{})) {
        if (env->kind == Kind::reply || env->kind == Kind::error) complete(std::move(*env));
        else spdlog::warn("gateway '{}': '{}' from {} is not a reply; dropped", opt.node, env->type, p.endpoint);
      }
  }

  void on_monitor(Peer& p) {
    zmq::message_t ev, addr;
    while (p.monitor.recv(ev, zmq::recv_flags::dontwait)) {
      if (ev.more()) (void)p.monitor.recv(addr);
      uint16_t event = 0;
      if (ev.size() >= 2) std::memcpy(&event, ev.data(), 2);
      if (event == ZMQ_EVENT_DISCONNECTED) {
        p.lost = true;
        fail_peer(p.endpoint);
      } else if (event == ZMQ_EVENT_CONNECTED) {
        p.lost = false;  // back (a restarted process on the same endpoint)
      }
    }
  }

  void fail_peer(const std::string& endpoint) {
    std::vector<uint64_t> ids;
    for (const auto& [id, p] : pending)
      if (p.peer == endpoint) ids.push_back(id);
    if (!ids.empty())
      spdlog::warn("gateway '{}': peer {} disconnected; failing {} waiting request(s)", opt.node, endpoint, ids.size());
    for (auto id : ids) {
      auto node = pending.extract(id);
      node.mapped().done(make_error(ErrorCode::peer_lost,
                                    node.mapped().what + ": peer " + endpoint +
                                        " disconnected (process died or stopped answering heartbeats)"));
    }
  }
};

Gateway::Gateway(Options options) : options_(std::move(options)), impl_(std::make_unique<Impl>()) {
  impl_->opt = options_;
  impl_->wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (impl_->wake_fd < 0) throw std::runtime_error("gateway: eventfd failed");
  std::promise<std::string> bound;
  auto f = bound.get_future();
  impl_->thread = std::thread([this, b = std::move(bound)]() mutable { impl_->run(std::move(b)); });
  try {
    endpoint_ = f.get();
  } catch (...) {
    impl_->thread.join();
    ::close(impl_->wake_fd);
    throw;
  }
}

Gateway::~Gateway() {
  impl_->stopping = true;
  impl_->post([] {});
  impl_->thread.join();
  ::close(impl_->wake_fd);
}

void Gateway::serve(const std::string& name, Handler handler) {
  impl_->post([impl = impl_.get(), name, h = std::move(handler)]() mutable { impl->local[name] = std::move(h); });
}

void Gateway::add_route(const std::string& name, const std::string& endpoint) {
  impl_->post([impl = impl_.get(), name, endpoint] { impl->routes[name] = endpoint; });
}

void Gateway::tell(Envelope env) {
  env.kind = Kind::tell;
  if (env.sender.empty()) env.sender = options_.node;
  impl_->post([impl = impl_.get(), e = std::move(env)]() mutable { impl->dispatch(std::move(e), std::nullopt); });
}

void Gateway::request(Envelope env, std::chrono::milliseconds timeout, ReplyCallback done) {
  env.kind = Kind::request;
  env.correlation_id = impl_->next_id++;
  if (env.sender.empty()) env.sender = options_.node;
  Pending p{std::move(done), Clock::now() + timeout, {}, "request '" + env.type + "' to '" + env.receiver + "'"};
  impl_->post([impl = impl_.get(), e = std::move(env), p = std::move(p)]() mutable {
    impl->dispatch(std::move(e), std::move(p));
  });
}

std::future<Expected<Envelope>> Gateway::request(Envelope env, std::chrono::milliseconds timeout) {
  auto promise = std::make_shared<std::promise<Expected<Envelope>>>();
  auto f = promise->get_future();
  request(std::move(env), timeout, [promise](Expected<Envelope> r) { promise->set_value(std::move(r)); });
  return f;
}

void Gateway::reply(const Envelope& request, Envelope reply) {
  reply.kind = Kind::reply;
  reply.correlation_id = request.correlation_id;
  reply.return_path = request.return_path;
  if (reply.sender.empty()) reply.sender = request.receiver;
  if (reply.receiver.empty()) reply.receiver = request.sender;
  impl_->post([impl = impl_.get(), r = std::move(reply)]() mutable { impl->dispatch(std::move(r), std::nullopt); });
}

void Gateway::reply_error(const Envelope& request, const Error& error) {
  auto r = make_error_reply(request, error, request.receiver);
  impl_->post([impl = impl_.get(), r = std::move(r)]() mutable { impl->send_reply(std::move(r)); });
}

Expected<GraphDirectory> Gateway::join(const std::string& root_endpoint, std::chrono::milliseconds timeout) {
  std::promise<Expected<Envelope>> promise;
  auto f = promise.get_future();
  impl_->post([this, root_endpoint, timeout, &promise] {
    impl_->root = root_endpoint;
    std::vector<std::string> actors;
    for (const auto& [name, h] : impl_->local) actors.push_back(name);
    auto env = make_envelope(GraphJoin{options_.node, endpoint_, actors}, Kind::request, options_.node, kGraphActor);
    env.correlation_id = impl_->next_id++;
    Pending p{[&promise](Expected<Envelope> r) { promise.set_value(std::move(r)); }, Clock::now() + timeout, {},
              "join of graph at " + root_endpoint};
    impl_->dispatch(std::move(env), std::move(p));
  });
  auto r = f.get();
  if (!r) return r.error();
  auto dir = payload_as<GraphDirectory>(*r);
  if (!dir) return dir.error();
  impl_->run_sync([&] {
    impl_->merge(dir->actors);
    return 0;
  });
  return dir;
}

Expected<bool> Gateway::wait_for_actor(const std::string& actor, std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  while (true) {
    bool known = impl_->run_sync([&] { return impl_->local.count(actor) > 0 || impl_->routes.count(actor) > 0; });
    if (known) return true;
    bool joined = impl_->run_sync([&] { return !impl_->root.empty(); });
    if (joined) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      auto r = request(make_envelope(GraphLookup{actor}, Kind::request, options_.node, kGraphActor),
                       std::max(std::chrono::milliseconds(1), std::min(left, std::chrono::milliseconds(500))))
                   .get();
      if (r)
        if (auto dir = payload_as<GraphDirectory>(*r))
          impl_->run_sync([&] {
            impl_->merge(dir->actors);
            return 0;
          });
    }
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return make_error(ErrorCode::unknown_actor, "actor '" + actor + "' did not appear within " +
                                                  std::to_string(timeout.count()) + " ms");
}

GatewayStats Gateway::stats() const {
  return GatewayStats{impl_->sent.load(), impl_->received.load(), impl_->sent_bytes.load(),
                      impl_->received_bytes.load(), impl_->rejected.load()};
}

}  // namespace kiln::messaging

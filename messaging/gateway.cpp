// Gateway: routing between its parts, and local delivery. The parts:
//   transport.hpp         the sockets, the I/O thread, the command queue, decoding
//   pending_requests.hpp  requests waiting for an answer: ids, deadlines, failing them
//   directory.hpp         where actors live: local, routes, the root's directory
// Outgoing envelopes go to a local handler or out through the transport (dispatch); incoming
// ones go to a local handler, the built-in `graph` actor, or the request they answer (deliver).
#include "messaging/gateway.hpp"

#include <spdlog/spdlog.h>

#include <map>
#include <optional>
#include <thread>

#include "messaging/directory.hpp"
#include "messaging/pending_requests.hpp"
#include "messaging/transport.hpp"

namespace kiln::messaging {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

struct Gateway::Impl final : Transport::Listener {
  explicit Impl(const Options& options)
      : opt(options), transport(options), pending(options.node), directory(transport.endpoint()) {
    transport.start(*this);
  }
  // The I/O thread stops first: it calls into every member below.
  ~Impl() override { transport.stop(); }

  Options opt;
  Transport transport;
  PendingRequests pending;
  Directory directory;
  std::map<std::string, Handler> handlers;  // actors hosted here; I/O thread only

  // ---- Transport::Listener (I/O thread) ---------------------------------------------
  void received(Envelope env) override { deliver(std::move(env)); }
  void received_from(const std::string& endpoint, Envelope env) override {
    if (env.kind == Kind::reply || env.kind == Kind::error) pending.complete(std::move(env));
    else spdlog::warn("gateway '{}': '{}' from {} is not a reply; dropped", opt.node, env.type, endpoint);
  }
  void rejected(Envelope request, const Error& error) override {
    send_reply(make_error_reply(request, error, kGraphActor));
  }
  void peer_lost(const std::string& endpoint) override { pending.fail_peer(endpoint); }
  std::optional<Clock::time_point> next_deadline() const override { return pending.next_deadline(); }
  void tick(Clock::time_point now) override { pending.expire(now); }
  void stopped() override { pending.fail_all(); }

  // ---- I/O thread -------------------------------------------------------------------
  void fail(std::optional<PendingRequest>& p, const Error& e, const Envelope& env) {
    if (p) p->done(e);
    else spdlog::warn("gateway '{}': dropped '{}' to '{}': {}", opt.node, env.type, env.receiver, e.what());
  }

  // Sends or delivers an outgoing envelope; `p` is set for requests.
  void dispatch(Envelope env, std::optional<PendingRequest> p, bool looked_up = false) {
    if (auto ok = validate(env, opt.limits); !ok) return fail(p, ok.error(), env);
    if (env.kind == Kind::reply || env.kind == Kind::error) return send_reply(std::move(env));
    auto where = directory.locate(env.receiver);
    if (where.local) {
      env.return_path = ReturnPath{ReturnPath::Via::local, {}, false};
      if (p) pending.add(env.correlation_id, std::move(*p));
      deliver(std::move(env));
      return;
    }
    const std::string& ep = where.endpoint;
    if (ep.empty()) {
      if (directory.joined() && !looked_up) return lookup_then(std::move(env), std::move(p));
      return fail(p, make_error(ErrorCode::unknown_actor,
                                "no actor '" + env.receiver + "' is known to node '" + opt.node + "'" +
                                    (directory.joined() ? " or to the graph root at " + directory.root()
                                                        : " (not joined to a graph)")),
                  env);
    }
    if (auto connected = transport.connect(ep); !connected) return fail(p, connected.error(), env);
    if (transport.lost(ep) && p)  // a request would wait for its timeout: say now that the peer is gone
      return fail(p, make_error(ErrorCode::peer_lost, "request '" + env.type + "' to '" + env.receiver + "': peer " + ep +
                                                           " disconnected earlier (process died or stopped answering heartbeats)"),
                  env);
    const uint64_t id = env.correlation_id;
    const bool is_request = p.has_value();
    if (p) {
      p->peer = ep;
      pending.add(id, std::move(*p));
    }
    if (auto sent = transport.send(ep, env); !sent) {
      std::optional<PendingRequest> back;
      if (is_request) back = pending.take(id);
      fail(back, sent.error(), env);
    }
  }

  // Asks the graph root where env.receiver lives, then dispatches env (once: a receiver the
  // root does not know either fails with unknown_actor).
  void lookup_then(Envelope env, std::optional<PendingRequest> p) {
    Envelope q = make_envelope(GraphLookup{env.receiver}, Kind::request, opt.node, kGraphActor);
    q.correlation_id = pending.next_id();
    PendingRequest lookup;
    lookup.deadline = Clock::now() + kLookupTimeout;
    if (p && p->deadline < lookup.deadline) lookup.deadline = p->deadline;
    lookup.what = "lookup of '" + env.receiver + "'";
    lookup.done = [this, env = std::move(env), p = std::move(p)](Expected<Envelope> r) mutable {
      if (r) {
        if (auto dir = payload_as<GraphDirectory>(*r)) directory.merge(dir->actors);
      } else {
        Error e = r.error();
        e.message = "resolving '" + env.receiver + "' through the graph root failed: " + e.message;
        return fail(p, e, env);
      }
      dispatch(std::move(env), std::move(p), /*looked_up=*/true);
    };
    dispatch(std::move(q), std::move(lookup));
  }

  void send_reply(Envelope r) {
    switch (r.return_path.via) {
      case ReturnPath::Via::local:
        return pending.complete(std::move(r));
      case ReturnPath::Via::router:
        if (auto sent = transport.send_reply(r); !sent)
          spdlog::warn("gateway '{}': reply '{}' to '{}' not sent (requester gone?): {}", opt.node, r.type,
                       r.receiver, sent.error().message);
        return;
      case ReturnPath::Via::none:
        spdlog::warn("gateway '{}': reply '{}' to '{}' has no return path (not built from a received request)",
                     opt.node, r.type, r.receiver);
    }
  }

  // An envelope for this gateway: a local actor's, the graph actor's, or an answer.
  void deliver(Envelope env) {
    if (env.kind == Kind::reply || env.kind == Kind::error) return pending.complete(std::move(env));
    if (auto h = handlers.find(env.receiver); h != handlers.end()) return h->second(std::move(env));
    if (env.receiver == kGraphActor) return on_graph(std::move(env));
    if (env.kind == Kind::request) {
      std::string hosted;
      for (const auto& [name, h] : handlers) hosted += (hosted.empty() ? "" : ", ") + name;
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
      auto dir = directory.join(*j);
      if (!dir) return send_reply(make_error_reply(env, dir.error(), kGraphActor));
      spdlog::info("gateway '{}': node '{}' joined at {} with {} actor(s)", opt.node, j->node, j->endpoint,
                   j->actors.size());
      out = make_envelope(GraphDirectory{std::move(*dir)}, Kind::reply, kGraphActor, env.sender);
    } else if (env.type == GraphLookup::kType) {
      out = make_envelope(GraphDirectory{directory.actors()}, Kind::reply, kGraphActor, env.sender);
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
};

Gateway::Gateway(Options options) : options_(std::move(options)), impl_(std::make_unique<Impl>(options_)) {
  endpoint_ = impl_->transport.endpoint();
}

Gateway::~Gateway() = default;

void Gateway::serve(const std::string& name, Handler handler) {
  impl_->transport.post([impl = impl_.get(), name, h = std::move(handler)]() mutable {
    impl->handlers[name] = std::move(h);
    impl->directory.serve(name);
  });
}

void Gateway::add_route(const std::string& name, const std::string& endpoint) {
  impl_->transport.post([impl = impl_.get(), name, endpoint] { impl->directory.add_route(name, endpoint); });
}

void Gateway::tell(Envelope env) {
  env.kind = Kind::tell;
  if (env.sender.empty()) env.sender = options_.node;
  impl_->transport.post([impl = impl_.get(), e = std::move(env)]() mutable { impl->dispatch(std::move(e), std::nullopt); });
}

void Gateway::request(Envelope env, std::chrono::milliseconds timeout, ReplyCallback done) {
  env.kind = Kind::request;
  env.correlation_id = impl_->pending.next_id();
  if (env.sender.empty()) env.sender = options_.node;
  PendingRequest p{std::move(done), Clock::now() + timeout, {}, "request '" + env.type + "' to '" + env.receiver + "'"};
  impl_->transport.post([impl = impl_.get(), e = std::move(env), p = std::move(p)]() mutable {
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
  impl_->transport.post([impl = impl_.get(), r = std::move(reply)]() mutable { impl->dispatch(std::move(r), std::nullopt); });
}

void Gateway::reply_error(const Envelope& request, const Error& error) {
  auto r = make_error_reply(request, error, request.receiver);
  impl_->transport.post([impl = impl_.get(), r = std::move(r)]() mutable { impl->send_reply(std::move(r)); });
}

Expected<GraphDirectory> Gateway::join(const std::string& root_endpoint, std::chrono::milliseconds timeout) {
  std::promise<Expected<Envelope>> promise;
  auto f = promise.get_future();
  impl_->transport.post([this, root_endpoint, timeout, &promise] {
    impl_->directory.set_root(root_endpoint);
    auto env = make_envelope(GraphJoin{options_.node, endpoint_, impl_->directory.local_actors()}, Kind::request,
                             options_.node, kGraphActor);
    env.correlation_id = impl_->pending.next_id();
    PendingRequest p{[&promise](Expected<Envelope> r) { promise.set_value(std::move(r)); }, Clock::now() + timeout, {},
                     "join of graph at " + root_endpoint};
    impl_->dispatch(std::move(env), std::move(p));
  });
  auto r = f.get();
  if (!r) return r.error();
  auto dir = payload_as<GraphDirectory>(*r);
  if (!dir) return dir.error();
  impl_->transport.run_sync([&] {
    impl_->directory.merge(dir->actors);
    return 0;
  });
  return dir;
}

Expected<bool> Gateway::wait_for_actor(const std::string& actor, std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  while (true) {
    if (impl_->transport.run_sync([&] { return impl_->directory.knows(actor); })) return true;
    if (impl_->transport.run_sync([&] { return impl_->directory.joined(); })) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      auto r = request(make_envelope(GraphLookup{actor}, Kind::request, options_.node, kGraphActor),
                       std::max(std::chrono::milliseconds(1), std::min(left, std::chrono::milliseconds(500))))
                   .get();
      if (r)
        if (auto dir = payload_as<GraphDirectory>(*r))
          impl_->transport.run_sync([&] {
            impl_->directory.merge(dir->actors);
            return 0;
          });
    }
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return make_error(ErrorCode::unknown_actor, "actor '" + actor + "' did not appear within " +
                                                  std::to_string(timeout.count()) + " ms");
}

GatewayStats Gateway::stats() const { return impl_->transport.stats(); }

}  // namespace kiln::messaging

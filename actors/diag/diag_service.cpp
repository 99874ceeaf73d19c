#include "actors/diag/diag_service.hpp"

#include <chrono>
#include <thread>

#include "messaging/gateway.hpp"
#include "messaging/hosting.hpp"
#include "messaging/schema.hpp"

namespace kiln::actors {

using namespace kiln::messaging;

Expected<Envelope> DiagService::handle(const Envelope& request) {
  if (request.type == Ping::kType) {
    auto ping = payload_as<Ping>(request);
    if (!ping) return ping.error();
    return make_envelope(Pong{node_, actor_, ping->note}, Kind::reply, actor_, request.sender);
  }
  if (request.type == DiagEcho::kType) {
    if (auto e = payload_as<DiagEcho>(request); !e) return e.error();
    DiagEchoResult result{node_, {}, {}};
    for (const auto& t : request.tensors) {
      result.crc32.push_back(crc32(t));
      result.nbytes.push_back(t.nbytes);
    }
    auto reply = make_envelope(result, Kind::reply, actor_, request.sender);
    reply.tensors = request.tensors;  // shares the received buffers: no copy
    return reply;
  }
  if (request.type == DiagSleep::kType) {
    auto s = payload_as<DiagSleep>(request);
    if (!s) return s.error();
    if (s->milliseconds > kMaxSleepMs)
      return make_error(ErrorCode::bad_message, "diag.sleep: field 'milliseconds' is " + std::to_string(s->milliseconds) +
                                                    ", at most " + std::to_string(kMaxSleepMs));
    std::this_thread::sleep_for(std::chrono::milliseconds(s->milliseconds));
    return make_envelope(Pong{node_, actor_, "slept"}, Kind::reply, actor_, request.sender);
  }
  return make_error(ErrorCode::unknown_type, "actor '" + actor_ + "' does not handle '" + request.type + "'");
}

void register_diag_actor_kind() { messaging::register_service_kind<DiagService>("diag"); }

}  // namespace kiln::actors

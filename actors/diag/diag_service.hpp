#pragma once
// Diagnostics service hosted by any node: answers ping (Pong), diag.echo (the same tensors
// back plus their CRC-32s) and diag.sleep (waits, then Pong: a deliberately slow actor for
// timeout and peer-loss tests). Plain class; the actor is messaging::spawn_service.
#include <string>

#include "messaging/envelope.hpp"
#include "messaging/error.hpp"

namespace kiln::actors {

class DiagService {
 public:
  /// Longest diag.sleep accepted, milliseconds (longer requests get bad_message).
  static constexpr uint32_t kMaxSleepMs = 60000;
  DiagService(std::string node, std::string actor) : node_(std::move(node)), actor_(std::move(actor)) {}
  /// Reply for `request`; unknown_type for message types it does not handle.
  messaging::Expected<messaging::Envelope> handle(const messaging::Envelope& request);

 private:
  std::string node_, actor_;
};

/// Registers actor kind "diag" (every `kiln node` can host it; call once at start-up).
void register_diag_actor_kind();

}  // namespace kiln::actors

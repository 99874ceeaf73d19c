#pragma once
// The weight-sync endpoints over the messaging layer. The sender streams a version's buckets
// as `weight_sync.bucket` requests (tensors as frames: zero-copy in one process) and then a
// `weight_sync.commit` with the manifest; the receiving service (a plain class hosted by the
// rollout side) collects, verifies and hands the verified tensors to `apply` — only when
// every checksum matches. Errors travel back as error replies naming the tensors.
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "actors/weight_sync/buckets.hpp"
#include "actors/weight_sync/messages.hpp"
#include "messaging/gateway.hpp"

namespace kiln::weight_sync {

class ReceiverService {
 public:
  using Apply = std::function<void(std::vector<messaging::Tensor> tensors, int64_t version)>;
  explicit ReceiverService(Apply apply) : apply_(std::move(apply)) {}
  /// Handles bucket and commit requests; the reply to send (ack or an error).
  messaging::Expected<messaging::Envelope> handle(const messaging::Envelope& request);

 private:
  Apply apply_;
  Receiver receiver_;
  int64_t received_ = 0;
};

/// Sends `tensors` as version `version` to actor `to` through `gateway` in buckets of
/// `bucket_bytes` (`groups`' members in one bucket each), then commits. Returns an Error
/// (timeout, peer lost, the receiver's checksum complaint) instead of throwing.
messaging::Expected<int64_t> send_weights(messaging::Gateway& gateway, const std::string& to,
                                          std::vector<messaging::Tensor> tensors, int64_t version,
                                          uint64_t bucket_bytes, std::chrono::milliseconds timeout,
                                          const TravelGroups& groups = {});

}  // namespace kiln::weight_sync

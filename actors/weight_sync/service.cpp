#include "actors/weight_sync/service.hpp"

#include "actors/weight_sync/messages.hpp"

namespace kiln::weight_sync {

using namespace kiln::messaging;

Expected<Envelope> ReceiverService::handle(const Envelope& request) {
  try {
    if (request.type == WeightSyncBucket::kType) {
      auto b = payload_as<WeightSyncBucket>(request);
      if (!b) return b.error();
      if (receiver_.version() >= 0 && receiver_.version() != b->version) {  // a new version starts over
        receiver_ = Receiver{};
        received_ = 0;
      }
      receiver_.accept(Bucket{b->version, b->index, b->count, request.tensors});
      received_ += int64_t(request.tensors.size());
      return make_envelope(WeightSyncAck{b->version, received_}, Kind::reply, request.receiver, request.sender);
    }
    if (request.type == WeightSyncCommit::kType) {
      auto c = payload_as<WeightSyncCommit>(request);
      if (!c) return c.error();
      if (c->names.size() != c->crc32.size())
        return make_error(ErrorCode::bad_message, "weight_sync.commit: names and crc32 differ in length");
      if (!receiver_.complete() || receiver_.version() != c->version)
        return make_error(ErrorCode::remote_error, "weight_sync.commit of version " + std::to_string(c->version) +
                                                       " before all its buckets arrived");
      std::map<std::string, uint32_t> manifest;
      for (std::size_t i = 0; i < c->names.size(); ++i) manifest[c->names[i]] = c->crc32[i];
      auto tensors = receiver_.verified(manifest);  // throws naming every bad tensor
      const int64_t n = int64_t(tensors.size());
      apply_(std::move(tensors), c->version);
      receiver_ = Receiver{};
      received_ = 0;
      return make_envelope(WeightSyncAck{c->version, n}, Kind::reply, request.receiver, request.sender);
    }
  } catch (const std::exception& e) {
    receiver_ = Receiver{};  // nothing half-applied; the sender may retry the version
    received_ = 0;
    return make_error(ErrorCode::remote_error, e.what());
  }
  return make_error(ErrorCode::unknown_type, "weight sync does not handle '" + request.type + "'");
}

Expected<int64_t> send_weights(Gateway& gateway, const std::string& to, std::vector<Tensor> tensors, int64_t version,
                               uint64_t bucket_bytes, std::chrono::milliseconds timeout, const TravelGroups& groups) {
  auto m = manifest(tensors);
  WeightSyncCommit commit{version, {}, {}};
  for (const auto& [name, crc] : m) {
    commit.names.push_back(name);
    commit.crc32.push_back(crc);
  }
  // All buckets in flight at once (the receiver acks each); then the commit.
  std::vector<std::future<Expected<Envelope>>> acks;
  for (auto& b : plan_buckets(std::move(tensors), bucket_bytes, version, groups)) {
    auto env = make_envelope(WeightSyncBucket{b.version, b.index, b.count}, Kind::request, "weight_sync/sender", to);
    env.tensors = std::move(b.tensors);
    acks.push_back(gateway.request(std::move(env), timeout));
  }
  for (auto& a : acks)
    if (auto r = a.get(); !r) return r.error();
  auto r = gateway.request(make_envelope(commit, Kind::request, "weight_sync/sender", to), timeout).get();
  if (!r) return r.error();
  auto ack = payload_as<WeightSyncAck>(*r);
  if (!ack) return ack.error();
  return ack->tensors;
}

}  // namespace kiln::weight_sync

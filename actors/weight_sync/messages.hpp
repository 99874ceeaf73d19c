#pragma once
// Wire schema of the weight-sync family (weight_sync.*): buckets of a policy version and the
// commit with its manifest (actors/weight_sync/service.hpp). docs/wire-format.md is the contract.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "messaging/schema.hpp"

namespace kiln::messaging {

/// Weight sync: one bucket of a new policy version; the tensors travel as tensor frames under
/// their HF names. Answered with WeightSyncAck.
struct WeightSyncBucket {
  static constexpr std::string_view kType = "weight_sync.bucket";
  static constexpr uint32_t kVersion = 1;
  int64_t version = 0;
  int64_t index = 0, count = 0;  ///< this bucket's place among the version's buckets
  MSGPACK_DEFINE_MAP(version, index, count);
};
/// Weight sync: after the last bucket, the sender's manifest (every tensor's name and CRC-32).
/// The receiver checks every received tensor against it and applies the version only if all
/// match; otherwise it answers with an error naming each tensor that differs.
struct WeightSyncCommit {
  static constexpr std::string_view kType = "weight_sync.commit";
  static constexpr uint32_t kVersion = 1;
  int64_t version = 0;
  std::vector<std::string> names;
  std::vector<uint32_t> crc32;
  MSGPACK_DEFINE_MAP(version, names, crc32);
};
struct WeightSyncAck {
  static constexpr std::string_view kType = "weight_sync.ack";
  static constexpr uint32_t kVersion = 1;
  int64_t version = 0;
  int64_t tensors = 0;  ///< received so far in this version
  MSGPACK_DEFINE_MAP(version, tensors);
};

/// Every type above is spoken by a program that includes this header.
inline const bool kWeightSyncMessages = declare_message_types<WeightSyncBucket, WeightSyncCommit, WeightSyncAck>();

}  // namespace kiln::messaging

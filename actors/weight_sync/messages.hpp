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

/// Collective weight sync (SGLang's init_weights_update_group): join the broadcast group whose
/// c10d TCPStore is served by the trainer at host:port, as `rank` of `world` (rank 0: the
/// trainer; NCCL when the engine is on CUDA, Gloo on CPU); `generation` names the group (a
/// new one after an engine restart). Leaves a previous group. Answered with WeightSyncAck
/// (version -1) once the group is formed.
struct WeightSyncJoinGroup {
  static constexpr std::string_view kType = "weight_sync.join_group";
  static constexpr uint32_t kVersion = 2;
  std::string host;
  int64_t port = 0, rank = 0, world = 0, generation = 0;
  int64_t timeout_ms = 300000;             ///< forming the group
  int64_t collective_timeout_ms = 600000;  ///< every broadcast (v2)
  MSGPACK_DEFINE_MAP(host, port, rank, world, generation, timeout_ms, collective_timeout_ms);
};
/// Collective weight sync (SGLang's update_weights_from_distributed): version `version` arrives
/// from rank 0 of the joined group as one broadcast per bucket (a flat byte buffer of
/// bucket_bytes[b] holding the tensors buckets[b], kiln names, in order, each nbytes[i] bytes
/// in the engine model's own layout and dtype), each followed by a broadcast of the bucket's
/// checksums (int64, kernels/checksum.hpp). The engine checks each bucket before writing it
/// into its weights in place. Answered with WeightSyncAck once every bucket is in; an error
/// names the tensors that were missing, of another size or whose checksum differed.
struct WeightSyncCollective {
  static constexpr std::string_view kType = "weight_sync.collective";
  static constexpr uint32_t kVersion = 1;
  int64_t version = 0;
  std::vector<std::vector<std::string>> buckets;
  std::vector<int64_t> bucket_bytes;
  std::vector<int64_t> nbytes;  ///< per tensor, in bucket order
  MSGPACK_DEFINE_MAP(version, buckets, bucket_bytes, nbytes);
};

/// Every type above is spoken by a program that includes this header.
inline const bool kWeightSyncMessages = declare_message_types<WeightSyncBucket, WeightSyncCommit, WeightSyncAck, WeightSyncJoinGroup, WeightSyncCollective>();

}  // namespace kiln::messaging

#pragma once
// Test helpers: frames of an envelope as a sender would put them on the wire, and a raw
// ZeroMQ client (an outside program) that talks to a gateway.
#include <random>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "messaging/envelope.hpp"
#include "messaging/schema.hpp"

namespace kiln::test {

/// Frames of `env` (header + one frame per tensor, pointing at the tensors' bytes).
inline std::vector<messaging::Frame> frames_of(const messaging::Envelope& env, std::string& header_storage) {
  header_storage = messaging::encode_header(env);
  std::vector<messaging::Frame> f;
  f.push_back({reinterpret_cast<const std::byte*>(header_storage.data()), header_storage.size(), nullptr});
  for (const auto& t : env.tensors) f.push_back({t.data, t.nbytes, t.owner});
  return f;
}

/// A tensor of random bytes.
inline messaging::Tensor random_tensor(std::string name, messaging::DType dtype, std::vector<int64_t> shape,
                                       std::mt19937_64& rng) {
  auto t = messaging::Tensor::zeros(std::move(name), dtype, std::move(shape));
  for (std::size_t i = 0; i < t.nbytes; ++i) t.mutable_data()[i] = std::byte(rng() & 0xff);
  return t;
}

/// A raw ZeroMQ DEALER (an outside client) connected to `endpoint`, 3 s receive timeout.
inline zmq::socket_t raw_dealer(zmq::context_t& ctx, const std::string& endpoint) {
  zmq::socket_t s(ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::rcvtimeo, 3000);
  s.set(zmq::sockopt::linger, 0);
  s.connect(endpoint);
  return s;
}

/// The single frame of a reply, decoded.
inline messaging::Expected<messaging::Envelope> decode_reply(const zmq::message_t& reply) {
  std::vector<messaging::Frame> frames{{static_cast<const std::byte*>(reply.data()), reply.size(), nullptr}};
  return messaging::decode(frames);
}

}  // namespace kiln::test

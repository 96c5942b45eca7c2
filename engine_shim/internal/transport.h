// The shim's link to leapd, behind an interface: the Client speaks the
// leap.v1 Connect messages over whichever transport the endpoint names
// (gRPC: "host:port", "unix:///path"; shared memory: "shm:///path").
#ifndef LEAP_ENGINE_SHIM_INTERNAL_TRANSPORT_H_
#define LEAP_ENGINE_SHIM_INTERNAL_TRANSPORT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"
#include "absl/time/time.h"
#include "leap/v1/predictor.pb.h"

namespace leap::shim {

// One open connection. Send may be called from one thread while Receive
// runs on another; Close may be called from any thread.
class Transport {
 public:
  virtual ~Transport() = default;
  // False when the connection is broken.
  virtual bool Send(const leap::v1::EngineMessage& m) = 0;
  // Blocks for the next message; false when the connection has ended.
  virtual bool Receive(leap::v1::SidecarMessage* m) = 0;
  // Ends the connection; unblocks Receive.
  virtual void Close() = 0;
};

// Settings only some transports use.
struct TransportOptions {
  // shm: feature slots and ring bytes asked of leapd (see ShmChannelOptions).
  uint32_t shm_slots = 1024;
  uint32_t shm_ring_bytes = 1 << 20;
  // gRPC over TCP with TLS: PEM files of the CA that signed leapd's
  // certificate and, for mutual TLS (leapd --tls_client_ca), this engine's
  // certificate chain and key. All empty: plaintext.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
};

// Channel credentials for `o`'s TLS files (plaintext when none is set);
// InvalidArgument naming a file that cannot be read.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const TransportOptions& o);

// OK when `endpoint` names a transport Dial knows: "shm:///abs/path",
// "unix:///abs/path" (or "unix:path", "unix-abstract:name"),
// "dns:///host:port", "ipv4:..." /
// "ipv6:..." or a plain "host:port". Anything else (e.g. "http://foo", a
// URL gRPC would try to resolve forever) is InvalidArgument naming the
// endpoint and the forms accepted.
absl::Status CheckEndpoint(const std::string& endpoint);

// Opens a connection to `endpoint`, waiting at most `timeout` for it:
// "shm:///path" attaches to leapd's shared-memory socket at /path (on the
// hello, which carries dim and dtype); "unix:///path" and "host:port" open
// a gRPC Connect stream.
absl::StatusOr<std::unique_ptr<Transport>> Dial(
    const std::string& endpoint, absl::Duration timeout,
    const TransportOptions& options = TransportOptions());

}  // namespace leap::shim

#endif  // LEAP_ENGINE_SHIM_INTERNAL_TRANSPORT_H_

// Real NATS JetStream servers for multi-process tests: Debian's nats-server
// started as child processes with JetStream on file storage in a temp dir,
// on free loopback ports: one node, or a cluster of N (cluster routes to
// every node, server names n0..n<N-1>). A node can be kill -9'd and
// restarted by index on the same ports and store; everything is stopped by
// the destructor (and each server gets SIGTERM if the test process dies).
// Test-only.
#ifndef LEAP_TESTS_SUPPORT_NATS_CLUSTER_H_
#define LEAP_TESTS_SUPPORT_NATS_CLUSTER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/process.h"

namespace leap::testing {

struct NatsClusterOptions {
  // Number of servers; 1 runs a single server without cluster routes.
  int nodes = 3;
  // Where configs, logs and JetStream stores go (created; must be set).
  std::string dir;
  std::string server_path = "/usr/sbin/nats-server";
  // How long Start/Restart wait for readiness.
  absl::Duration ready_timeout = absl::Seconds(30);
};

// Not thread-safe: one test thread drives it.
class NatsCluster {
 public:
  // Starts every node and waits until the cluster is ready (WaitReady).
  static absl::StatusOr<std::unique_ptr<NatsCluster>> Start(
      NatsClusterOptions options);
  ~NatsCluster();
  NatsCluster(const NatsCluster&) = delete;
  NatsCluster& operator=(const NatsCluster&) = delete;

  int size() const { return static_cast<int>(nodes_.size()); }
  // nats://127.0.0.1:PORT of node i.
  std::string url(int i) const;
  // Every node's url, comma-separated (leapd --fleet's form).
  std::string urls() const;
  // 127.0.0.1:PORT of node i's monitoring endpoint.
  std::string monitor(int i) const;
  std::string name(int i) const;
  bool running(int i) const { return nodes_[i].proc != nullptr; }
  // Node i's process while it runs (else null): for signals Kill does not
  // send, such as SIGSTOP / SIGCONT (Kill and the destructor end a stopped
  // node too).
  client::Process* process(int i) const { return nodes_[i].proc.get(); }
  // The server's recent log lines (stderr), for failure messages.
  std::string Tail(int i) const;

  // kill -9 of node i; returns once it is reaped.
  absl::Status Kill(int i);
  // Starts node i again (same ports, same store) and waits for readiness.
  absl::Status Restart(int i);
  // Waits until every running node answers /healthz?js-enabled=true with
  // "ok" and, in a cluster, reports a JetStream meta leader and all of its
  // routes to the other running nodes.
  absl::Status WaitReady(absl::Duration timeout);

 private:
  struct Node {
    int client_port = 0;
    int cluster_port = 0;
    int http_port = 0;
    std::string config;
    std::unique_ptr<client::Process> proc;
  };
  explicit NatsCluster(NatsClusterOptions options)
      : options_(std::move(options)) {}
  absl::Status Launch(int i);
  absl::Status NodeReady(int i) const;

  NatsClusterOptions options_;
  std::vector<Node> nodes_;
};

// A free TCP port on 127.0.0.1 (bound then released: the caller binds it
// soon after).
absl::StatusOr<int> FreeLoopbackPort();

}  // namespace leap::testing

#endif  // LEAP_TESTS_SUPPORT_NATS_CLUSTER_H_

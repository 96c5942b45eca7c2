#include "tests/support/nats_cluster.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "tests/support/process.h"

namespace leap::testing {

absl::StatusOr<int> FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError(std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const std::string err = std::strerror(errno);
    close(fd);
    return absl::InternalError(absl::StrCat("bind 127.0.0.1:0: ", err));
  }
  close(fd);
  return static_cast<int>(ntohs(addr.sin_port));
}

absl::StatusOr<std::unique_ptr<NatsCluster>> NatsCluster::Start(
    NatsClusterOptions options) {
  if (options.nodes < 1) return absl::InvalidArgumentError("nodes < 1");
  if (options.dir.empty()) return absl::InvalidArgumentError("dir not set");
  std::error_code ec;
  std::filesystem::create_directories(options.dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(options.dir, ": ", ec.message()));
  // A port taken between FreeLoopbackPort and the server's bind makes the
  // server exit: try again with other ports.
  absl::Status last;
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::unique_ptr<NatsCluster> c(new NatsCluster(options));
    c->nodes_.resize(options.nodes);
    for (Node& n : c->nodes_) {
      for (int* port : {&n.client_port, &n.cluster_port, &n.http_port}) {
        auto p = FreeLoopbackPort();
        if (!p.ok()) return p.status();
        *port = *p;
      }
    }
    last = absl::OkStatus();
    for (int i = 0; i < options.nodes && last.ok(); ++i) last = c->Launch(i);
    if (last.ok()) last = c->WaitReady(options.ready_timeout);
    if (last.ok()) return c;
    bool port_clash = false;
    for (int i = 0; i < options.nodes; ++i) {
      port_clash |= c->Tail(i).find("address already in use") != std::string::npos;
    }
    if (!port_clash) break;
  }
  return last;
}

NatsCluster::~NatsCluster() {
  for (Node& n : nodes_) {
    if (n.proc == nullptr) continue;
    n.proc->Signal(SIGKILL);
    n.proc->Wait();
    n.proc.reset();
  }
}

std::string NatsCluster::url(int i) const {
  return absl::StrCat("nats://127.0.0.1:", nodes_[i].client_port);
}

std::string NatsCluster::urls() const {
  std::vector<std::string> all;
  for (int i = 0; i < size(); ++i) all.push_back(url(i));
  return absl::StrJoin(all, ",");
}

std::string NatsCluster::name(int i) const { return absl::StrCat("n", i); }

std::string NatsCluster::monitor(int i) const {
  return absl::StrCat("127.0.0.1:", nodes_[i].http_port);
}

std::string NatsCluster::Tail(int i) const {
  if (nodes_[i].proc == nullptr) return "(not running)";
  return nodes_[i].proc->Tail();
}

absl::Status NatsCluster::Launch(int i) {
  Node& n = nodes_[i];
  const std::string store = absl::StrCat(options_.dir, "/", name(i), "-store");
  n.config = absl::StrCat(options_.dir, "/", name(i), ".conf");
  std::string conf = absl::StrCat(
      "server_name: ", name(i), "\n",
      "listen: 127.0.0.1:", n.client_port, "\n",
      "http: 127.0.0.1:", n.http_port, "\n",
      "jetstream {\n  store_dir: \"", store, "\"\n}\n");
  if (size() > 1) {
    std::vector<std::string> routes;
    for (const Node& other : nodes_) {
      routes.push_back(absl::StrCat("nats-route://127.0.0.1:", other.cluster_port));
    }
    absl::StrAppend(&conf, "cluster {\n  name: leap-test\n  listen: 127.0.0.1:",
                    n.cluster_port, "\n  routes: [", absl::StrJoin(routes, ", "),
                    "]\n}\n");
  }
  {
    std::ofstream f(n.config, std::ios::trunc);
    f << conf;
    if (!f) return absl::InternalError(absl::StrCat("cannot write ", n.config));
  }
  client::ProcessOptions po;
  po.merge_stderr = true;
  po.die_with_parent = true;
  po.kept_lines = 200;
  auto p = client::Process::Start({options_.server_path, "-c", n.config}, po);
  if (!p.ok()) return p.status();
  n.proc = std::move(*p);
  return absl::OkStatus();
}

absl::Status NatsCluster::NodeReady(int i) const {
  auto health = HttpGet(monitor(i), "/healthz?js-enabled=true");
  if (!health.ok()) return health.status();
  if (health->find("\"ok\"") == std::string::npos) {
    return absl::UnavailableError(absl::StrCat(name(i), " healthz: ", *health));
  }
  if (size() == 1) return absl::OkStatus();
  // A meta leader is known, and routes to every other running node.
  auto jsz = HttpGet(monitor(i), "/jsz");
  if (!jsz.ok()) return jsz.status();
  if (jsz->find("\"leader\"") == std::string::npos) {
    return absl::UnavailableError(absl::StrCat(name(i), ": no meta leader"));
  }
  auto routez = HttpGet(monitor(i), "/routez");
  if (!routez.ok()) return routez.status();
  int others = 0;
  for (int j = 0; j < size(); ++j) others += (j != i && running(j)) ? 1 : 0;
  // A route to each: the distinct peers' server ids among the routes (a
  // node may briefly hold two routes to a peer that restarted, the old one
  // not yet closed, so the route count alone could hide a missing peer).
  const std::string kKey = "\"remote_id\": \"";
  std::set<std::string> peers;
  for (size_t at = routez->find(kKey); at != std::string::npos;
       at = routez->find(kKey, at + 1)) {
    const size_t from = at + kKey.size();
    const size_t to = routez->find('"', from);
    if (to == std::string::npos) break;
    peers.insert(routez->substr(from, to - from));
  }
  if (static_cast<int>(peers.size()) < others) {
    return absl::UnavailableError(
        absl::StrCat(name(i), ": routes to ", peers.size(), " peers, want ", others));
  }
  return absl::OkStatus();
}

absl::Status NatsCluster::WaitReady(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration pause = absl::Milliseconds(5);
  while (true) {
    absl::Status st = absl::OkStatus();
    for (int i = 0; i < size() && st.ok(); ++i) {
      if (running(i)) st = NodeReady(i);
    }
    if (st.ok()) return st;
    if (absl::Now() > deadline) {
      std::string logs;
      for (int i = 0; i < size(); ++i) {
        absl::StrAppend(&logs, "\n", name(i), ": ", Tail(i));
      }
      return absl::DeadlineExceededError(
          absl::StrCat("nats cluster not ready: ", st.message(), logs));
    }
    // Polling an HTTP endpoint: nats-server offers no readiness event to
    // block on. Bounded backoff, checked against the deadline.
    std::this_thread::sleep_for(absl::ToChronoMilliseconds(pause));
    pause = std::min(pause * 2, absl::Milliseconds(100));
  }
}

absl::Status NatsCluster::Kill(int i) {
  if (nodes_[i].proc == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(name(i), " not running"));
  }
  nodes_[i].proc->Signal(SIGKILL);
  nodes_[i].proc->Wait();
  nodes_[i].proc.reset();
  return absl::OkStatus();
}

absl::Status NatsCluster::Restart(int i) {
  if (nodes_[i].proc != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(name(i), " running"));
  }
  absl::Status st = Launch(i);
  if (!st.ok()) return st;
  return WaitReady(options_.ready_timeout);
}

}  // namespace leap::testing

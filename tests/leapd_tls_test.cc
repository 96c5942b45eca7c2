// TLS, mutual TLS and the admin token before the body, end to end with
// certificates made at test time by Debian's openssl (a CA, a server
// certificate for 127.0.0.1/localhost, a client certificate, a client
// certificate from another CA, and a second CA with its own server
// certificate for the reload check). A real leapd on TCP port 0 with
// --tls_cert/--tls_key/--tls_client_ca plus a unix socket:
//  - a plaintext client is refused on the TLS port; the unix socket stays
//    plaintext;
//  - a client without a certificate, or with one from another CA, is
//    refused; the right one is served;
//  - leapctl (flags and $LEAP_TLS_*) and the shim's Client connect with
//    certificates;
//  - an Admin call without the token whose message is larger than
//    --max_message_bytes gets UNAUTHENTICATED (with the token the same
//    call gets RESOURCE_EXHAUSTED: the token is checked first), over TLS
//    and over plaintext TCP, and leapd's RSS does not grow by the message;
//  - replacing the certificate files: new connections get the new
//    certificate (verified against the new CA, refused by the old one).
//  - --shm_group: the shm attach socket and an attached engine's segment
//    belong to the group with mode 0660; (as root) a process of another
//    user in that group may connect to the socket, one outside it may not;
//    an unknown group stops leapd at start.
#include <grp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "engine_shim/client.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "leap/v1/admin.grpc.pb.h"
#include "tests/leapctl_test_util.h"
#include "tests/outbox_test_util.h"
#include "tests/support/process.h"

#ifndef LEAPD_PATH
#error "LEAPD_PATH must name the leapd binary"
#endif

namespace leap::leapctl_test {
namespace {

namespace pb = ::leap::v1;
using ::testing::HasSubstr;

constexpr char kToken[] = "tls-test-admin-token-0123456789";
constexpr int64_t kDim = 8;
constexpr int64_t kMaxMessage = 4 << 20;  // --max_message_bytes

int Sh(const std::string& cmd) { return std::system(cmd.c_str()); }

// Certificates in `dir`: ca, server (SAN 127.0.0.1, localhost), client,
// rogue-ca + rogue (a client certificate from another CA), ca2 + server2.
void MakeCertificates(const ScratchDir& dir) {
  const std::string d = dir.path();
  const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  auto ca = [&](const std::string& name) {
    ASSERT_EQ(Sh("cd " + d + " && openssl req -x509 " + key + " -keyout " +
                 name + ".key -out " + name + ".pem -days 2 -subj /CN=" + name +
                 " 2>/dev/null"),
              0);
  };
  auto leaf = [&](const std::string& name, const std::string& ca_name,
                  const std::string& ext) {
    WriteFile(dir.File(name + ".ext"), ext + "\n");
    ASSERT_EQ(Sh("cd " + d + " && openssl req " + key + " -keyout " + name +
                 ".key -out " + name + ".csr -subj /CN=" + name +
                 " 2>/dev/null && openssl x509 -req -in " + name + ".csr -CA " +
                 ca_name + ".pem -CAkey " + ca_name + ".key -CAcreateserial -out " +
                 name + ".pem -days 2 -extfile " + name + ".ext 2>/dev/null"),
              0);
  };
  const std::string server_ext =
      "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth";
  const std::string client_ext = "extendedKeyUsage=clientAuth";
  ca("ca");
  ca("rogue-ca");
  ca("ca2");
  leaf("server", "ca", server_ext);
  leaf("client", "ca", client_ext);
  leaf("rogue", "rogue-ca", client_ext);
  leaf("server2", "ca2", server_ext);
}

std::shared_ptr<grpc::Channel> TlsChannel(const ScratchDir& dir,
                                          const std::string& address,
                                          const std::string& ca,
                                          const std::string& client) {
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = ReadFile(dir.File(ca + ".pem"));
  if (!client.empty()) {
    o.pem_cert_chain = ReadFile(dir.File(client + ".pem"));
    o.pem_private_key = ReadFile(dir.File(client + ".key"));
  }
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a new connection
  args.SetMaxSendMessageSize(INT_MAX);
  return grpc::CreateCustomChannel(address, grpc::SslCredentials(o), args);
}

std::shared_ptr<grpc::Channel> PlainChannel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxSendMessageSize(INT_MAX);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(),
                                   args);
}

// gRPC health Check over `channel` (5 s deadline).
grpc::Status Health(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  return stub->Check(&ctx, req, &resp);
}

// CreateReadout carrying an artifact of `bytes` bytes.
grpc::Status BigCreate(const std::shared_ptr<grpc::Channel>& channel,
                       int64_t bytes, bool with_token) {
  auto admin = pb::Admin::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  if (with_token) ctx.AddMetadata("authorization", std::string("Bearer ") + kToken);
  pb::CreateReadoutRequest req;
  req.set_name("big");
  req.set_artifact(std::string(static_cast<size_t>(bytes), 'a'));
  pb::ReadoutInfo info;
  return admin->CreateReadout(&ctx, req, &info);
}

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MakeCertificates(dir_);
    if (HasFatalFailure()) return;
    // The files leapd watches (replaced in the reload test).
    std::filesystem::copy_file(dir_.File("server.pem"), dir_.File("live.pem"));
    std::filesystem::copy_file(dir_.File("server.key"), dir_.File("live.key"));
    WriteFile(dir_.File("admin.token"), std::string(kToken) + "\n");
    unix_address_ = "unix://" + dir_.File("leapd.sock");
    auto p = testing::StartLeapd(
        LEAPD_PATH,
        {"--listen=127.0.0.1:0", "--listen=" + unix_address_,
         "--metrics_listen=127.0.0.1:0",
         "--tls_cert=" + dir_.File("live.pem"),
         "--tls_key=" + dir_.File("live.key"),
         "--tls_client_ca=" + dir_.File("ca.pem"), "--tls_reload_interval=1s",
         "--admin_token_file=" + dir_.File("admin.token"),
         absl::StrCat("--max_message_bytes=", kMaxMessage)},
        &tcp_address_);
    ASSERT_TRUE(p.ok()) << p.status();
    leapd_ = std::move(*p);
    ASSERT_TRUE(
        testing::CreateDefaultReadout(unix_address_, "r", kDim).ok());
  }

  ScratchDir dir_;
  std::string tcp_address_, unix_address_;
  std::unique_ptr<testing::Process> leapd_;
};

TEST_F(TlsTest, PlaintextAndWrongCertificatesRefused) {
  grpc::Status plain = Health(PlainChannel(tcp_address_));
  EXPECT_EQ(plain.error_code(), grpc::StatusCode::UNAVAILABLE)
      << plain.error_message();
  grpc::Status no_cert = Health(TlsChannel(dir_, tcp_address_, "ca", ""));
  EXPECT_EQ(no_cert.error_code(), grpc::StatusCode::UNAVAILABLE)
      << no_cert.error_message();
  grpc::Status rogue = Health(TlsChannel(dir_, tcp_address_, "ca", "rogue"));
  EXPECT_EQ(rogue.error_code(), grpc::StatusCode::UNAVAILABLE)
      << rogue.error_message();
  // A client that trusts another CA refuses leapd's certificate.
  grpc::Status wrong_root =
      Health(TlsChannel(dir_, tcp_address_, "rogue-ca", "client"));
  EXPECT_EQ(wrong_root.error_code(), grpc::StatusCode::UNAVAILABLE);

  grpc::Status good = Health(TlsChannel(dir_, tcp_address_, "ca", "client"));
  EXPECT_TRUE(good.ok()) << good.error_message();
  grpc::Status unix_plain = Health(PlainChannel(unix_address_));
  EXPECT_TRUE(unix_plain.ok()) << unix_plain.error_message();
}

TEST_F(TlsTest, LeapctlConnectsWithCertificates) {
  const std::vector<std::string> base = {
      "readouts", "list", "--server", tcp_address_, "--token-file",
      dir_.File("admin.token"), "--timeout", "5"};
  RunResult plain = RunLeapctl(dir_, base);
  EXPECT_NE(plain.exit_code, 0) << Describe(plain);
  EXPECT_THAT(plain.err, HasSubstr("UNAVAILABLE"));

  std::vector<std::string> tls = base;
  for (const char* a : {"--tls-ca", "ca.pem", "--tls-cert", "client.pem",
                        "--tls-key", "client.key"}) {
    tls.push_back(a[0] == '-' ? std::string(a) : dir_.File(a));
  }
  RunResult ok = RunLeapctl(dir_, tls);
  EXPECT_EQ(ok.exit_code, 0) << Describe(ok);
  EXPECT_THAT(ok.out, HasSubstr("r"));

  std::vector<std::string> rogue = base;
  for (const char* a : {"--tls-ca", "ca.pem", "--tls-cert", "rogue.pem",
                        "--tls-key", "rogue.key"}) {
    rogue.push_back(a[0] == '-' ? std::string(a) : dir_.File(a));
  }
  RunResult refused = RunLeapctl(dir_, rogue);
  EXPECT_NE(refused.exit_code, 0) << Describe(refused);

  // The same from the environment.
  setenv("LEAP_TLS_CA", dir_.File("ca.pem").c_str(), 1);
  setenv("LEAP_TLS_CERT", dir_.File("client.pem").c_str(), 1);
  setenv("LEAP_TLS_KEY", dir_.File("client.key").c_str(), 1);
  RunResult env = RunLeapctl(dir_, base);
  unsetenv("LEAP_TLS_CA");
  unsetenv("LEAP_TLS_CERT");
  unsetenv("LEAP_TLS_KEY");
  EXPECT_EQ(env.exit_code, 0) << Describe(env);
}

TEST_F(TlsTest, ShimClientConnectsWithCertificates) {
  auto start = [&](const std::string& cert) {
    shim::ClientOptions o;
    o.endpoint = tcp_address_;
    o.engine_id = "tls-engine";
    o.dim = kDim;
    o.tls_ca_file = dir_.File("ca.pem");
    o.tls_cert_file = dir_.File(cert + ".pem");
    o.tls_key_file = dir_.File(cert + ".key");
    auto c = shim::Client::Start(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  };
  std::unique_ptr<shim::Client> rogue = start("rogue");
  ASSERT_NE(rogue, nullptr);
  std::unique_ptr<shim::Client> client = start("client");
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->WaitConnected(absl::Seconds(30)));

  shim::CapturedFeatures f;
  f.request_id = "tls-1";
  std::vector<float> x(kDim, 0.5f);
  f.bytes.assign(reinterpret_cast<const char*>(x.data()), x.size() * 4);
  client->Submit({f});
  bool predicted = false;
  for (absl::Time d = absl::Now() + absl::Seconds(30);
       !predicted && absl::Now() < d;) {
    for (const shim::Event& e : client->Poll()) {
      if (e.kind == shim::Event::Kind::kPrediction && e.request_id == "tls-1") {
        predicted = true;
      }
    }
    if (!predicted) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(predicted);
  // The client with another CA's certificate never got in.
  EXPECT_FALSE(rogue->connected());
  EXPECT_EQ(rogue->stats().connects, 0);
}

TEST_F(TlsTest, AdminTokenCheckedBeforeTheBody) {
  auto channel = TlsChannel(dir_, tcp_address_, "ca", "client");
  const int64_t rss_before = outbox_test::RssKiB(leapd_->pid());
  // 16x the limit, no token: refused on its metadata.
  grpc::Status s = BigCreate(channel, 16 * kMaxMessage, false);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << s.error_message();
  const int64_t rss_after = outbox_test::RssKiB(leapd_->pid());
  std::printf("unauthenticated %lld-byte call: leapd VmRSS %lld -> %lld KiB\n",
              static_cast<long long>(16 * kMaxMessage),
              static_cast<long long>(rss_before),
              static_cast<long long>(rss_after));
  EXPECT_LT(rss_after - rss_before, 16 * kMaxMessage / 1024 / 2);
  // With the token the same call reaches the size limit.
  s = BigCreate(channel, 16 * kMaxMessage, true);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << s.error_message();
}

TEST(TlsPlainTest, AdminTokenCheckedBeforeTheBodyOverPlaintextTcp) {
  ScratchDir dir;
  WriteFile(dir.File("admin.token"), std::string(kToken) + "\n");
  std::string address;
  auto p = testing::StartLeapd(
      LEAPD_PATH,
      {"--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
       "--admin_token_file=" + dir.File("admin.token"),
       absl::StrCat("--max_message_bytes=", kMaxMessage)},
      &address);
  ASSERT_TRUE(p.ok()) << p.status();
  grpc::Status s = BigCreate(PlainChannel(address), 16 * kMaxMessage, false);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << s.error_message();
  s = BigCreate(PlainChannel(address), 16 * kMaxMessage, true);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << s.error_message();
  // Predictor calls are not affected by the token.
  EXPECT_TRUE(Health(PlainChannel(address)).ok());
}

TEST_F(TlsTest, CertificateFilesReloaded) {
  ASSERT_TRUE(Health(TlsChannel(dir_, tcp_address_, "ca", "client")).ok());
  // Replace the served certificate with one from ca2 (each file by rename).
  std::filesystem::copy_file(dir_.File("server2.pem"), dir_.File("next.pem"));
  std::filesystem::copy_file(dir_.File("server2.key"), dir_.File("next.key"));
  std::filesystem::rename(dir_.File("next.key"), dir_.File("live.key"));
  std::filesystem::rename(dir_.File("next.pem"), dir_.File("live.pem"));
  bool reloaded = false;
  for (absl::Time d = absl::Now() + absl::Seconds(30);
       !reloaded && absl::Now() < d;
       absl::SleepFor(absl::Milliseconds(100))) {
    reloaded = Health(TlsChannel(dir_, tcp_address_, "ca2", "client")).ok();
  }
  EXPECT_TRUE(reloaded) << "new connections never saw the new certificate";
  grpc::Status old_ca = Health(TlsChannel(dir_, tcp_address_, "ca", "client"));
  EXPECT_EQ(old_ca.error_code(), grpc::StatusCode::UNAVAILABLE);
}

// connect() to the unix socket `path` from a child running as uid 65534
// with primary group `gid` and no other groups; the child's errno (0: ok).
int ConnectAs(const std::string& path, gid_t gid) {
  const pid_t pid = fork();
  if (pid == 0) {
    if (setgroups(0, nullptr) != 0 || setgid(gid) != 0 || setuid(65534) != 0) {
      _exit(100);
    }
    const int fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
    const int rc = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    _exit(rc == 0 ? 0 : (errno & 0x7f));
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(ShmGroupTest, SocketAndSegmentsBelongToTheGroup) {
  ScratchDir dir;
  group* daemon_group = getgrnam("daemon");
  ASSERT_NE(daemon_group, nullptr);
  const gid_t gid = daemon_group->gr_gid;
  chmod(dir.path().c_str(), 0711);  // others may reach the socket by name
  const std::string shm = dir.File("leap.shm");
  const std::string sock = "unix://" + dir.File("leapd.sock");
  std::string address;
  auto p = testing::StartLeapd(
      LEAPD_PATH,
      {"--listen=" + sock, "--metrics_listen=", "--shm=" + shm,
       "--shm_group=daemon"},
      &address);
  ASSERT_TRUE(p.ok()) << p.status();
  struct stat st;
  ASSERT_EQ(stat(shm.c_str(), &st), 0);
  EXPECT_EQ(st.st_gid, gid);
  EXPECT_EQ(st.st_mode & 0777, 0660u);

  ASSERT_TRUE(testing::CreateDefaultReadout(sock, "r", kDim).ok());
  shim::ClientOptions o;
  o.endpoint = "shm://" + shm;
  o.dim = kDim;
  auto c = shim::Client::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE((*c)->WaitConnected(absl::Seconds(30)));
  int segments = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    const std::string name = e.path().filename().string();
    if (name.size() < 4 || name.substr(name.size() - 4) != ".seg") continue;
    ++segments;
    ASSERT_EQ(stat(e.path().c_str(), &st), 0);
    EXPECT_EQ(st.st_gid, gid) << name;
    EXPECT_EQ(st.st_mode & 0777, 0660u) << name;
  }
  EXPECT_EQ(segments, 1);

  if (geteuid() == 0) {
    EXPECT_EQ(ConnectAs(shm, gid), 0) << "a member of the group";
    EXPECT_EQ(ConnectAs(shm, 65534), EACCES) << "a user outside the group";
  }
}

TEST(ShmGroupTest, UnknownGroupRefused) {
  ScratchDir dir;
  auto p = testing::Process::Start(
      {LEAPD_PATH, "--listen=unix://" + dir.File("s"), "--metrics_listen=",
       "--shm=" + dir.File("leap.shm"), "--shm_group=no-such-group-leap"});
  ASSERT_TRUE(p.ok()) << p.status();
  const int status = (*p)->Wait();
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
}

}  // namespace
}  // namespace leap::leapctl_test

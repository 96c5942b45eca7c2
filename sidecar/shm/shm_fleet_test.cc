// The shared-memory server in fleet mode, in process: a Core over a real
// RocksDB store with a real FleetMember connected to a real nats-server
// started by the test (-js, file storage in a temp dir, a free loopback
// port), and an engine_shim ShmChannel attached to the server. A completions
// frame is answered only after JetStream acknowledged it, and while its
// answer waits (the nats-server stopped with SIGSTOP) the loop goes on
// answering predictions on the same ring; once the server runs again the
// completion is acknowledged and is in the FEEDBACK stream.
// With NATS gone completions are refused UNAVAILABLE while predictions go on;
// the shim's Client keeps such a completion and resends it by itself until
// it is acknowledged (over shm and over gRPC), stored once.
// A completion resent while its first publish awaits JetStream does not hold
// the loop either: it is answered with that publish, and stored once.
// Fails when /usr/sbin/nats-server is missing (scripts/install-deps).
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/process.h"
#include "engine_shim/client.h"
#include "engine_shim/shm_channel.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "sidecar/fleet/member.h"
#include "sidecar/grpc/predictor_service.h"
#include "sidecar/shm/shm_server.h"
#include "storage/rocksdb_store.h"
#include "tests/support/readout_fixtures.h"
#include "tests/support/scoped_temp_dir.h"

namespace leap::sidecar {
namespace {

namespace pb = ::leap::v1;

constexpr char kNatsServer[] = "/usr/sbin/nats-server";
constexpr int64_t kDim = 16;
constexpr absl::Duration kDeadline = absl::Seconds(30);

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  close(fd);
  return port;
}

class ShmFleetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(std::filesystem::exists(kNatsServer))
        << kNatsServer << " missing (scripts/install-deps installs nats-server)";
    // A short name: the shm path must fit a unix socket path.
    tmp_ = std::make_unique<::leap::testing::ScopedTempDir>("shm_fleet_test");
    dir_ = tmp_->path();
    std::filesystem::create_directories(dir_ / "js");
    port_ = FreePort();
    client::ProcessOptions po;
    po.merge_stderr = true;
    po.die_with_parent = true;
    auto p = client::Process::Start(
        {kNatsServer, "-js", "-sd", (dir_ / "js").string(), "-a", "127.0.0.1",
         "-p", std::to_string(port_)},
        po);
    ASSERT_TRUE(p.ok()) << p.status();
    nats_ = std::move(*p);

    auto st = storage::OpenRocksStore((dir_ / "m").string(), {});
    ASSERT_TRUE(st.ok()) << st.status();
    store_ = std::move(*st);
    auto loaded = store_->Load();
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    CoreOptions co;
    co.readout.serving_only = true;
    core_ = std::make_unique<Core>(co, &metrics_, store_.get());
    ASSERT_TRUE(core_->Recover(std::move(*loaded)).ok());
    fleet::FleetMemberOptions fo;
    fo.nats.servers = {absl::StrCat("nats://127.0.0.1:", port_)};
    fo.fleet = "shm";
    fo.member = "m";
    // JetStream's acknowledgement timeout well beyond the time the test
    // keeps the server stopped.
    fo.nats.timeout_ms = nats_timeout_ms_;
    fo.on_degraded = [this](bool d) {
      absl::MutexLock l(&mu_);
      degraded_ = d;
    };
    auto f = fleet::FleetMember::Create(core_.get(), fo);
    ASSERT_TRUE(f.ok()) << f.status();
    fleet_ = std::move(*f);
    core_->SetFleet(fleet_.get());
    ASSERT_TRUE(fleet_->Start({}, 20'000).ok());
    state_ = testing::RandomState(kDim, 41);
    ASSERT_TRUE(fleet_->CreateReadout("chat", state_).ok());
    Route route;
    route.arms.push_back({"chat", "chat", 100.0, false});
    ASSERT_TRUE(fleet_->SetRoute(route).ok());

    ShmServerOptions so;
    so.path = (dir_ / "leap.shm").string();
    so.max_slots = 64;
    auto server = ShmServer::Start(core_.get(), "fleet-sidecar", so);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    shim::ShmChannelOptions o;
    o.path = server_->path();
    o.hello.set_engine_id("e");
    o.hello.set_dim(kDim);
    o.hello.set_dtype(pb::FEATURE_DTYPE_FLOAT32);
    o.slots = 16;
    o.ring_bytes = 1 << 16;
    o.timeout = absl::Seconds(10);
    pb::SidecarMessage ack;
    auto ch = shim::ShmChannel::Attach(o, &ack);
    ASSERT_TRUE(ch.ok()) << ch.status();
    ch_ = std::move(*ch);
  }
  void TearDown() override {
    if (nats_ != nullptr) nats_->Signal(SIGCONT);
    ch_.reset();
    server_.reset();
    if (core_ != nullptr) core_->SetFleet(nullptr);
    if (fleet_ != nullptr) fleet_->Stop();
    fleet_.reset();
    if (core_ != nullptr) core_->Shutdown(false);
    core_.reset();
    store_.reset();
    nats_.reset();
    tmp_.reset();
  }

  // SIGSTOP to the nats-server, returning once it is stopped (kill() only
  // queues the signal: a publish sent right after could still be answered).
  void StopNats() {
    nats_->Signal(SIGSTOP);
    int st = 0;
    pid_t r;
    while ((r = waitpid(nats_->pid(), &st, WUNTRACED)) < 0 && errno == EINTR) {
    }
    ASSERT_EQ(r, nats_->pid());
    ASSERT_TRUE(WIFSTOPPED(st)) << st;
  }
  // Submits one request's features in a slot as frame `seq`.
  void Submit(uint64_t seq, const std::string& id) {
    const int64_t slot = ch_->AcquireSlot();
    ASSERT_GE(slot, 0);
    const std::vector<float> x = testing::RandomFeatures(state_, rng_);
    std::memcpy(ch_->slot(static_cast<uint32_t>(slot)), x.data(), kDim * sizeof(float));
    const shim::ShmChannel::Record r{static_cast<uint32_t>(slot), id, "", 0};
    ASSERT_TRUE(ch_->SendFeatures(seq, {r}).ok());
    ch_->Flush();
  }
  void SendCompletion(uint64_t seq, const std::string& id) {
    pb::EngineMessage m;
    m.set_seq(seq);
    pb::Completion* c = m.mutable_completions()->add_completions();
    c->set_request_id(id);
    c->set_output_tokens(40);
    c->set_reason(pb::FINISH_REASON_STOP);
    ASSERT_TRUE(ch_->SendProto(m).ok());
    ch_->Flush();
  }
  // What an answer frame said.
  struct Answer {
    bool predictions = false;  // a predictions frame (else an Ack)
    size_t n_predictions = 0;
    pb::SidecarMessage proto;
  };
  // Receives frames until the answer to `seq` (a predictions frame or an
  // Ack) is in; every answer is kept by seq, and its seq appended to
  // answered_ in arrival order.
  bool AwaitAnswer(uint64_t seq) {
    const absl::Time deadline = absl::Now() + kDeadline;
    shim::ShmIncoming in;
    while (answers_.count(seq) == 0) {
      if (absl::Now() > deadline) return false;
      absl::Status s = ch_->Receive(&in, absl::Milliseconds(200));
      if (absl::IsDeadlineExceeded(s)) continue;
      if (!s.ok()) {
        ADD_FAILURE() << s;
        return false;
      }
      Answer a;
      a.predictions = in.kind == shim::ShmIncoming::Kind::kPredictions;
      if (!a.predictions &&
          (in.kind != shim::ShmIncoming::Kind::kProto || !in.proto.has_ack())) {
        continue;
      }
      a.n_predictions = in.predictions.size();
      a.proto = in.proto;
      answers_[in.seq] = std::move(a);
      answered_.push_back(in.seq);
    }
    return true;
  }
  bool AwaitDegraded(bool want) {
    absl::MutexLock l(&mu_);
    auto cond = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return degraded_ == want; };
    return mu_.AwaitWithTimeout(absl::Condition(&cond), kDeadline);
  }

  // The member's JetStream acknowledgement timeout.
  int64_t nats_timeout_ms_ = 20'000;
  std::unique_ptr<::leap::testing::ScopedTempDir> tmp_;
  std::filesystem::path dir_;
  int port_ = 0;
  std::unique_ptr<client::Process> nats_;
  std::unique_ptr<storage::StateStore> store_;
  Metrics metrics_;
  std::unique_ptr<Core> core_;
  std::unique_ptr<fleet::FleetMember> fleet_;
  readout::ReadoutState state_;
  std::unique_ptr<ShmServer> server_;
  std::unique_ptr<shim::ShmChannel> ch_;
  std::mt19937_64 rng_{3};
  std::map<uint64_t, Answer> answers_;
  std::vector<uint64_t> answered_;
  absl::Mutex mu_;
  bool degraded_ ABSL_GUARDED_BY(mu_) = true;
};

TEST_F(ShmFleetTest, PredictionsFlowWhileACompletionAwaitsJetStream) {
  auto last_in_stream = [&] {
    auto last = fleet_->nats().LastSeq(fleet::FeedbackStream("shm"));
    EXPECT_TRUE(last.ok()) << last.status();
    return last.value_or(0);
  };
  // NATS answering: the completion is acknowledged, and it is in the stream.
  Submit(1, "a");
  ASSERT_TRUE(AwaitAnswer(1));
  SendCompletion(2, "a");
  ASSERT_TRUE(AwaitAnswer(2));
  ASSERT_EQ(answers_[2].proto.ack().accepted(), 1) << answers_[2].proto.DebugString();
  const uint64_t stored = last_in_stream();
  ASSERT_GT(stored, 0u);
  EXPECT_EQ(fleet_->Status().last_fleet_seq, stored);

  // NATS stopped (it holds the connection but answers nothing): the
  // completion's answer is parked; a prediction sent after it is answered.
  Submit(3, "b");
  Submit(4, "c");
  ASSERT_TRUE(AwaitAnswer(3));
  ASSERT_TRUE(AwaitAnswer(4));
  answered_.clear();
  StopNats();
  SendCompletion(5, "b");
  Submit(6, "d");
  ASSERT_TRUE(AwaitAnswer(6));
  EXPECT_TRUE(answers_[6].predictions);
  EXPECT_EQ(answers_[6].n_predictions, 1u);
  // The completion is still unanswered: the prediction came first.
  EXPECT_EQ(answered_, std::vector<uint64_t>{6});
  nats_->Signal(SIGCONT);
  ASSERT_TRUE(AwaitAnswer(5));
  // Acknowledged once JetStream stored it.
  const pb::Ack& ack = answers_[5].proto.ack();
  EXPECT_EQ(ack.accepted(), 1) << answers_[5].proto.DebugString();
  EXPECT_EQ(last_in_stream(), stored + 1);
  EXPECT_EQ(fleet_->Status().last_fleet_seq, stored + 1);

  // NATS gone: completions are refused UNAVAILABLE, predictions go on.
  nats_->Signal(SIGKILL);
  nats_->Wait();
  nats_.reset();
  ASSERT_TRUE(AwaitDegraded(true));
  SendCompletion(7, "c");
  Submit(8, "e");
  ASSERT_TRUE(AwaitAnswer(8));
  EXPECT_EQ(answers_[8].n_predictions, 1u);
  ASSERT_TRUE(AwaitAnswer(7));
  const pb::Ack& refused = answers_[7].proto.ack();
  EXPECT_EQ(refused.accepted(), 0);
  ASSERT_EQ(refused.errors_size(), 1) << answers_[7].proto.DebugString();
  EXPECT_EQ(refused.errors(0).code(), static_cast<int>(absl::StatusCode::kUnavailable));
  EXPECT_EQ(refused.errors(0).request_id(), "c");
}

// A resent completion whose first publish still awaits JetStream (the
// nats-server stopped) is answered with that publish, without waiting on
// the loop: a prediction sent after both is answered while they are parked.
// Once the server runs again both are acknowledged, the resend as a
// duplicate, and the stream holds the completion once.
TEST_F(ShmFleetTest, AResendAwaitingJetStreamDoesNotStopPredictions) {
  auto last_in_stream = [&] {
    auto last = fleet_->nats().LastSeq(fleet::FeedbackStream("shm"));
    EXPECT_TRUE(last.ok()) << last.status();
    return last.value_or(0);
  };
  Submit(1, "a");
  ASSERT_TRUE(AwaitAnswer(1));
  SendCompletion(2, "a");
  ASSERT_TRUE(AwaitAnswer(2));
  ASSERT_EQ(answers_[2].proto.ack().accepted(), 1) << answers_[2].proto.DebugString();
  const uint64_t stored = last_in_stream();
  ASSERT_GT(stored, 0u);
  Submit(3, "b");
  ASSERT_TRUE(AwaitAnswer(3));
  answered_.clear();

  StopNats();
  const absl::Time stopped = absl::Now();
  SendCompletion(4, "b");
  SendCompletion(5, "b");  // the resend: "b" is no longer live
  Submit(6, "c");
  ASSERT_TRUE(AwaitAnswer(6));
  const absl::Duration predicted_after = absl::Now() - stopped;
  EXPECT_TRUE(answers_[6].predictions);
  EXPECT_EQ(answers_[6].n_predictions, 1u);
  // Neither completion is answered yet: the loop did not wait for the
  // resend's publish (the acknowledgement timeout is 20 s).
  EXPECT_EQ(answered_, std::vector<uint64_t>{6});
  EXPECT_LT(predicted_after, absl::Seconds(10));
  nats_->Signal(SIGCONT);
  ASSERT_TRUE(AwaitAnswer(4));
  ASSERT_TRUE(AwaitAnswer(5));
  const pb::Ack& first = answers_[4].proto.ack();
  EXPECT_EQ(first.accepted(), 1) << answers_[4].proto.DebugString();
  EXPECT_EQ(first.duplicates(), 0);
  const pb::Ack& resend = answers_[5].proto.ack();
  EXPECT_EQ(resend.accepted(), 1) << answers_[5].proto.DebugString();
  EXPECT_EQ(resend.duplicates(), 1);
  EXPECT_EQ(resend.errors_size(), 0);
  // One copy in the stream, one record in the outbox (published once).
  EXPECT_EQ(last_in_stream(), stored + 1);
  EXPECT_EQ(fleet_->Status().last_fleet_seq, stored + 1);
  EXPECT_EQ(fleet_->Status().unconfirmed, 0);
  EXPECT_EQ(fleet_->nats().async_in_flight(), 0);
}

// The engine shim's Client over shm: events recorded from its callback, and
// awaited with a deadline.
class ShimEvents {
 public:
  void Add(const shim::Event& e) {
    absl::MutexLock l(&mu_);
    events_.push_back(e);
  }
  // Waits for an event that `match` accepts; returns it (nullopt at the
  // deadline).
  template <typename F>
  std::optional<shim::Event> Await(F match) {
    absl::MutexLock l(&mu_);
    std::optional<shim::Event> found;
    auto cond = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const shim::Event& e : events_) {
        if (match(e)) {
          found = e;
          return true;
        }
      }
      return false;
    };
    mu_.AwaitWithTimeout(absl::Condition(&cond), kDeadline);
    return found;
  }
  bool AwaitCount(shim::Event::Kind kind, int n) {
    absl::MutexLock l(&mu_);
    auto cond = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      int seen = 0;
      for (const shim::Event& e : events_) seen += e.kind == kind ? 1 : 0;
      return seen >= n;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&cond), kDeadline);
  }
  int Count(shim::Event::Kind kind) {
    absl::MutexLock l(&mu_);
    int n = 0;
    for (const shim::Event& e : events_) n += e.kind == kind ? 1 : 0;
    return n;
  }

 private:
  absl::Mutex mu_;
  std::vector<shim::Event> events_ ABSL_GUARDED_BY(mu_);
};

std::unique_ptr<shim::Client> StartShimClient(const std::string& endpoint,
                                              ShimEvents* events,
                                              absl::Duration response_timeout) {
  shim::ClientOptions o;
  o.endpoint = endpoint;
  o.engine_id = "shim";
  o.dim = kDim;
  o.shm_slots = 16;
  o.shm_ring_bytes = 1 << 16;
  if (response_timeout > absl::ZeroDuration()) o.response_timeout = response_timeout;
  auto c = shim::Client::Start(o);
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return nullptr;
  (*c)->SetCallback([events](const shim::Event& e) { events->Add(e); });
  return std::move(*c);
}

auto Kind(shim::Event::Kind k) {
  return [k](const shim::Event& e) { return e.kind == k; };
}
auto PredictionOf(const std::string& id) {
  return [id](const shim::Event& e) {
    return e.kind == shim::Event::Kind::kPrediction && e.request_id == id;
  };
}

// The shim's stall detector watches every unanswered message: a completions
// Ack parked behind a stopped nats-server (the member's acknowledgement
// timeout is 20 s) is noticed after response_timeout (1 s here) although
// the predictions sent after it are answered meanwhile.
TEST_F(ShmFleetTest, TheShimWatchesAParkedCompletionsAnswer) {
  ShimEvents events;
  auto c = StartShimClient("shm://" + server_->path(), &events, absl::Seconds(1));
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(events.Await(Kind(shim::Event::Kind::kConnected)).has_value());
  std::mt19937_64 rng(9);
  auto submit = [&](const std::string& id) {
    const std::vector<float> x = testing::RandomFeatures(state_, rng);
    c->Submit({{id, "", std::string(reinterpret_cast<const char*>(x.data()),
                                     x.size() * sizeof(float)), 0}});
  };
  submit("x");
  ASSERT_TRUE(events.Await(PredictionOf("x")).has_value());

  StopNats();
  const absl::Time stopped = absl::Now();
  c->Complete("x", 40, shim::FinishReason::kStop);
  submit("y");
  // Predictions flow past the parked Ack...
  ASSERT_TRUE(events.Await(PredictionOf("y")).has_value());
  EXPECT_EQ(c->stats().stalls, 0);
  // ...and the Ack is still watched: the connection is abandoned.
  auto down = events.Await(Kind(shim::Event::Kind::kDisconnected));
  ASSERT_TRUE(down.has_value());
  const absl::Duration after = absl::Now() - stopped;
  EXPECT_EQ(c->stats().stalls, 1);
  EXPECT_NE(down->message.find("to message seq"), std::string::npos) << down->message;
  EXPECT_NE(down->message.find("response_timeout 1s"), std::string::npos) << down->message;
  EXPECT_GE(after, absl::Seconds(1));
  EXPECT_LT(after, absl::Seconds(15));  // well before the 20 s JetStream timeout
  nats_->Signal(SIGCONT);
  // The client reattaches by itself.
  EXPECT_TRUE(events.AwaitCount(shim::Event::Kind::kConnected, 2));
  c.reset();
}

// Waits until `pred` holds (it reads the Client's counters, which no event
// announces); false at the deadline.
template <typename F>
bool Eventually(F pred) {
  const absl::Time deadline = absl::Now() + kDeadline;
  while (!pred()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

// With the default timeouts a JetStream acknowledgement that does not come
// (the nats-server stopped) ends in leapd's publish timeout (2 s): the
// completion is answered UNAVAILABLE before the shim's response_timeout
// (5 s) could abandon the connection, so a slow-but-alive NATS never makes
// the shim fall back to first-come order. The shim keeps the refused
// completion (no error event) and resends it by itself with backoff; once
// NATS runs again a resend is acknowledged and the FEEDBACK stream holds the
// completion once (the publishes of every attempt carry the same message
// id). The same over shm and over the gRPC Connect stream (a unix socket
// served by this process's Core).
class ShmFleetDefaultTimeoutsTest : public ShmFleetTest {
 protected:
  ShmFleetDefaultTimeoutsTest() { nats_timeout_ms_ = fleet::NatsClientOptions{}.timeout_ms; }

  uint64_t StreamLast() {
    auto last = fleet_->nats().LastSeq(fleet::FeedbackStream("shm"));
    EXPECT_TRUE(last.ok()) << last.status();
    return last.value_or(0);
  }
  // Completes `id` with the nats-server stopped, then resumes it once the
  // completion was refused `refusals` times (each resend is refused again
  // while NATS is stopped, and rescheduled).
  void RefusedCompletionIsResent(const std::string& endpoint, const std::string& id,
                                 uint64_t seed, int64_t refusals) {
    SCOPED_TRACE(endpoint);
    ShimEvents events;
    auto c = StartShimClient(endpoint, &events, absl::ZeroDuration());
    ASSERT_NE(c, nullptr);
    ASSERT_TRUE(events.Await(Kind(shim::Event::Kind::kConnected)).has_value());
    std::mt19937_64 rng(seed);
    auto submit = [&](const std::string& rid) {
      const std::vector<float> x = testing::RandomFeatures(state_, rng);
      c->Submit({{rid, "", std::string(reinterpret_cast<const char*>(x.data()),
                                       x.size() * sizeof(float)), 0}});
    };
    submit(id);
    ASSERT_TRUE(events.Await(PredictionOf(id)).has_value());
    const uint64_t stored = StreamLast();
    StopNats();
    const absl::Time stopped = absl::Now();
    c->Complete(id, 40, shim::FinishReason::kStop);
    // Refused UNAVAILABLE (leapd's publish timeout), kept for a resend.
    const bool refused = Eventually([&] {
      return c->stats().completion_retries >= refusals ||
             events.Count(shim::Event::Kind::kDisconnected) > 0 ||
             events.Count(shim::Event::Kind::kError) > 0;
    });
    const absl::Duration after = absl::Now() - stopped;
    const shim::ClientStats held = c->stats();
    nats_->Signal(SIGCONT);
    const absl::Time resumed = absl::Now();
    ASSERT_TRUE(refused);
    EXPECT_GE(held.completion_retries, refusals);
    EXPECT_EQ(held.live, 1);
    EXPECT_EQ(held.errors, 0);
    EXPECT_EQ(held.stalls, 0);
    EXPECT_EQ(events.Count(shim::Event::Kind::kError), 0);
    EXPECT_EQ(events.Count(shim::Event::Kind::kDisconnected), 0);

    // NATS back: a resend is acknowledged without the engine doing anything.
    ASSERT_TRUE(Eventually([&] { return c->stats().live == 0; }))
        << "the refused completion was not resent and acknowledged";
    const int64_t retries = c->stats().completion_retries;
    std::printf("%s: refused UNAVAILABLE %lld times in %s (response_timeout 5s: "
                "no stall), acknowledged %s after NATS resumed, %lld refusals\n",
                endpoint.rfind("shm", 0) == 0 ? "shm" : "grpc",
                static_cast<long long>(held.completion_retries),
                absl::FormatDuration(after).c_str(),
                absl::FormatDuration(absl::Now() - resumed).c_str(),
                static_cast<long long>(retries));
    EXPECT_EQ(events.Count(shim::Event::Kind::kError), 0);
    EXPECT_EQ(c->stats().errors, 0);
    EXPECT_EQ(events.Count(shim::Event::Kind::kDisconnected), 0);
    // In the stream once, though published by each attempt.
    EXPECT_EQ(StreamLast(), stored + 1);
    EXPECT_EQ(fleet_->Status().last_fleet_seq, stored + 1);
    // A further completion lands right after it: nothing of `id` was left.
    submit(id + "2");
    ASSERT_TRUE(events.Await(PredictionOf(id + "2")).has_value());
    c->Complete(id + "2", 30, shim::FinishReason::kStop);
    ASSERT_TRUE(Eventually([&] { return c->stats().live == 0; }));
    EXPECT_EQ(StreamLast(), stored + 2);
    EXPECT_EQ(c->stats().completion_retries, retries);
    EXPECT_EQ(fleet_->Status().unconfirmed, 0);
  }
};

TEST_F(ShmFleetDefaultTimeoutsTest, ALateJetStreamAckDoesNotTripTheShim) {
  ASSERT_EQ(nats_timeout_ms_, 2000);
  ASSERT_EQ(shim::ClientOptions{}.response_timeout, absl::Seconds(5));
  ASSERT_NO_FATAL_FAILURE(RefusedCompletionIsResent("shm://" + server_->path(), "x", 10, 2));

  PredictorService svc(core_.get(), "fleet-grpc");
  grpc::ServerBuilder b;
  const std::string sock = "unix://" + (dir_ / "g.sock").string();
  b.AddListeningPort(sock, grpc::InsecureServerCredentials());
  b.RegisterService(&svc);
  std::unique_ptr<grpc::Server> grpc_server = b.BuildAndStart();
  ASSERT_NE(grpc_server, nullptr);
  RefusedCompletionIsResent(sock, "g", 11, 1);
  svc.BeginShutdown();
  grpc_server->Shutdown();
}

}  // namespace
}  // namespace leap::sidecar

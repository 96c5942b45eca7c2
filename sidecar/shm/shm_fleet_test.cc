// The shared-memory server in fleet mode, in process: a Core over a real
// RocksDB store with a real FleetMember (tests/support/fleet_member.h)
// connected to a real nats-server started by the test (nats_cluster.h: one
// node, JetStream on file storage in a temp dir, free loopback ports), and
// an engine_shim ShmChannel attached to the server. A completions
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
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
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
#include "tests/support/fleet_member.h"
#include "tests/support/nats_cluster.h"
#include "tests/support/readout_fixtures.h"
#include "tests/support/scoped_temp_dir.h"
#include "tests/support/shim_events.h"

namespace leap::sidecar {
namespace {

namespace pb = ::leap::v1;
using ::leap::testing::AwaitNoneLive;
using ::leap::testing::OfKind;
using ::leap::testing::PollUntil;
using ::leap::testing::PredictionOf;
using ::leap::testing::ShimEvents;

constexpr int64_t kDim = 16;
constexpr absl::Duration kDeadline = absl::Seconds(30);

class ShmFleetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // A short name: the shm path must fit a unix socket path.
    tmp_ = std::make_unique<::leap::testing::ScopedTempDir>("shm_fleet_test");
    dir_ = tmp_->path();
    ::leap::testing::FleetTestMemberOptions mo;
    mo.fleet = "shm";
    mo.member = "m";
    // JetStream's acknowledgement timeout well beyond the time the test
    // keeps the server stopped.
    mo.nats_timeout_ms = nats_timeout_ms_;
    state_ = testing::RandomState(kDim, 41);
    ASSERT_NO_FATAL_FAILURE(fleet_.Start(dir_, mo, "chat", state_));
    core_ = fleet_.member->core.get();
    fleet_member_ = fleet_.member->fleet.get();

    ShmServerOptions so;
    so.path = (dir_ / "leap.shm").string();
    so.max_slots = 64;
    auto server = ShmServer::Start(core_, "fleet-sidecar", so);
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
    ResumeNats();
    ch_.reset();
    server_.reset();
    fleet_.Stop();
    tmp_.reset();
  }

  // SIGSTOP to the nats-server, returning once it is stopped (kill() only
  // queues the signal: a publish sent right after could still be answered).
  void StopNats() {
    client::Process* p = fleet_.nats->process(0);
    ASSERT_NE(p, nullptr);
    p->Signal(SIGSTOP);
    int st = 0;
    pid_t r;
    while ((r = waitpid(p->pid(), &st, WUNTRACED)) < 0 && errno == EINTR) {
    }
    ASSERT_EQ(r, p->pid());
    ASSERT_TRUE(WIFSTOPPED(st)) << st;
  }
  void ResumeNats() {
    if (fleet_.nats != nullptr && fleet_.nats->process(0) != nullptr) {
      fleet_.nats->process(0)->Signal(SIGCONT);
    }
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
  bool AwaitDegraded(bool want) { return fleet_.degraded.Await(want); }
  // With NATS answering: request "a" (seq 1) and its completion (seq 2),
  // acknowledged; `stored` gets the FEEDBACK stream's last seq then.
  void CompleteOneWithNats(uint64_t* stored) {
    Submit(1, "a");
    ASSERT_TRUE(AwaitAnswer(1));
    SendCompletion(2, "a");
    ASSERT_TRUE(AwaitAnswer(2));
    ASSERT_EQ(answers_[2].proto.ack().accepted(), 1) << answers_[2].proto.DebugString();
    *stored = StreamLast();
    ASSERT_GT(*stored, 0u);
  }
  // The FEEDBACK stream's last seq.
  uint64_t StreamLast() {
    auto last = fleet_member_->nats().LastSeq(fleet::FeedbackStream("shm"));
    EXPECT_TRUE(last.ok()) << last.status();
    return last.value_or(0);
  }

  // The member's JetStream acknowledgement timeout.
  int64_t nats_timeout_ms_ = 20'000;
  std::unique_ptr<::leap::testing::ScopedTempDir> tmp_;
  std::filesystem::path dir_;
  ::leap::testing::OneNodeFleet fleet_;
  Core* core_ = nullptr;                         // fleet_'s
  fleet::FleetMember* fleet_member_ = nullptr;   // fleet_'s
  readout::ReadoutState state_;
  std::unique_ptr<ShmServer> server_;
  std::unique_ptr<shim::ShmChannel> ch_;
  std::mt19937_64 rng_{3};
  std::map<uint64_t, Answer> answers_;
  std::vector<uint64_t> answered_;
};

TEST_F(ShmFleetTest, PredictionsFlowWhileACompletionAwaitsJetStream) {
  // NATS answering: the completion is acknowledged, and it is in the stream.
  uint64_t stored = 0;
  ASSERT_NO_FATAL_FAILURE(CompleteOneWithNats(&stored));
  EXPECT_EQ(fleet_member_->Status().last_fleet_seq, stored);

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
  ResumeNats();
  ASSERT_TRUE(AwaitAnswer(5));
  // Acknowledged once JetStream stored it.
  const pb::Ack& ack = answers_[5].proto.ack();
  EXPECT_EQ(ack.accepted(), 1) << answers_[5].proto.DebugString();
  EXPECT_EQ(StreamLast(), stored + 1);
  EXPECT_EQ(fleet_member_->Status().last_fleet_seq, stored + 1);

  // NATS gone: completions are refused UNAVAILABLE, predictions go on.
  ASSERT_TRUE(fleet_.nats->Kill(0).ok());
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
  uint64_t stored = 0;
  ASSERT_NO_FATAL_FAILURE(CompleteOneWithNats(&stored));
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
  ResumeNats();
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
  EXPECT_EQ(StreamLast(), stored + 1);
  EXPECT_EQ(fleet_member_->Status().last_fleet_seq, stored + 1);
  EXPECT_EQ(fleet_member_->Status().unconfirmed, 0);
  EXPECT_EQ(fleet_member_->nats().async_in_flight(), 0);
}

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
  auto c = ::leap::testing::StartRecordedClient(o, events);
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return nullptr;
  return std::move(*c);
}

// The shim's stall detector watches every unanswered message: a completions
// Ack parked behind a stopped nats-server (the member's acknowledgement
// timeout is 20 s) is noticed after response_timeout (1 s here) although
// the predictions sent after it are answered meanwhile.
TEST_F(ShmFleetTest, TheShimWatchesAParkedCompletionsAnswer) {
  ShimEvents events;
  auto c = StartShimClient("shm://" + server_->path(), &events, absl::Seconds(1));
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(events.Await(OfKind(shim::Event::Kind::kConnected)).has_value());
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
  auto down = events.Await(OfKind(shim::Event::Kind::kDisconnected));
  ASSERT_TRUE(down.has_value());
  const absl::Duration after = absl::Now() - stopped;
  EXPECT_EQ(c->stats().stalls, 1);
  EXPECT_NE(down->message.find("to message seq"), std::string::npos) << down->message;
  EXPECT_NE(down->message.find("response_timeout 1s"), std::string::npos) << down->message;
  EXPECT_GE(after, absl::Seconds(1));
  EXPECT_LT(after, absl::Seconds(15));  // well before the 20 s JetStream timeout
  ResumeNats();
  // The client reattaches by itself.
  EXPECT_TRUE(events.AwaitCount(shim::Event::Kind::kConnected, 2));
  c.reset();
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

  // Completes `id` with the nats-server stopped, then resumes it once the
  // completion was refused `refusals` times (each resend is refused again
  // while NATS is stopped, and rescheduled).
  void RefusedCompletionIsResent(const std::string& endpoint, const std::string& id,
                                 uint64_t seed, int64_t refusals) {
    SCOPED_TRACE(endpoint);
    ShimEvents events;
    auto c = StartShimClient(endpoint, &events, absl::ZeroDuration());
    ASSERT_NE(c, nullptr);
    ASSERT_TRUE(events.Await(OfKind(shim::Event::Kind::kConnected)).has_value());
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
    const bool refused = PollUntil([&] {
      return c->stats().completion_retries >= refusals ||
             events.Count(shim::Event::Kind::kDisconnected) > 0 ||
             events.Count(shim::Event::Kind::kError) > 0;
    });
    const absl::Duration after = absl::Now() - stopped;
    const shim::ClientStats held = c->stats();
    ResumeNats();
    const absl::Time resumed = absl::Now();
    ASSERT_TRUE(refused);
    EXPECT_GE(held.completion_retries, refusals);
    EXPECT_EQ(held.live, 1);
    EXPECT_EQ(held.errors, 0);
    EXPECT_EQ(held.stalls, 0);
    EXPECT_EQ(events.Count(shim::Event::Kind::kError), 0);
    EXPECT_EQ(events.Count(shim::Event::Kind::kDisconnected), 0);

    // NATS back: a resend is acknowledged without the engine doing anything.
    ASSERT_TRUE(AwaitNoneLive(*c))
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
    EXPECT_EQ(fleet_member_->Status().last_fleet_seq, stored + 1);
    // A further completion lands right after it: nothing of `id` was left.
    submit(id + "2");
    ASSERT_TRUE(events.Await(PredictionOf(id + "2")).has_value());
    c->Complete(id + "2", 30, shim::FinishReason::kStop);
    ASSERT_TRUE(AwaitNoneLive(*c));
    EXPECT_EQ(StreamLast(), stored + 2);
    EXPECT_EQ(c->stats().completion_retries, retries);
    EXPECT_EQ(fleet_member_->Status().unconfirmed, 0);
  }
};

TEST_F(ShmFleetDefaultTimeoutsTest, ALateJetStreamAckDoesNotTripTheShim) {
  ASSERT_EQ(nats_timeout_ms_, 2000);
  ASSERT_EQ(shim::ClientOptions{}.response_timeout, absl::Seconds(5));
  ASSERT_NO_FATAL_FAILURE(RefusedCompletionIsResent("shm://" + server_->path(), "x", 10, 2));

  PredictorService svc(core_, "fleet-grpc");
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

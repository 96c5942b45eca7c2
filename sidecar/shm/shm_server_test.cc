// Unit tests of ShmServer in process: a Core and the server in this process,
// an engine_shim ShmChannel attached to it (no leapd). Attach and its
// refusals; predictions read in place from the engine's slots equal the
// FP64 w.x + b; a completion is learned and its slot handed back; a publish
// reaches the engine as a notice and a rescore of its live requests at the
// new theta; an engine hanging up has its live requests reclaimed (and the
// others keep being served); Stop detaches every engine.
#include "sidecar/shm/shm_server.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine_shim/shm_channel.h"
#include "gtest/gtest.h"
#include "tests/support/readout_fixtures.h"

namespace leap::sidecar {
namespace {

namespace pb = ::leap::v1;

constexpr int64_t kDim = 16;
constexpr absl::Duration kDeadline = absl::Seconds(30);

// Polls `done` until it holds or the deadline passes (for state the server
// thread changes without telling this one).
template <typename F>
bool Eventually(F done) {
  const absl::Time deadline = absl::Now() + kDeadline;
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

class ShmServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/shm_server_test_", ::getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    state_ = testing::RandomState(kDim, 31);
    CoreOptions o;
    o.readout.rls_batch = 1;
    core_ = std::make_unique<Core>(o, &metrics_);
    ASSERT_TRUE(core_->CreateReadout("r", state_).ok());
    Route route;
    route.arms.push_back({"main", "r", 100.0, false});
    ASSERT_TRUE(core_->SetRoute(route).ok());
    ShmServerOptions so;
    so.path = dir_ + "/leap.shm";
    so.max_slots = 64;
    auto server = ShmServer::Start(core_.get(), "unit-sidecar", so);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }
  void TearDown() override {
    server_.reset();
    core_.reset();
    std::filesystem::remove_all(dir_);
  }

  shim::ShmChannelOptions Channel(const std::string& engine, int64_t dim = kDim,
                                  uint32_t slots = 16) {
    shim::ShmChannelOptions o;
    o.path = server_->path();
    o.hello.set_engine_id(engine);
    o.hello.set_dim(dim);
    o.hello.set_dtype(pb::FEATURE_DTYPE_FLOAT32);
    o.slots = slots;
    o.ring_bytes = 1 << 16;
    o.timeout = absl::Seconds(10);
    return o;
  }
  std::unique_ptr<shim::ShmChannel> Attach(const std::string& engine) {
    pb::SidecarMessage ack;
    auto ch = shim::ShmChannel::Attach(Channel(engine), &ack);
    EXPECT_TRUE(ch.ok()) << ch.status();
    if (!ch.ok()) return nullptr;
    // The sidecar's id, then the attachment's.
    EXPECT_TRUE(absl::StartsWith(ack.hello_ack().sidecar_id(), "unit-sidecar/shm-"))
        << ack.hello_ack().sidecar_id();
    return std::move(*ch);
  }

  struct Sent {
    std::string id;
    std::vector<float> x;
    uint32_t slot;
  };
  // Writes `n` requests' features into free slots and submits them as one
  // frame with sequence number `seq`.
  std::vector<Sent> Submit(shim::ShmChannel& ch, uint64_t seq, int n,
                           const std::string& prefix) {
    std::vector<Sent> sent;
    std::vector<shim::ShmChannel::Record> records;
    for (int i = 0; i < n; ++i) {
      const int64_t slot = ch.AcquireSlot();
      EXPECT_GE(slot, 0);
      if (slot < 0) return sent;
      Sent s{absl::StrCat(prefix, i), testing::RandomFeatures(state_, rng_),
             static_cast<uint32_t>(slot)};
      std::memcpy(ch.slot(s.slot), s.x.data(), kDim * sizeof(float));
      sent.push_back(std::move(s));
    }
    for (const Sent& s : sent) records.push_back({s.slot, s.id, "", 0});
    EXPECT_TRUE(ch.SendFeatures(seq, records).ok());
    ch.Flush();
    return sent;
  }
  // Receives until `want` says it has what it waits for (false at the
  // deadline or when the channel fails).
  template <typename F>
  bool ReceiveUntil(shim::ShmChannel& ch, F want) {
    const absl::Time deadline = absl::Now() + kDeadline;
    shim::ShmIncoming in;
    while (absl::Now() < deadline) {
      absl::Status s = ch.Receive(&in, absl::Milliseconds(200));
      if (absl::IsDeadlineExceeded(s)) continue;
      if (!s.ok()) {
        ADD_FAILURE() << s;
        return false;
      }
      if (want(in)) return true;
    }
    return false;
  }
  // Closes `ch` (the engine hangs up) and waits until leapd reclaimed
  // `reclaimed` of its live requests, leaving `live` in the cache.
  void HangUpAndExpectReclaimed(std::unique_ptr<shim::ShmChannel> ch,
                                int64_t live, double reclaimed) {
    const double reclaimed_before = metrics_.shm_reclaimed().Value();
    ch->Close();
    ch.reset();
    EXPECT_TRUE(Eventually([&] {
      return core_->cache().size() == live &&
             metrics_.shm_reclaimed().Value() - reclaimed_before == reclaimed;
    })) << core_->cache().size() << " live, "
        << metrics_.shm_reclaimed().Value() - reclaimed_before << " reclaimed";
  }
  void ExpectScore(const Sent& s, double score, const Eigen::VectorXd& theta) {
    std::vector<double> x(s.x.begin(), s.x.end());
    EXPECT_NEAR(score, testing::ReferenceScore(state_.standardizer, theta, x),
                testing::ScoreTolerance(state_.standardizer, theta, x))
        << s.id;
  }

  std::string dir_;
  Metrics metrics_;
  readout::ReadoutState state_;
  std::unique_ptr<Core> core_;
  std::unique_ptr<ShmServer> server_;
  std::mt19937_64 rng_{8};
};

TEST_F(ShmServerTest, PredictsLearnsRescoresAndReclaimsOnHangUp) {
  auto ch = Attach("e1");
  ASSERT_NE(ch, nullptr);
  const int64_t all_slots = ch->free_slots();
  ASSERT_EQ(all_slots, 16);

  // Predictions, read where the engine wrote the features.
  std::vector<Sent> sent = Submit(*ch, 1, 5, "a");
  ASSERT_EQ(sent.size(), 5u);
  bool answered = ReceiveUntil(*ch, [&](const shim::ShmIncoming& in) {
    if (in.kind != shim::ShmIncoming::Kind::kPredictions || in.seq != 1) return false;
    EXPECT_TRUE(in.errors.empty());
    EXPECT_EQ(in.predictions.size(), sent.size());
    for (size_t i = 0; i < in.predictions.size() && i < sent.size(); ++i) {
      const shim::ShmPrediction& p = in.predictions[i];
      EXPECT_EQ(p.request_id, sent[i].id);
      EXPECT_EQ(p.slot, sent[i].slot);
      EXPECT_EQ(p.readout, "r");
      EXPECT_EQ(p.arm, "main");
      EXPECT_EQ(p.version, 1);
      ExpectScore(sent[i], p.score, state_.theta);
      EXPECT_DOUBLE_EQ(p.predicted_tokens,
                       readout::TokensFromScore(p.score, readout::kDefaultMaxTokens));
    }
    return true;
  });
  ASSERT_TRUE(answered);
  EXPECT_EQ(core_->cache().size(), 5);
  EXPECT_EQ(ch->free_slots(), all_slots - 5);

  // One completion: acknowledged, learned (rls_batch 1: version 2), its slot
  // handed back; the engine hears of the publish and gets the other four
  // rescored at the new theta.
  pb::EngineMessage m;
  m.set_seq(2);
  pb::Completion* c = m.mutable_completions()->add_completions();
  c->set_request_id(sent[0].id);
  c->set_output_tokens(321);
  c->set_reason(pb::FINISH_REASON_STOP);
  ASSERT_TRUE(ch->SendProto(m).ok());
  ch->Flush();
  bool acked = false, published = false, rescored = false;
  std::vector<pb::Prediction> rescores;
  ASSERT_TRUE(ReceiveUntil(*ch, [&](const shim::ShmIncoming& in) {
    if (in.kind == shim::ShmIncoming::Kind::kProto) {
      const pb::SidecarMessage& sm = in.proto;
      if (sm.has_ack() && sm.seq() == 2) {
        EXPECT_EQ(sm.ack().accepted(), 1);
        EXPECT_EQ(sm.ack().errors_size(), 0);
        acked = true;
      }
      if (sm.has_published()) {
        EXPECT_EQ(sm.published().readout(), "r");
        published = published || sm.published().version() == 2;
      }
      if (sm.has_rescore() && sm.rescore().version() == 2) {
        rescores.assign(sm.rescore().predictions().begin(),
                        sm.rescore().predictions().end());
        rescored = true;
      }
    }
    return acked && published && rescored && ch->free_slots() == all_slots - 4;
  })) << "acked " << acked << " published " << published << " rescored "
      << rescored << " free slots " << ch->free_slots();
  core_->WaitIdle();
  auto ro = *core_->GetReadout("r");
  EXPECT_EQ(ro->completions_learned(), 1);
  testing::ClosedForm reference(state_);
  reference.Learn(sent[0].x, readout::TargetFromTokens(321, readout::kDefaultMaxTokens));
  const Eigen::VectorXd theta = ro->Export().theta;
  EXPECT_LT(testing::RelErr(theta, reference.Theta()), 1e-6);
  ASSERT_EQ(rescores.size(), 4u);
  for (const pb::Prediction& p : rescores) {
    auto it = std::find_if(sent.begin(), sent.end(),
                           [&](const Sent& s) { return s.id == p.request_id(); });
    ASSERT_NE(it, sent.end()) << p.request_id();
    EXPECT_NE(it, sent.begin()) << "the completed request was rescored";
    ExpectScore(*it, p.score(), theta);
    EXPECT_EQ(p.version(), 2);
  }

  // A second engine, then the first hangs up: its four live requests are
  // reclaimed, the second's stay and it is still served.
  auto other = Attach("e2");
  ASSERT_NE(other, nullptr);
  std::vector<Sent> kept = Submit(*other, 1, 2, "b");
  ASSERT_TRUE(ReceiveUntil(*other, [&](const shim::ShmIncoming& in) {
    return in.kind == shim::ShmIncoming::Kind::kPredictions && in.seq == 1;
  }));
  EXPECT_EQ(core_->cache().size(), 6);
  HangUpAndExpectReclaimed(std::move(ch), 2, 4);
  for (const Sent& s : kept) EXPECT_NE(core_->cache().Find(s.id), nullptr);
  for (const Sent& s : sent) EXPECT_EQ(core_->cache().Find(s.id), nullptr);
  std::vector<Sent> more = Submit(*other, 2, 1, "c");
  ASSERT_TRUE(ReceiveUntil(*other, [&](const shim::ShmIncoming& in) {
    if (in.kind != shim::ShmIncoming::Kind::kPredictions || in.seq != 2) return false;
    EXPECT_EQ(in.predictions.size(), 1u);
    if (!in.predictions.empty()) {
      EXPECT_EQ(in.predictions[0].version, 2);
      ExpectScore(more[0], in.predictions[0].score, theta);
    }
    return true;
  }));
  // The first engine's segment is gone from the folder.
  EXPECT_TRUE(Eventually([&] {
    int segments = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir_)) {
      segments += e.path().extension() == ".seg";
    }
    return segments == 1;
  }));
}

// The shim's Client always says its instance id, and leapd then keys the
// engine's live requests by (instance, id): a hang-up must reclaim them all
// the same (it once looked them up by id alone and reclaimed none).
TEST_F(ShmServerTest, HangUpReclaimsTheRequestsOfAnEngineWithAnInstanceId) {
  shim::ShmChannelOptions o = Channel("e-inst");
  o.hello.set_instance_id("instance-7");
  pb::SidecarMessage ack;
  auto attached = shim::ShmChannel::Attach(o, &ack);
  ASSERT_TRUE(attached.ok()) << attached.status();
  std::unique_ptr<shim::ShmChannel> ch = std::move(*attached);
  Submit(*ch, 1, 3, "i");
  ASSERT_TRUE(ReceiveUntil(*ch, [&](const shim::ShmIncoming& in) {
    return in.kind == shim::ShmIncoming::Kind::kPredictions && in.seq == 1;
  }));
  EXPECT_EQ(core_->cache().size(), 3);
  HangUpAndExpectReclaimed(std::move(ch), 0, 3);
}

TEST_F(ShmServerTest, RefusesAttachmentsItCannotServe) {
  pb::SidecarMessage ack;
  // No readout reads d = 17.
  auto wrong_width = shim::ShmChannel::Attach(Channel("w", 17), &ack);
  ASSERT_FALSE(wrong_width.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(wrong_width.status())) << wrong_width.status();
  EXPECT_NE(wrong_width.status().message().find("r=16"), std::string::npos)
      << wrong_width.status();
  // More slots than the server allows.
  auto too_many = shim::ShmChannel::Attach(Channel("m", kDim, 65), &ack);
  ASSERT_FALSE(too_many.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(too_many.status())) << too_many.status();
  // And a good one still attaches.
  EXPECT_NE(Attach("ok"), nullptr);
}

TEST_F(ShmServerTest, StopDetachesEveryEngineAndReclaimsItsRequests) {
  auto ch = Attach("e1");
  ASSERT_NE(ch, nullptr);
  Submit(*ch, 1, 3, "s");
  ASSERT_TRUE(ReceiveUntil(*ch, [&](const shim::ShmIncoming& in) {
    return in.kind == shim::ShmIncoming::Kind::kPredictions && in.seq == 1;
  }));
  EXPECT_EQ(core_->cache().size(), 3);
  server_->Stop();
  EXPECT_EQ(core_->cache().size(), 0);
  shim::ShmIncoming in;
  absl::Status s;
  const absl::Time deadline = absl::Now() + kDeadline;
  do {
    s = ch->Receive(&in, absl::Milliseconds(200));
  } while (s.ok() || (absl::IsDeadlineExceeded(s) && absl::Now() < deadline));
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_NE(ch->close_reason().find("leapd closed"), std::string::npos)
      << ch->close_reason();
  server_->Stop();  // idempotent
}

TEST(ShmServerOptions, Validate) {
  ShmServerOptions o;
  EXPECT_FALSE(o.Validate().ok());  // no path
  o.path = "/tmp/x.shm";
  EXPECT_TRUE(o.Validate().ok());
  o.max_engines = 0;
  EXPECT_FALSE(o.Validate().ok());
}

}  // namespace
}  // namespace leap::sidecar

// End to end: A/B routing and shadow arms on a real leapd process.
//  - With arms A (30 %) and B (70 %) and a shadow S on product line
//    "search", 10,000 request ids split within +-2 % of 30/70; a request id
//    lands on the same arm on every prediction, and on the same arm in
//    another leapd process with the same route.
//  - No prediction (answer or rescore push) ever carries arm S or readout s,
//    yet S scores every request: once the requests complete, S's quality
//    stats fill (10,000 completions, a finite rolling Spearman) and readout
//    s learns from all of them, while A and B learn only their own share.
#include <signal.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "readout/synth.h"
#include "tests/support/engine_client.h"
#include "tests/support/process.h"

namespace leap {
namespace {

namespace pb = ::leap::v1;
using testing::EngineStream;

constexpr int64_t kDim = 32;
constexpr double kLambda = 10.0;
constexpr int kRequests = 10000;
constexpr int kCrossProcessIds = 1000;
constexpr char kProductLine[] = "search";
// The arm a readout serves in (shadow S's readout is "s").
const std::map<std::string, std::string> kReadoutOfArm = {
    {"A", "a"}, {"B", "b"}, {"S", "s"}};

struct Server {
  std::unique_ptr<testing::Process> proc;
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::Admin::Stub> admin;
  std::unique_ptr<pb::Predictor::Stub> predictor;
};

// Starts leapd with readouts a, b, s (cold start) and the route of
// `product_line` A 30 % / B 70 % / shadow S.
void StartWithAbRoute(Server* s,
                      const std::string& product_line = kProductLine) {
  auto p = testing::StartLeapd(
      LEAPD_PATH, {"--rls_batch=8", "--rls_batch_max=8", "--rls_flush=20ms"}, &s->address);
  ASSERT_TRUE(p.ok()) << p.status();
  s->proc = std::move(*p);
  s->channel = testing::MakeChannel(s->address);
  s->admin = pb::Admin::NewStub(s->channel);
  s->predictor = pb::Predictor::NewStub(s->channel);
  for (const char* name : {"a", "b", "s"}) {
    grpc::ClientContext ctx;
    pb::CreateReadoutRequest req;
    req.set_name(name);
    req.mutable_cold_start()->set_dim(kDim);
    req.mutable_cold_start()->set_lambda(kLambda);
    pb::ReadoutInfo info;
    grpc::Status st = s->admin->CreateReadout(&ctx, req, &info);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(info.version(), 1);
  }
  grpc::ClientContext ctx;
  pb::SetRouteRequest req;
  pb::Route* route = req.mutable_route();
  route->set_product_line(product_line);
  for (const auto& [name, percent, shadow] :
       {std::tuple{"A", 30.0, false}, std::tuple{"B", 70.0, false},
        std::tuple{"S", 0.0, true}}) {
    pb::Arm* arm = route->add_arms();
    arm->set_name(name);
    arm->set_readout(kReadoutOfArm.at(name));
    arm->set_percent(percent);
    arm->set_shadow(shadow);
  }
  pb::Route out;
  grpc::Status st = s->admin->SetRoute(&ctx, req, &out);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(out.arms_size(), 3);
  EXPECT_TRUE(out.arms(2).shadow());
}

// Follows WatchReadout on a reader thread so tests wait on versions with a
// deadline.
class Watcher {
 public:
  Watcher(pb::Predictor::Stub* stub, const std::string& readout) {
    pb::WatchReadoutRequest req;
    req.set_readout(readout);
    reader_ = stub->WatchReadout(&ctx_, req);
    thread_ = std::thread([this] {
      pb::ReadoutVersion v;
      while (reader_->Read(&v)) {
        absl::MutexLock lock(&mu_);
        versions_.push_back(v);
      }
      absl::MutexLock lock(&mu_);
      done_ = true;
    });
  }
  ~Watcher() {
    ctx_.TryCancel();
    thread_.join();
    reader_->Finish();
  }

  // Waits until the latest version satisfies `pred`; false on timeout or
  // when the stream ended first. `latest` receives the latest version seen.
  bool WaitFor(const std::function<bool(const pb::ReadoutVersion&)>& pred,
               pb::ReadoutVersion* latest,
               absl::Duration timeout = absl::Seconds(60)) {
    absl::MutexLock lock(&mu_);
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return done_ || (!versions_.empty() && pred(versions_.back()));
    };
    mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
    if (!versions_.empty()) *latest = versions_.back();
    return !versions_.empty() && pred(versions_.back());
  }

  std::vector<int64_t> versions() {
    absl::MutexLock lock(&mu_);
    std::vector<int64_t> out;
    for (const auto& v : versions_) out.push_back(v.version());
    return out;
  }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<pb::ReadoutVersion>> reader_;
  std::thread thread_;
  absl::Mutex mu_;
  std::vector<pb::ReadoutVersion> versions_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
};

struct Request {
  std::string id;
  std::vector<float> x;
  int64_t tokens;
};

std::vector<Request> MakeRequests() {
  readout::SynthOptions so;
  so.dim = kDim;
  auto gen = readout::SynthGenerator::Create(so);
  EXPECT_TRUE(gen.ok()) << gen.status();
  auto chat = readout::BuiltinDomain("chat");
  EXPECT_TRUE(chat.ok());
  std::mt19937_64 rng(11);
  std::vector<Request> reqs(kRequests);
  for (int i = 0; i < kRequests; ++i) {
    reqs[i].id = "q-" + std::to_string(i);
    reqs[i].x.resize(kDim);
    reqs[i].tokens = gen->Draw(*chat, rng, reqs[i].x.data());
  }
  return reqs;
}

// Predicts reqs[begin, end) on `e` and returns each id's prediction; fails
// the test on any error or a prediction of the shadow arm.
std::map<std::string, pb::Prediction> PredictBatch(
    EngineStream& e, const std::vector<Request>& reqs, int begin, int end) {
  pb::EngineMessage m;
  for (int i = begin; i < end; ++i) {
    pb::FeatureRecord* r = m.mutable_features()->add_records();
    r->set_request_id(reqs[i].id);
    r->set_product_line(kProductLine);
    r->set_features(reinterpret_cast<const char*>(reqs[i].x.data()),
                    reqs[i].x.size() * sizeof(float));
  }
  const pb::SidecarMessage answer = e.Call(m);
  std::map<std::string, pb::Prediction> out;
  EXPECT_TRUE(answer.has_predictions()) << answer.DebugString();
  EXPECT_EQ(answer.predictions().errors_size(), 0) << answer.DebugString();
  EXPECT_EQ(answer.predictions().predictions_size(), end - begin);
  for (const pb::Prediction& p : answer.predictions().predictions()) {
    EXPECT_TRUE(p.arm() == "A" || p.arm() == "B") << p.DebugString();
    EXPECT_NE(p.readout(), "s") << p.DebugString();
    if (kReadoutOfArm.count(p.arm()) != 0) {
      EXPECT_EQ(p.readout(), kReadoutOfArm.at(p.arm())) << p.DebugString();
    }
    out[p.request_id()] = p;
  }
  return out;
}

const pb::ArmStats* FindArm(const pb::StatsResponse& stats,
                            const std::string& arm,
                            const std::string& product_line = kProductLine) {
  for (const pb::ArmStats& a : stats.arms()) {
    if (a.product_line() == product_line && a.arm() == arm) return &a;
  }
  return nullptr;
}

TEST(LeapdRouting, AbSplitIsStablePerIdAndShadowIsMeasuredButNeverServed) {
  Server s;
  ASSERT_NO_FATAL_FAILURE(StartWithAbRoute(&s));
  const std::vector<Request> reqs = MakeRequests();
  ASSERT_EQ(static_cast<int>(reqs.size()), kRequests);

  Watcher watch_a(s.predictor.get(), "a"), watch_b(s.predictor.get(), "b"),
      watch_s(s.predictor.get(), "s");
  EngineStream e(s.channel, kDim);
  pb::SidecarMessage hello_ack;
  ASSERT_TRUE(e.Await(0, &hello_ack));
  ASSERT_TRUE(hello_ack.has_hello_ack()) << hello_ack.DebugString();

  // Pass 1: every id once, all at version 1.
  std::map<std::string, std::string> arm_of;
  for (int begin = 0; begin < kRequests; begin += 500) {
    for (const auto& [id, p] : PredictBatch(e, reqs, begin, begin + 500)) {
      EXPECT_EQ(p.version(), 1);
      arm_of[id] = p.arm();
    }
  }
  ASSERT_EQ(static_cast<int>(arm_of.size()), kRequests);
  std::map<std::string, int64_t> count;
  for (const auto& [id, arm] : arm_of) ++count[arm];
  const double share_a = static_cast<double>(count["A"]) / kRequests;
  std::printf("A/B split over %d ids: A %lld (%.2f %%), B %lld (%.2f %%)\n",
              kRequests, static_cast<long long>(count["A"]), 100 * share_a,
              static_cast<long long>(count["B"]), 100 * (1 - share_a));
  EXPECT_NEAR(share_a, 0.30, 0.02);
  EXPECT_EQ(count["A"] + count["B"], kRequests);

  // Cancel all (not learned), then predict the same ids again, completing
  // each batch with its true length (STOP) before predicting the next.
  for (int begin = 0; begin < kRequests; begin += 500) {
    pb::EngineMessage m;
    for (int i = begin; i < begin + 500; ++i) {
      m.mutable_cancels()->add_request_ids(reqs[i].id);
    }
    const pb::SidecarMessage ack = e.Call(m);
    ASSERT_TRUE(ack.has_ack()) << ack.DebugString();
    ASSERT_EQ(ack.ack().accepted(), 500);
    ASSERT_EQ(ack.ack().errors_size(), 0);
  }
  int moved = 0;
  for (int begin = 0; begin < kRequests; begin += 100) {
    for (const auto& [id, p] : PredictBatch(e, reqs, begin, begin + 100)) {
      moved += p.arm() != arm_of[id] ? 1 : 0;
    }
    pb::EngineMessage m;
    for (int i = begin; i < begin + 100; ++i) {
      pb::Completion* c = m.mutable_completions()->add_completions();
      c->set_request_id(reqs[i].id);
      c->set_output_tokens(reqs[i].tokens);
      c->set_reason(pb::FINISH_REASON_STOP);
    }
    const pb::SidecarMessage ack = e.Call(m);
    ASSERT_TRUE(ack.has_ack()) << ack.DebugString();
    ASSERT_EQ(ack.ack().errors_size(), 0) << ack.DebugString();
    ASSERT_EQ(ack.ack().accepted(), 100);
    ASSERT_EQ(ack.ack().skipped(), 0);
    if (begin + 100 == 1000) {
      // Cold readouts predict a constant (score 0 -> 1 token), which has no
      // rank correlation: let every readout learn a first version so the
      // remaining 9,000 predictions (the quality windows) vary.
      pb::ReadoutVersion v;
      for (Watcher* w : {&watch_a, &watch_b, &watch_s}) {
        ASSERT_TRUE(w->WaitFor(
            [](const pb::ReadoutVersion& v) { return v.version() >= 2; }, &v))
            << "no version 2 of " << v.readout();
      }
    }
  }
  EXPECT_EQ(moved, 0) << "ids changed arm between two predictions";

  // Every completion applied: A and B learned only their own share, the
  // shadow's readout learned all of them.
  pb::ReadoutVersion v;
  for (const auto& [w, want] :
       {std::pair{&watch_a, count["A"]}, std::pair{&watch_b, count["B"]},
        std::pair{&watch_s, int64_t{kRequests}}}) {
    EXPECT_TRUE(w->WaitFor(
        [want = want](const pb::ReadoutVersion& v) {
          return v.completions_learned() >= want;
        },
        &v))
        << v.readout() << " learned " << v.completions_learned() << " of "
        << want;
    EXPECT_EQ(v.completions_learned(), want) << v.readout();
    EXPECT_GT(v.version(), 2) << v.readout();
  }
  {
    grpc::ClientContext ctx;
    pb::GetReadoutRequest req;
    req.set_name("s");
    pb::ReadoutInfo info;
    ASSERT_TRUE(s.admin->GetReadout(&ctx, req, &info).ok());
    EXPECT_EQ(info.completions_learned(), kRequests);
    EXPECT_EQ(info.version(), watch_s.versions().back());
    EXPECT_GT(info.version(), 1);
  }

  pb::StatsResponse stats;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(s.admin->GetStats(&ctx, pb::GetStatsRequest(), &stats).ok());
  }
  const pb::ArmStats* shadow = FindArm(stats, "S");
  ASSERT_NE(shadow, nullptr) << stats.DebugString();
  EXPECT_TRUE(shadow->shadow());
  EXPECT_EQ(shadow->readout(), "s");
  EXPECT_EQ(shadow->predictions(), 2 * kRequests);  // both passes
  EXPECT_EQ(shadow->completions(), kRequests);
  EXPECT_GT(shadow->spearman_n(), 0);
  EXPECT_TRUE(std::isfinite(shadow->spearman())) << shadow->spearman();
  // The synthetic features carry a real length signal, which S learned.
  EXPECT_GT(shadow->spearman(), 0.3);
  std::printf("shadow S: %lld completions, spearman %.3f over %lld\n",
              static_cast<long long>(shadow->completions()), shadow->spearman(),
              static_cast<long long>(shadow->spearman_n()));
  for (const char* name : {"A", "B"}) {
    const pb::ArmStats* arm = FindArm(stats, name);
    ASSERT_NE(arm, nullptr) << name << " missing: " << stats.DebugString();
    EXPECT_FALSE(arm->shadow());
    EXPECT_EQ(arm->readout(), kReadoutOfArm.at(name));
    EXPECT_EQ(arm->predictions(), 2 * count[name]) << name;
    EXPECT_EQ(arm->completions(), count[name]) << name;
    EXPECT_GT(arm->spearman_n(), 0) << name;
    EXPECT_TRUE(std::isfinite(arm->spearman())) << name;
    EXPECT_GT(arm->spearman(), 0.3) << name;
    std::printf("arm %s: %lld completions, spearman %.3f over %lld\n", name,
                static_cast<long long>(arm->completions()), arm->spearman(),
                static_cast<long long>(arm->spearman_n()));
  }
  EXPECT_EQ(stats.live_requests(), 0);

  // The same ids in another leapd process with the same route land on the
  // same arms: the choice is a pure function of the id.
  {
    Server other;
    ASSERT_NO_FATAL_FAILURE(StartWithAbRoute(&other));
    EngineStream e2(other.channel, kDim);
    int differ = 0;
    for (int begin = 0; begin < kCrossProcessIds; begin += 500) {
      for (const auto& [id, p] : PredictBatch(e2, reqs, begin, begin + 500)) {
        differ += p.arm() != arm_of[id] ? 1 : 0;
      }
    }
    EXPECT_EQ(differ, 0) << "of " << kCrossProcessIds << " ids";
    EXPECT_TRUE(e2.Finish().ok());
  }

  // Rescore pushes went to A and B's live requests only.
  ASSERT_TRUE(e.Finish().ok());
  EXPECT_TRUE(e.rescores("s").empty());
  for (const char* readout : {"a", "b"}) {
    for (const auto& [version, preds] : e.rescores(readout)) {
      for (const auto& [id, p] : preds) {
        EXPECT_EQ(p.arm(), arm_of[id]) << p.DebugString();
        EXPECT_NE(p.arm(), "S");
      }
    }
  }

  s.proc->Signal(SIGTERM);
  const int status = s.proc->Wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

// Requests of a product line without a route of its own are served by the
// default route; their completions must count in that route's arm stats
// (where their predictions are counted).
// DISABLED: fails today. Core::Predict keys ArmState by the route's product
// line ("") while Core::Complete looks it up by the request's product line
// ("search"), so the completions of fallback requests are never joined:
// completions stay 0 and the Spearman window stays empty.
TEST(LeapdRouting, DefaultRouteArmStatsCountFallbackCompletions) {
  Server s;
  ASSERT_NO_FATAL_FAILURE(StartWithAbRoute(&s, /*product_line=*/""));
  const std::vector<Request> reqs = MakeRequests();
  EngineStream e(s.channel, kDim);
  // PredictBatch sends product line "search", which has no route here.
  PredictBatch(e, reqs, 0, 200);
  pb::EngineMessage m;
  for (int i = 0; i < 200; ++i) {
    pb::Completion* c = m.mutable_completions()->add_completions();
    c->set_request_id(reqs[i].id);
    c->set_output_tokens(reqs[i].tokens);
    c->set_reason(pb::FINISH_REASON_STOP);
  }
  const pb::SidecarMessage ack = e.Call(m);
  ASSERT_EQ(ack.ack().accepted(), 200) << ack.DebugString();
  pb::StatsResponse stats;
  grpc::ClientContext ctx;
  ASSERT_TRUE(s.admin->GetStats(&ctx, pb::GetStatsRequest(), &stats).ok());
  int64_t predictions = 0, completions = 0;
  for (const char* name : {"A", "B"}) {
    const pb::ArmStats* arm = FindArm(stats, name, "");
    ASSERT_NE(arm, nullptr) << stats.DebugString();
    EXPECT_EQ(arm->completions(), arm->predictions()) << name;
    predictions += arm->predictions();
    completions += arm->completions();
  }
  EXPECT_EQ(predictions, 200);
  EXPECT_EQ(completions, 200);
  const pb::ArmStats* shadow = FindArm(stats, "S", "");
  ASSERT_NE(shadow, nullptr);
  EXPECT_EQ(shadow->completions(), 200);
  EXPECT_TRUE(e.Finish().ok());
}

}  // namespace
}  // namespace leap

// The length prior end to end (issue 14, docs/WIRE.md "Length prior"): a real
// leapd process learns each product line's prior from the completions the
// shim's Client sends with their prompt length, serves it at arrival (before
// prefill) over the Connect stream (gRPC and shared memory) and the unary
// Prior RPC, and the engine's scheduler admits in the prior's order. Checked
// against an independent FP64 ridge solve. Also: bad input gets a precise
// error and loses nothing else; the Client fails open without leapd and
// against a leapd that predates priors; a request's max_tokens below the
// budget caps its prediction over both transports (issue 14, point 4).
#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "Eigen/Cholesky"
#include "Eigen/Core"
#include "absl/strings/str_cat.h"
#include "engine_shim/client.h"
#include "engine_shim/scheduler.h"
#include "gtest/gtest.h"
#include "readout/artifact.h"
#include "tests/support/engine_client.h"
#include "tests/support/process.h"
#include "tests/support/readout_fixtures.h"
#include "tests/support/scoped_temp_dir.h"
#include "tests/support/shim_events.h"

namespace leap {
namespace {

namespace pb = ::leap::v1;
using shim::Event;
using testing::FindEvent;
using testing::ShimEvents;

constexpr int64_t kDim = 16;
constexpr int64_t kBudget = readout::kDefaultMaxTokens;  // the readout's M

// One learned completion as the prior sees it.
struct Sample {
  int64_t prompt, max_tokens, output;
};

// Independent FP64 reference of the prior (docs/SCHEDULING.md): ridge on
// x = (1, log1p prompt, log1p cap, [0 < max_tokens < M]), lambda 1 on all
// but the intercept, y = sqrt(min(output, cap)); prior = max(w.x, 0)^2
// capped at cap.
class Reference {
 public:
  static Eigen::Vector4d X(int64_t prompt, int64_t max_tokens) {
    const bool capped = max_tokens > 0 && max_tokens < kBudget;
    const double cap = capped ? max_tokens : kBudget;
    return {1.0, std::log1p(static_cast<double>(prompt)), std::log1p(cap),
            capped ? 1.0 : 0.0};
  }
  explicit Reference(const std::vector<Sample>& samples) {
    Eigen::Matrix4d a = Eigen::Matrix4d::Zero();
    Eigen::Vector4d b = Eigen::Vector4d::Zero();
    for (const Sample& s : samples) {
      const Eigen::Vector4d x = X(s.prompt, s.max_tokens);
      const int64_t cap = s.max_tokens > 0 ? std::min(s.max_tokens, kBudget) : kBudget;
      a += x * x.transpose();
      b += x * std::sqrt(static_cast<double>(std::min(s.output, cap)));
    }
    for (int i = 1; i < 4; ++i) a(i, i) += 1.0;
    w_ = a.ldlt().solve(b);
  }
  double Prior(int64_t prompt, int64_t max_tokens) const {
    const double s = std::max(w_.dot(X(prompt, max_tokens)), 0.0);
    const double cap = max_tokens > 0 ? std::min(max_tokens, kBudget) : kBudget;
    return std::min(s * s, cap);
  }

 private:
  Eigen::Vector4d w_;
};

// leapd with a static readout (no P: it does not adapt, so predictions are
// fixed) routed as the default product line; both transports listening.
struct Leapd {
  testing::ScopedTempDir tmp;
  std::string sock, shm;
  std::unique_ptr<testing::Process> proc;
  readout::ReadoutState state;

  explicit Leapd(const std::string& name) : tmp(name) {
    sock = "unix://" + tmp.path() + "/leapd.sock";
    shm = tmp.path() + "/leap.shm";
    std::string addr;
    auto p = testing::StartLeapd(LEAPD_PATH, {"--listen=" + sock, "--shm=" + shm}, &addr);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return;
    proc = *std::move(p);
    state = testing::RandomState(kDim, 11, /*with_p=*/false);
    absl::StatusOr<std::string> artifact = readout::SerializeArtifact(state);
    EXPECT_TRUE(artifact.ok()) << artifact.status();
    auto admin = pb::Admin::NewStub(testing::MakeChannel(sock));
    grpc::ClientContext ctx;
    pb::CreateReadoutRequest req;
    req.set_name("r");
    req.set_artifact(*artifact);
    pb::ReadoutInfo info;
    grpc::Status s = admin->CreateReadout(&ctx, req, &info);
    EXPECT_TRUE(s.ok()) << s.error_message();
    grpc::ClientContext rctx;
    pb::SetRouteRequest route;
    route.mutable_route()->add_arms()->set_readout("r");
    route.mutable_route()->mutable_arms(0)->set_percent(100);
    pb::Route out;
    s = admin->SetRoute(&rctx, route, &out);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
};

std::unique_ptr<shim::Client> StartClient(const std::string& endpoint,
                                          ShimEvents* col) {
  auto c = testing::StartRecordedClient(
      testing::TestClientOptions(endpoint, kDim, "prior-test"), col);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

class LengthPriorE2E : public ::testing::TestWithParam<std::string> {};

TEST_P(LengthPriorE2E, LearnedFromCompletionsServedAtArrivalOrdersAdmission) {
  Leapd leapd("prior-" + GetParam());
  ASSERT_NE(leapd.proc, nullptr);
  const std::string endpoint =
      GetParam() == "shm" ? "shm://" + leapd.shm : leapd.sock;
  ShimEvents col;
  std::unique_ptr<shim::Client> client = StartClient(endpoint, &col);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->WaitConnected(absl::Seconds(10)));
  std::mt19937_64 rng(5);
  auto features = [&](const std::string& id, int64_t max_tokens) {
    shim::CapturedFeatures f;
    f.request_id = id;
    f.bytes = testing::Bytes(testing::RandomFeatures(leapd.state, rng));
    f.max_tokens = max_tokens;
    return f;
  };

  // Before any completion: no prior (no event), and a bad record in the
  // same query is refused with a precise error.
  client->RequestPriors({{"early", "", 100, 0}, {"bad-early", "", 0, 0}});
  ASSERT_TRUE(col.Wait([](const auto& ev) {
    return FindEvent(ev, Event::Kind::kError, "bad-early") != nullptr;
  }));
  {
    const auto ev = col.events();
    const Event* e = FindEvent(ev, Event::Kind::kError, "bad-early");
    EXPECT_EQ(e->code, 3);
    EXPECT_NE(e->message.find("prompt_tokens must be in [1, "), std::string::npos)
        << e->message;
    EXPECT_EQ(FindEvent(ev, Event::Kind::kPrior, "early"), nullptr);
    EXPECT_EQ(client->stats().priors_unavailable, 1);
  }

  // Traffic whose output grows with the prompt: learned completions (stops,
  // and length stops at a max_tokens of 100: learned at the cap), and
  // completions the prior must not learn (cancelled, aborted, no prompt
  // length given).
  std::vector<Sample> learned;
  std::vector<shim::CapturedFeatures> batch;
  struct Done {
    std::string id;
    int64_t output;
    shim::FinishReason reason;
    int64_t prompt;
  };
  std::vector<Done> done;
  for (int i = 0; i < 40; ++i) {
    const int64_t p = 20 + 10 * i, out = 3 * p + 7;
    batch.push_back(features(absl::StrCat("s", i), 0));
    done.push_back({batch.back().request_id, out, shim::FinishReason::kStop, p});
    learned.push_back({p, 0, out});
  }
  for (int i = 0; i < 8; ++i) {
    const int64_t p = 50 + 50 * i;
    batch.push_back(features(absl::StrCat("l", i), 100));
    done.push_back({batch.back().request_id, 100, shim::FinishReason::kLength, p});
    learned.push_back({p, 100, 100});
  }
  batch.push_back(features("cancelled", 0));
  done.push_back({"cancelled", 5, shim::FinishReason::kCancelled, 1000});
  batch.push_back(features("aborted", 0));
  done.push_back({"aborted", 3, shim::FinishReason::kAborted, 1000});
  batch.push_back(features("no-prompt", 0));
  done.push_back({"no-prompt", 2, shim::FinishReason::kStop, 0});
  // The last completion is refused (negative count): its error event is
  // the answer to the last completion message, so every completion before
  // it has been learned once it arrives (one stream, answered in order).
  batch.push_back(features("sentinel", 0));
  done.push_back({"sentinel", -1, shim::FinishReason::kStop, 10});
  client->Submit(std::move(batch));
  for (const Done& d : done) client->Complete(d.id, d.output, d.reason, d.prompt);
  ASSERT_TRUE(col.Wait([](const auto& ev) {
    return FindEvent(ev, Event::Kind::kError, "sentinel") != nullptr;
  }));
  EXPECT_EQ(FindEvent(col.events(), Event::Kind::kError, "sentinel")->code, 3);
  const Reference ref(learned);

  // Arrivals: in FCFS order long prompts first; one capped below its
  // prior; one of a product line that has learned nothing (no prior).
  const std::vector<shim::Arrival> arrivals = {
      {"a400", "", 400, 0}, {"a300c", "", 300, 50}, {"a200", "", 200, 0},
      {"a100", "", 100, 0}, {"a30", "", 30, 0},     {"other", "chat", 100, 0}};
  shim::SchedulerOptions so;
  so.slots = 1;
  so.waiting_cap = 0;
  auto sched = shim::CountdownScheduler::Create(so);
  ASSERT_TRUE(sched.ok()) << sched.status();
  for (const auto& a : arrivals) ASSERT_TRUE(sched->Add(a.request_id).ok());
  const std::vector<std::string> fcfs = sched->Order(arrivals.size());
  const size_t before = col.events().size();
  client->RequestPriors(arrivals);
  // Answered in one message: once five priors are in, "other" was answered
  // too (without a prior).
  ASSERT_TRUE(col.Wait([&](const auto& ev) {
    int n = 0;
    for (size_t i = before; i < ev.size(); ++i) n += ev[i].kind == Event::Kind::kPrior;
    return n == 5;
  }));
  const auto ev = col.events();
  std::map<std::string, double> value;  // what the scheduler ranks by
  for (const auto& a : arrivals) {
    const Event* e = FindEvent(ev, Event::Kind::kPrior, a.request_id);
    if (a.product_line == "chat") {
      EXPECT_EQ(e, nullptr) << "no prior before the line learned anything";
      value[a.request_id] = so.unpredicted_tokens;  // kMedian, nothing predicted
      continue;
    }
    ASSERT_NE(e, nullptr) << a.request_id;
    const double want = ref.Prior(a.prompt_tokens, a.max_tokens);
    EXPECT_NEAR(e->predicted_tokens, want, 1e-6 * std::max(want, 1.0)) << a.request_id;
    if (a.max_tokens > 0) {
      EXPECT_LE(e->predicted_tokens, a.max_tokens);
    }
    value[a.request_id] = e->predicted_tokens;
    ASSERT_TRUE(sched->SetPrior(a.request_id, e->predicted_tokens).ok());
  }
  EXPECT_EQ(client->stats().priors, 5);
  EXPECT_EQ(client->stats().priors_unavailable, 2);
  // The learned relation is increasing in the prompt: the priors are too.
  EXPECT_LT(value["a30"], value["a100"]);
  EXPECT_LT(value["a100"], value["a200"]);
  EXPECT_LT(value["a200"], value["a400"]);
  EXPECT_LT(value["a300c"], 50.0 + 1e-9);
  // Admission follows the prior: smallest first, ties by arrival.
  std::vector<std::string> want;
  for (const auto& a : arrivals) want.push_back(a.request_id);
  std::stable_sort(want.begin(), want.end(), [&](const auto& x, const auto& y) {
    return value[x] < value[y];
  });
  const std::vector<std::string> got = sched->Order(arrivals.size());
  EXPECT_EQ(got, want);
  EXPECT_NE(got, fcfs);

  // The unary RPC serves the same prior.
  auto stub = pb::Predictor::NewStub(testing::MakeChannel(leapd.sock));
  {
    grpc::ClientContext ctx;
    pb::PriorRequest req;
    req.mutable_record()->set_request_id("u");
    req.mutable_record()->set_prompt_tokens(200);
    pb::PriorResponse resp;
    const grpc::Status s = stub->Prior(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_TRUE(resp.prior().available());
    EXPECT_EQ(resp.prior().samples(), static_cast<int64_t>(learned.size()));
    EXPECT_DOUBLE_EQ(resp.prior().predicted_tokens(), value["a200"]);
  }

  // Issue 14, point 4: a request's max_tokens below the budget caps its
  // prediction (same features with and without a cap).
  shim::CapturedFeatures open_f = features("uncapped", 0);
  shim::CapturedFeatures capped_f = open_f;
  capped_f.request_id = "capped";
  capped_f.max_tokens = 5;
  client->Submit({open_f, capped_f});
  ASSERT_TRUE(col.Wait([](const auto& ev) {
    return FindEvent(ev, Event::Kind::kPrediction, "uncapped") != nullptr &&
           FindEvent(ev, Event::Kind::kPrediction, "capped") != nullptr;
  }));
  const auto ev2 = col.events();
  const double open_tokens =
      FindEvent(ev2, Event::Kind::kPrediction, "uncapped")->predicted_tokens;
  const double capped_tokens =
      FindEvent(ev2, Event::Kind::kPrediction, "capped")->predicted_tokens;
  EXPECT_GT(open_tokens, 5.0);  // the cap has something to cut
  EXPECT_EQ(capped_tokens, std::min(open_tokens, 5.0));
}

INSTANTIATE_TEST_SUITE_P(Transports, LengthPriorE2E,
                         ::testing::Values("grpc", "shm"));

// Bad input on the wire: each bad arrival record gets its own precise
// error and the good one in the same message is answered; a completion
// with a negative prompt length is refused and its request stays live; a
// message of a kind this leapd does not know (as a leapd older than priors
// sees prior_queries) is a message-level error carrying its seq, and the
// stream goes on.
TEST(LengthPriorWire, BadInputGetsAPreciseErrorAndNothingElseIsLost) {
  Leapd leapd("prior-wire");
  ASSERT_NE(leapd.proc, nullptr);
  testing::EngineStream e(testing::MakeChannel(leapd.sock), kDim);
  pb::EngineMessage q;
  auto add = [&](const std::string& id, int64_t prompt, int64_t cap) {
    pb::ArrivalRecord* r = q.mutable_prior_queries()->add_records();
    r->set_request_id(id);
    r->set_prompt_tokens(prompt);
    r->mutable_decoding()->set_max_tokens(cap);
  };
  add("", 10, 0);
  add("zero", 0, 0);
  add("neg-cap", 10, -1);
  add(std::string("n\0l", 3), 10, 0);
  add(std::string(300, 'l'), 10, 0);
  add("good", 10, 0);
  pb::SidecarMessage m = e.Call(q);
  ASSERT_TRUE(m.has_priors()) << m.DebugString();
  ASSERT_EQ(m.priors().priors_size(), 1);
  EXPECT_EQ(m.priors().priors(0).request_id(), "good");
  EXPECT_FALSE(m.priors().priors(0).available());
  ASSERT_EQ(m.priors().errors_size(), 5);
  const std::vector<std::string> want = {
      "request_id is empty", "prompt_tokens must be in [1, ",
      "decoding max_tokens must be in [0, ", "must not contain NUL",
      "arrival record: request_id of 300 bytes is over the limit of 256 bytes "
      "(it starts \"llllllllllllllllllllllllllllllll\")"};
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(m.priors().errors(i).code(), 3);
    EXPECT_NE(m.priors().errors(i).message().find(want[i]), std::string::npos)
        << m.priors().errors(i).message();
  }

  // A completion with a negative prompt length: refused, request kept.
  std::mt19937_64 rng(9);
  pb::EngineMessage f;
  pb::FeatureRecord* rec = f.mutable_features()->add_records();
  rec->set_request_id("x");
  rec->set_features(testing::Bytes(testing::RandomFeatures(leapd.state, rng)));
  ASSERT_EQ(e.Call(f).predictions().predictions_size(), 1);
  pb::EngineMessage c;
  pb::Completion* comp = c.mutable_completions()->add_completions();
  comp->set_request_id("x");
  comp->set_output_tokens(10);
  comp->set_reason(pb::FINISH_REASON_STOP);
  comp->set_prompt_tokens(-5);
  m = e.Call(c);
  ASSERT_TRUE(m.has_ack()) << m.DebugString();
  ASSERT_EQ(m.ack().errors_size(), 1);
  EXPECT_EQ(m.ack().errors(0).code(), 3);
  EXPECT_NE(m.ack().errors(0).message().find("completion prompt_tokens must be in [0, "),
            std::string::npos)
      << m.ack().errors(0).message();
  comp->set_prompt_tokens(7);
  m = e.Call(c);
  // Still live: answered (skipped by the readout, which has no P and does
  // not adapt; the prior learns it), not NOT_FOUND.
  EXPECT_EQ(m.ack().accepted() + m.ack().skipped(), 1) << m.DebugString();
  EXPECT_EQ(m.ack().errors_size(), 0) << m.DebugString();

  // An engine message of a kind unknown to this leapd.
  pb::EngineMessage unknown;
  unknown.GetReflection()->MutableUnknownFields(&unknown)->AddVarint(99, 1);
  const uint64_t seq = e.Send(unknown);
  ASSERT_TRUE(e.Await(seq, &m));
  ASSERT_TRUE(m.has_error()) << m.DebugString();
  EXPECT_EQ(m.seq(), seq);
  EXPECT_EQ(m.error().code(), 3);
  EXPECT_EQ(m.error().message(), "empty engine message");
  EXPECT_EQ(e.Call(q).priors().priors_size(), 1);  // the stream goes on

  // The unary RPC: INVALID_ARGUMENT with the same words.
  auto stub = pb::Predictor::NewStub(testing::MakeChannel(leapd.sock));
  grpc::ClientContext ctx;
  pb::PriorRequest req;
  req.mutable_record()->set_request_id("u");
  req.mutable_record()->set_prompt_tokens(-3);
  pb::PriorResponse resp;
  const grpc::Status s = stub->Prior(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("prompt_tokens must be in [1, "), std::string::npos)
      << s.error_message();
}

// A leapd built before priors: it does not know EngineMessage field 6, so
// the body it parses is empty and it answers exactly what HandleEngineMessage
// answers an empty message (see the unknown-kind check above). This stub
// answers so; features get a fixed prediction.
class OldLeapd final : public pb::Predictor::Service {
 public:
  grpc::Status Connect(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<pb::SidecarMessage, pb::EngineMessage>* s) override {
    pb::EngineMessage in;
    while (s->Read(&in)) {
      pb::SidecarMessage out;
      out.set_seq(in.seq());
      if (in.has_hello()) {
        out.mutable_hello_ack()->set_sidecar_id("old");
      } else if (in.has_features()) {
        for (const auto& r : in.features().records()) {
          pb::Prediction* p = out.mutable_predictions()->add_predictions();
          p->set_request_id(r.request_id());
          p->set_predicted_tokens(100);
          p->set_version(1);
        }
      } else if (in.has_completions() || in.has_cancels()) {
        out.mutable_ack();
      } else {
        out.mutable_error()->set_code(3);
        out.mutable_error()->set_message("empty engine message");
      }
      if (!s->Write(out)) break;
    }
    return grpc::Status::OK;
  }
};

TEST(LengthPriorClient, FailsOpenWithoutLeapdAndWithALeapdOlderThanPriors) {
  // No leapd at all: the queries are dropped at once, nothing waits.
  const testing::ScopedTempDir tmp("prior-open");
  ShimEvents col;
  {
    std::unique_ptr<shim::Client> client =
        StartClient("unix://" + tmp.path() + "/nobody.sock", &col);
    ASSERT_NE(client, nullptr);
    client->RequestPriors({{"a", "", 10, 0}, {"b", "", 20, 0}, {"c", "", 30, 0}});
    EXPECT_EQ(client->stats().priors_dropped, 3);
    EXPECT_TRUE(client->stats().degraded);
  }

  OldLeapd old;
  const std::string addr = "unix://" + tmp.path() + "/old.sock";
  grpc::ServerBuilder b;
  b.AddListeningPort(addr, grpc::InsecureServerCredentials());
  b.RegisterService(&old);
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ShimEvents col2;
  {
    std::unique_ptr<shim::Client> client = StartClient(addr, &col2);
    ASSERT_NE(client, nullptr);
    ASSERT_TRUE(client->WaitConnected(absl::Seconds(10)));
    client->RequestPriors({{"a", "", 10, 0}, {"b", "", 20, 0}});
    // Sent before the features (queries first), so answered before them.
    std::vector<float> x(kDim, 1.0f);
    client->Submit({{"a", "", testing::Bytes(x), 0}});
    ASSERT_TRUE(col2.Wait([](const auto& ev) {
      return FindEvent(ev, Event::Kind::kPrediction, "a") != nullptr;
    }));
    shim::ClientStats st = client->stats();
    EXPECT_TRUE(st.priors_unsupported);
    EXPECT_EQ(st.priors_dropped, 2);
    EXPECT_EQ(st.errors, 0) << "the old leapd's answer is not an engine error";
    for (const Event& e : col2.events()) EXPECT_NE(e.kind, Event::Kind::kError);
    // From now on on this connection: dropped at once.
    client->RequestPriors({{"c", "", 10, 0}});
    EXPECT_EQ(client->stats().priors_dropped, 3);
    EXPECT_FALSE(client->degraded());
  }
  server->Shutdown();
}

}  // namespace
}  // namespace leap

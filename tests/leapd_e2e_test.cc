// End to end: a real leapd process, driven by this test process as two
// engines (Connect streams) plus a WatchReadout subscriber.
//  - 10,000 requests with synthetic features and their completions (stops,
//    cancels, censored and budget-reaching length stops); at the end the
//    served theta equals the anchored closed form over exactly the learned
//    completions, computed here in FP64 (tolerance 1e-6 relative);
//  - every client saw every published version, and each engine received
//    rescored predictions for its still-live requests at the final version.
//  - Bad input: each row of the table gets its precise status, the
//    stream survives, and no readout changes.
#include <signal.h>
#include <sys/wait.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <thread>

#include "Eigen/Cholesky"
#include "Eigen/Core"
#include "gtest/gtest.h"
#include "readout/artifact.h"
#include "readout/ridge.h"
#include "readout/synth.h"
#include "tests/support/engine_client.h"
#include "tests/support/process.h"
#include "tests/support/scoped_temp_dir.h"

namespace leap {
namespace {

namespace pb = ::leap::v1;
using testing::EngineStream;

constexpr int64_t kDim = 64;
constexpr double kLambda = 10.0;
constexpr int64_t kBudget = 2048;

struct Server {
  std::unique_ptr<testing::Process> proc;
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::Admin::Stub> admin;
};

Server Start(std::vector<std::string> args) {
  Server s;
  auto p = testing::StartLeapd(LEAPD_PATH, std::move(args), &s.address);
  EXPECT_TRUE(p.ok()) << p.status();
  if (!p.ok()) return s;
  s.proc = std::move(*p);
  s.channel = testing::MakeChannel(s.address);
  s.admin = pb::Admin::NewStub(s.channel);
  return s;
}

void ColdReadout(Server& s, const std::string& name, int64_t dim,
                 bool default_route = true) {
  grpc::ClientContext ctx;
  pb::CreateReadoutRequest req;
  req.set_name(name);
  req.mutable_cold_start()->set_dim(dim);
  req.mutable_cold_start()->set_lambda(kLambda);
  pb::ReadoutInfo info;
  ASSERT_TRUE(s.admin->CreateReadout(&ctx, req, &info).ok());
  ASSERT_EQ(info.version(), 1);
  if (!default_route) return;
  grpc::ClientContext rctx;
  pb::SetRouteRequest route;
  pb::Arm* arm = route.mutable_route()->add_arms();
  arm->set_name(name);
  arm->set_readout(name);
  arm->set_percent(100);
  pb::Route out;
  ASSERT_TRUE(s.admin->SetRoute(&rctx, route, &out).ok());
}

std::string Bytes(const std::vector<float>& x) {
  return std::string(reinterpret_cast<const char*>(x.data()),
                     x.size() * sizeof(float));
}

Eigen::VectorXd ExportTheta(Server& s, const std::string& name,
                            int64_t* version = nullptr) {
  grpc::ClientContext ctx;
  pb::ExportReadoutRequest req;
  req.set_name(name);
  pb::ExportReadoutResponse resp;
  grpc::Status st = s.admin->ExportReadout(&ctx, req, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  auto state = readout::ParseArtifact(resp.artifact(), "export");
  EXPECT_TRUE(state.ok()) << state.status();
  if (version != nullptr) *version = resp.version();
  return state.ok() ? state->theta : Eigen::VectorXd();
}

struct Request {
  std::string id;
  std::vector<float> x;
  int64_t tokens;
  pb::FinishReason reason;
  int64_t cap;  // decoding max_tokens
  bool learned;
  bool stays_live;
};

// The anchor: an offline Ridge fit (with its standardization and P0) on
// source-domain data, uploaded as an artifact. Returns the training rows.
struct Anchor {
  std::vector<float> x;
  std::vector<int64_t> len;
  readout::Standardizer st;
  double lambda;
};

Anchor TrainAndUpload(Server& s, const std::string& name,
                      readout::SynthGenerator& gen) {
  Anchor an;
  const int64_t rows = 3000;
  an.x.resize(rows * kDim);
  an.len.resize(rows);
  auto code = readout::BuiltinDomain("code");
  std::mt19937_64 rng(99);
  for (int64_t r = 0; r < rows; ++r) {
    an.len[r] = gen.Draw(*code, rng, an.x.data() + r * kDim);
  }
  readout::RidgeOptions o;
  o.lambda = an.lambda = 0.01 * rows;
  auto fit = readout::FitRidge({an.x.data(), readout::DType::kFloat32, rows, kDim},
                               an.len, o);
  EXPECT_TRUE(fit.ok()) << fit.status();
  readout::ReadoutState st;
  st.spec.dim = kDim;
  st.spec.lambda = fit->lambda;
  st.standardizer = fit->standardizer;
  st.theta = fit->theta;
  st.p = std::move(fit->p0);
  st.version = 1;
  an.st = st.standardizer;
  auto bytes = readout::SerializeArtifact(st);
  EXPECT_TRUE(bytes.ok());
  grpc::ClientContext ctx;
  pb::CreateReadoutRequest req;
  req.set_name(name);
  req.set_artifact(*bytes);
  pb::ReadoutInfo info;
  grpc::Status status = s.admin->CreateReadout(&ctx, req, &info);
  EXPECT_TRUE(status.ok()) << status.error_message();
  grpc::ClientContext rctx;
  pb::SetRouteRequest route;
  pb::Arm* arm = route.mutable_route()->add_arms();
  arm->set_readout(name);
  arm->set_percent(100);
  pb::Route out;
  EXPECT_TRUE(s.admin->SetRoute(&rctx, route, &out).ok());
  return an;
}

TEST(LeapdEndToEnd, TenThousandRequestsMatchAnchoredClosedForm) {
  Server s = Start({"--rls_batch=8", "--rls_batch_max=8", "--rls_flush=20ms"});
  ASSERT_NE(s.proc, nullptr);
  readout::SynthOptions so;
  so.dim = kDim;
  auto gen = readout::SynthGenerator::Create(so);
  ASSERT_TRUE(gen.ok());
  const Anchor anchor = TrainAndUpload(s, "r", *gen);

  // The WatchReadout subscriber, from before any publish.
  grpc::ClientContext watch_ctx;
  pb::WatchReadoutRequest wreq;
  wreq.set_readout("r");
  auto predictor = pb::Predictor::NewStub(s.channel);
  auto watch = predictor->WatchReadout(&watch_ctx, wreq);
  pb::ReadoutVersion first;
  ASSERT_TRUE(watch->Read(&first));
  ASSERT_EQ(first.version(), 1);

  EngineStream a(s.channel, kDim), b(s.channel, kDim);
  // The hello acks (seq 0) prove both streams are registered for publishes.
  pb::SidecarMessage ack;
  ASSERT_TRUE(a.Await(0, &ack));
  ASSERT_TRUE(b.Await(0, &ack));

  // Synthetic requests from another domain than the anchor's.
  auto chat = readout::BuiltinDomain("chat");
  std::mt19937_64 rng(7);
  std::vector<Request> reqs(10000);
  for (int i = 0; i < 10000; ++i) {
    Request& r = reqs[i];
    r.id = "req-" + std::to_string(i);
    r.x.resize(kDim);
    r.tokens = gen->Draw(*chat, rng, r.x.data());
    r.cap = 0;
    r.reason = pb::FINISH_REASON_STOP;
    r.learned = true;
    switch (i % 20) {
      case 0:
        r.reason = pb::FINISH_REASON_CANCELLED;
        r.learned = false;
        break;
      case 1:  // stopped by its own cap below M: censored
        r.reason = pb::FINISH_REASON_LENGTH;
        r.cap = 100;
        r.tokens = 100;
        r.learned = false;
        break;
      case 2:  // reached the budget: learned as sqrt(M)
        r.reason = pb::FINISH_REASON_LENGTH;
        r.tokens = kBudget;
        break;
    }
    r.stays_live = i >= 9900;
    if (r.stays_live) r.learned = false;
  }

  auto drive = [&](EngineStream& e, int parity) {
    for (int start = parity * 50; start < 10000; start += 100) {
      pb::EngineMessage fm;
      for (int i = start; i < start + 50; ++i) {
        pb::FeatureRecord* rec = fm.mutable_features()->add_records();
        rec->set_request_id(reqs[i].id);
        rec->set_features(Bytes(reqs[i].x));
        rec->mutable_decoding()->set_max_tokens(reqs[i].cap);
      }
      pb::SidecarMessage pm = e.Call(fm);
      ASSERT_TRUE(pm.has_predictions()) << pm.DebugString();
      ASSERT_EQ(pm.predictions().predictions_size(), 50);
      ASSERT_EQ(pm.predictions().errors_size(), 0);
      for (const auto& p : pm.predictions().predictions()) {
        ASSERT_GE(p.predicted_tokens(), 1.0);
        ASSERT_LE(p.predicted_tokens(), kBudget + 1e-6);
        ASSERT_EQ(p.readout(), "r");
      }
      pb::EngineMessage cm;
      int expected_learned = 0, expected_skipped = 0;
      for (int i = start; i < start + 50; ++i) {
        if (reqs[i].stays_live) continue;
        pb::Completion* c = cm.mutable_completions()->add_completions();
        c->set_request_id(reqs[i].id);
        c->set_output_tokens(reqs[i].tokens);
        c->set_reason(reqs[i].reason);
        (reqs[i].learned ? expected_learned : expected_skipped)++;
      }
      if (cm.completions().completions_size() == 0) continue;
      pb::SidecarMessage am = e.Call(cm);
      ASSERT_TRUE(am.has_ack()) << am.DebugString();
      ASSERT_EQ(am.ack().errors_size(), 0);
      ASSERT_EQ(am.ack().accepted(), expected_learned);
      ASSERT_EQ(am.ack().skipped(), expected_skipped);
    }
  };
  std::thread ta([&] { drive(a, 0); });
  std::thread tb([&] { drive(b, 1); });
  ta.join();
  tb.join();
  // One more learned completion (unary path), sent after every live request
  // is in: the version it publishes must rescore all of them. (The last
  // drive batches' publishes may land before the live requests arrive.)
  {
    Request tail;
    tail.id = "tail";
    tail.x.resize(kDim);
    tail.tokens = gen->Draw(*chat, rng, tail.x.data());
    tail.reason = pb::FINISH_REASON_STOP;
    tail.cap = 0;
    tail.learned = true;
    tail.stays_live = false;
    grpc::ClientContext pctx;
    pb::PredictRequest preq;
    preq.set_dtype(pb::FEATURE_DTYPE_FLOAT32);
    preq.mutable_record()->set_request_id(tail.id);
    preq.mutable_record()->set_features(Bytes(tail.x));
    pb::PredictResponse presp;
    ASSERT_TRUE(predictor->Predict(&pctx, preq, &presp).ok());
    grpc::ClientContext cctx;
    pb::CompleteRequest creq;
    creq.mutable_completion()->set_request_id(tail.id);
    creq.mutable_completion()->set_output_tokens(tail.tokens);
    creq.mutable_completion()->set_reason(pb::FINISH_REASON_STOP);
    pb::CompleteResponse cresp;
    ASSERT_TRUE(predictor->Complete(&cctx, creq, &cresp).ok());
    ASSERT_TRUE(cresp.learned());
    reqs.push_back(std::move(tail));
  }

  int64_t learned = 0;
  for (const Request& r : reqs) learned += r.learned ? 1 : 0;
  // 500 cancelled, 500 censored, 100 left live (10 of them already one of
  // those): 8,910 learned, plus the tail request.
  ASSERT_EQ(learned, 8911);

  // Follow WatchReadout until every learned completion is applied.
  std::vector<int64_t> watched = {first.version()};
  pb::ReadoutVersion v;
  while (watched.back() == 1 || v.completions_learned() < learned) {
    ASSERT_TRUE(watch->Read(&v)) << "watch ended at version " << watched.back();
    watched.push_back(v.version());
  }
  ASSERT_EQ(v.completions_learned(), learned);
  const int64_t final_version = v.version();
  watch_ctx.TryCancel();
  // WatchReadout delivered every version, in order.
  for (size_t i = 0; i < watched.size(); ++i) {
    ASSERT_EQ(watched[i], static_cast<int64_t>(i) + 1);
  }

  // The served theta against the FP64 anchored closed form:
  //   theta* = (A0 + sum u u')^-1 (U0'y0 + sum u y),  A0 = U0'U0 + lambda D,
  // with the artifact's standardization; u of a learned completion is the
  // float vector the sidecar learns from, u0 rows are FP64 (as in the fit).
  const int64_t n = kDim + 1;
  Eigen::MatrixXd a_mat = Eigen::MatrixXd::Zero(n, n);
  Eigen::VectorXd rhs = Eigen::VectorXd::Zero(n);
  for (size_t r = 0; r < anchor.len.size(); ++r) {
    Eigen::VectorXd u(n);
    for (int64_t i = 0; i < kDim; ++i) {
      u[i] = (anchor.x[r * kDim + i] - anchor.st.mean[i]) / anchor.st.scale[i];
    }
    u[kDim] = 1.0;
    a_mat.selfadjointView<Eigen::Lower>().rankUpdate(u);
    rhs += std::sqrt(static_cast<double>(std::min(anchor.len[r], kBudget))) * u;
  }
  for (int64_t i = 0; i < kDim; ++i) a_mat(i, i) += anchor.lambda;
  for (const Request& r : reqs) {
    if (!r.learned) continue;
    Eigen::VectorXd u(n);
    for (int64_t i = 0; i < kDim; ++i) {
      u[i] = static_cast<float>((r.x[i] - anchor.st.mean[i]) / anchor.st.scale[i]);
    }
    u[kDim] = 1.0;
    a_mat.selfadjointView<Eigen::Lower>().rankUpdate(u);
    rhs += std::sqrt(static_cast<double>(std::min(r.tokens, kBudget))) * u;
  }
  const Eigen::VectorXd theta_star =
      Eigen::MatrixXd(a_mat.selfadjointView<Eigen::Lower>()).ldlt().solve(rhs);
  int64_t exported_version = 0;
  const Eigen::VectorXd theta = ExportTheta(s, "r", &exported_version);
  ASSERT_EQ(exported_version, final_version);
  const double err = (theta - theta_star).norm() / theta_star.norm();
  std::printf("served theta vs FP64 closed form over %lld learned "
              "completions: rel err %.3g (%lld versions)\n",
              static_cast<long long>(learned), err,
              static_cast<long long>(final_version));
  EXPECT_LT(err, 1e-6);

  // Both engines saw every published version and got rescores for their
  // live requests at the final version.
  for (EngineStream* e : {&a, &b}) {
    const int parity = e == &a ? 0 : 1;
    std::set<std::string> live;
    for (int i = 9900; i < 10000; ++i) {
      if ((i / 50) % 2 == parity) live.insert(reqs[i].id);
    }
    ASSERT_EQ(live.size(), 50u);
    ASSERT_TRUE(e->WaitUntil([&] {
      auto rs = e->rescores("r");
      auto it = rs.find(final_version);
      if (it == rs.end()) return false;
      for (const auto& id : live) {
        if (it->second.count(id) == 0) return false;
      }
      return true;
    })) << "no rescore of the live requests at version " << final_version;
    auto rs = e->rescores("r")[final_version];
    EXPECT_EQ(rs.size(), live.size());  // only this engine's live requests
    for (const auto& [id, p] : rs) EXPECT_EQ(p.version(), final_version);
    ASSERT_TRUE(e->WaitUntil([&] {
      auto pubs = e->published("r");
      return !pubs.empty() && pubs.back() >= final_version;
    }));
    const std::vector<int64_t> pubs = e->published("r");
    ASSERT_EQ(static_cast<int64_t>(pubs.size()), final_version - 1);
    for (size_t i = 0; i < pubs.size(); ++i) {
      ASSERT_EQ(pubs[i], static_cast<int64_t>(i) + 2);
    }
  }
  EXPECT_TRUE(a.Finish().ok());
  EXPECT_TRUE(b.Finish().ok());

  // Prometheus /metrics carries the series README.md lists, with these figures.
  std::string metrics_addr;
  for (const std::string& line : s.proc->lines()) {
    if (line.rfind("metrics on http://", 0) == 0) {
      metrics_addr = line.substr(18, line.find("/metrics") - 18);
    }
  }
  ASSERT_FALSE(metrics_addr.empty());
  auto body = testing::HttpGet(metrics_addr, "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  for (const std::string& want :
       {std::string("leap_predictions_total{arm_kind=\"serving\",readout=\"r\"} 10001"),
        std::string("leap_completions_total{outcome=\"learned\",readout=\"r\"} 8911"),
        std::string("leap_completions_total{outcome=\"skipped_cancelled\",readout=\"r\"} 495"),
        std::string("leap_readout_version{readout=\"r\"} ") + std::to_string(final_version),
        std::string("leap_feature_cache_entries 100"),
        std::string("leap_rls_batch_seconds_count"), std::string("leap_readout_spearman{readout=\"r\"}"),
        std::string("leap_prediction_latency_seconds_bucket"), std::string("leap_connected_engines")}) {
    EXPECT_NE(body->find(want), std::string::npos) << "missing: " << want;
  }

  // SIGTERM: clean exit.
  s.proc->Signal(SIGTERM);
  const int status = s.proc->Wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

int32_t FirstErrorCode(const pb::SidecarMessage& m) {
  if (m.has_predictions() && m.predictions().errors_size() > 0) {
    return m.predictions().errors(0).code();
  }
  if (m.has_ack() && m.ack().errors_size() > 0) return m.ack().errors(0).code();
  if (m.has_error()) return m.error().code();
  return 0;
}

std::string FirstErrorMessage(const pb::SidecarMessage& m) {
  if (m.has_predictions() && m.predictions().errors_size() > 0) {
    return m.predictions().errors(0).message();
  }
  if (m.has_ack() && m.ack().errors_size() > 0) {
    return m.ack().errors(0).message();
  }
  return m.error().message();
}

TEST(LeapdEndToEnd, BadInputGetsPreciseErrorsAndChangesNothing) {
  Server s = Start({"--rls_batch=1", "--rls_batch_max=1", "--max_batch_bytes=65536",
                    "--feature_cache_bytes=1048576"});
  ASSERT_NE(s.proc, nullptr);
  ColdReadout(s, "r", kDim);
  EngineStream e(s.channel, kDim);
  std::vector<float> x(kDim, 0.25f);
  auto features = [&](const std::string& id, const std::string& payload,
                      const std::string& product_line = "") {
    pb::EngineMessage m;
    auto* r = m.mutable_features()->add_records();
    r->set_request_id(id);
    r->set_features(payload);
    r->set_product_line(product_line);
    return m;
  };
  // A first good request, learned, so the readout has a version to protect.
  ASSERT_EQ(e.Call(features("good-0", Bytes(x))).predictions().predictions_size(), 1);
  {
    pb::EngineMessage c;
    auto* cc = c.mutable_completions()->add_completions();
    cc->set_request_id("good-0");
    cc->set_output_tokens(300);
    cc->set_reason(pb::FINISH_REASON_STOP);
    ASSERT_EQ(e.Call(c).ack().accepted(), 1);
  }
  // Wait for it to be applied (version 2), then snapshot theta.
  grpc::ClientContext wctx;
  pb::WatchReadoutRequest wreq;
  wreq.set_readout("r");
  auto predictor = pb::Predictor::NewStub(s.channel);
  auto watch = predictor->WatchReadout(&wctx, wreq);
  pb::ReadoutVersion v;
  do {
    ASSERT_TRUE(watch->Read(&v));
  } while (v.version() < 2);
  wctx.TryCancel();
  int64_t version_before = 0;
  const Eigen::VectorXd theta_before = ExportTheta(s, "r", &version_before);

  // Wrong dimension: expected and got named.
  std::vector<float> short_x(kDim - 1, 0.1f);
  pb::SidecarMessage m = e.Call(features("bad-dim", Bytes(short_x)));
  EXPECT_EQ(FirstErrorCode(m), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(FirstErrorMessage(m).find("hello declared dim 64"), std::string::npos)
      << FirstErrorMessage(m);
  EXPECT_NE(FirstErrorMessage(m).find("252 bytes"), std::string::npos);
  // NaN and Inf.
  for (float bad : {NAN, INFINITY}) {
    std::vector<float> y = x;
    y[5] = bad;
    m = e.Call(features("bad-nan", Bytes(y)));
    EXPECT_EQ(FirstErrorCode(m), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(FirstErrorMessage(m).find("element 5"), std::string::npos)
        << FirstErrorMessage(m);
  }
  // Product line without a route: no default route for it once we remove it.
  {
    grpc::ClientContext ctx;
    pb::DeleteRouteRequest req;
    pb::DeleteRouteResponse resp;
    ASSERT_TRUE(s.admin->DeleteRoute(&ctx, req, &resp).ok());
  }
  m = e.Call(features("no-route", Bytes(x), "search"));
  EXPECT_EQ(FirstErrorCode(m), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(FirstErrorMessage(m).find("search"), std::string::npos);
  // Route to an unknown readout is refused by Admin with NOT_FOUND.
  {
    grpc::ClientContext ctx;
    pb::SetRouteRequest req;
    auto* arm = req.mutable_route()->add_arms();
    arm->set_readout("nope");
    arm->set_percent(100);
    pb::Route out;
    EXPECT_EQ(s.admin->SetRoute(&ctx, req, &out).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  ColdReadout(s, "r2", kDim);  // restores a default route (to r2)
  {
    grpc::ClientContext ctx;
    pb::SetRouteRequest req;
    auto* arm = req.mutable_route()->add_arms();
    arm->set_readout("r");
    arm->set_percent(100);
    pb::Route out;
    ASSERT_TRUE(s.admin->SetRoute(&ctx, req, &out).ok());
  }
  // Duplicate live id.
  ASSERT_EQ(e.Call(features("live-1", Bytes(x))).predictions().predictions_size(), 1);
  m = e.Call(features("live-1", Bytes(x)));
  EXPECT_EQ(FirstErrorCode(m), grpc::StatusCode::ALREADY_EXISTS);
  // Completion for an unknown request: NOT_FOUND, counted.
  pb::EngineMessage c;
  auto* cc = c.mutable_completions()->add_completions();
  cc->set_request_id("never-seen");
  cc->set_output_tokens(10);
  cc->set_reason(pb::FINISH_REASON_STOP);
  m = e.Call(c);
  EXPECT_EQ(FirstErrorCode(m), grpc::StatusCode::NOT_FOUND);
  // Negative and absurd token counts: INVALID_ARGUMENT, request stays live.
  for (int64_t tokens : {int64_t{-5}, int64_t{1} << 40}) {
    cc->set_request_id("live-1");
    cc->set_output_tokens(tokens);
    m = e.Call(c);
    EXPECT_EQ(FirstErrorCode(m), grpc::StatusCode::INVALID_ARGUMENT);
  }
  // Oversize message: RESOURCE_EXHAUSTED, the stream goes on.
  {
    pb::EngineMessage big;
    for (int i = 0; i < 300; ++i) {
      auto* r = big.mutable_features()->add_records();
      r->set_request_id("big-" + std::to_string(i));
      r->set_features(Bytes(x));
    }
    m = e.Call(big);
    EXPECT_EQ(FirstErrorCode(m), grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  // Unary Predict: unspecified dtype.
  {
    grpc::ClientContext ctx;
    pb::PredictRequest req;
    req.mutable_record()->set_request_id("u-1");
    req.mutable_record()->set_features(Bytes(x));
    pb::PredictResponse resp;
    grpc::Status st = predictor->Predict(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(st.error_message().find("dtype"), std::string::npos);
  }
  // Cache full: 1 MiB holds ~3,000 requests of 256 B features + bookkeeping;
  // 5,000 live requests evict the oldest, counted.
  for (int b = 0; b < 50; ++b) {
    pb::EngineMessage many;
    for (int i = 0; i < 100; ++i) {
      auto* r = many.mutable_features()->add_records();
      r->set_request_id("fill-" + std::to_string(b * 100 + i));
      r->set_features(Bytes(x));
    }
    ASSERT_EQ(e.Call(many).predictions().predictions_size(), 100);
  }
  pb::StatsResponse stats;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(s.admin->GetStats(&ctx, pb::GetStatsRequest(), &stats).ok());
  }
  EXPECT_GE(stats.unknown_completions(), 1);
  EXPECT_GT(stats.evicted_capacity(), 0);
  EXPECT_LE(stats.feature_cache_bytes(), 1048576);

  // The stream survived: a good request still works, on the same stream.
  m = e.Call(features("good-1", Bytes(x)));
  ASSERT_EQ(m.predictions().predictions_size(), 1);
  EXPECT_EQ(m.predictions().predictions(0).version(), version_before);
  // No readout changed.
  int64_t version_after = 0;
  const Eigen::VectorXd theta_after = ExportTheta(s, "r", &version_after);
  EXPECT_EQ(version_after, version_before);
  EXPECT_EQ(theta_after, theta_before);
  EXPECT_TRUE(e.alive());
}

// A request scored by a readout that is deleted and re-created under the
// same name with another width is never learned by the new one (and does
// not crash it): the completion is skipped as readout_deleted.
TEST(LeapdEndToEnd, RecreatedReadoutNeverLearnsAnotherWidthsRequest) {
  Server s = Start({"--rls_batch=1", "--rls_batch_max=1"});
  ASSERT_NE(s.proc, nullptr);
  ColdReadout(s, "a", 32);
  auto predictor = pb::Predictor::NewStub(s.channel);
  std::vector<float> x(32, 0.5f);
  {
    grpc::ClientContext ctx;
    pb::PredictRequest req;
    req.set_dtype(pb::FEATURE_DTYPE_FLOAT32);
    req.mutable_record()->set_request_id("old");
    req.mutable_record()->set_features(Bytes(x));
    pb::PredictResponse resp;
    ASSERT_TRUE(predictor->Predict(&ctx, req, &resp).ok());
  }
  ColdReadout(s, "b", 64);  // takes the default route
  {
    grpc::ClientContext ctx;
    pb::DeleteReadoutRequest req;
    req.set_name("a");
    pb::DeleteReadoutResponse resp;
    ASSERT_TRUE(s.admin->DeleteReadout(&ctx, req, &resp).ok());
  }
  ColdReadout(s, "a", 64);
  grpc::ClientContext ctx;
  pb::CompleteRequest req;
  req.mutable_completion()->set_request_id("old");
  req.mutable_completion()->set_output_tokens(100);
  req.mutable_completion()->set_reason(pb::FINISH_REASON_STOP);
  pb::CompleteResponse resp;
  ASSERT_TRUE(predictor->Complete(&ctx, req, &resp).ok());
  EXPECT_FALSE(resp.learned());
  EXPECT_EQ(resp.skip_reason(), "readout_deleted");
  grpc::ClientContext gctx;
  pb::GetReadoutRequest greq;
  greq.set_name("a");
  pb::ReadoutInfo info;
  ASSERT_TRUE(s.admin->GetReadout(&gctx, greq, &info).ok());
  EXPECT_EQ(info.completions_learned(), 0);
  EXPECT_EQ(info.dim(), 64);
}

// leapd's own threads carry the names docs/ARCHITECTURE.md ("Threads")
// gives them, so that per-thread CPU time (top -H, perf, /proc) tells the
// RLS worker, the checkpoint writer, the shm loop, the completion writers
// and a Connect stream's writer from gRPC's pool (fleet mode, whose
// threads are named too, is not started here).
TEST(LeapdEndToEnd, ThreadsCarryTheirDocumentedNames) {
  const testing::ScopedTempDir tmp("leapd_thread_names");
  Server s = Start({"--data_dir=" + tmp.path() + "/db",
                    "--shm=" + tmp.path() + "/leap.shm"});
  ASSERT_NE(s.proc, nullptr);
  ColdReadout(s, "a", 32);  // adaptive: an RLS worker and a checkpoint writer
  // A Connect stream has a writer thread; the stream's handler names it
  // before it reads the next message, so this round trip orders the two.
  testing::EngineStream engine(s.channel, 32);
  pb::EngineMessage cancel;
  cancel.mutable_cancels()->add_request_ids("none");
  engine.Call(cancel);
  // Every thread is named by its creator before the call that made it
  // (CreateReadout, leapd's start, the hello) returned.
  std::multiset<std::string> names;
  const std::string task = "/proc/" + std::to_string(s.proc->pid()) + "/task";
  for (const auto& e : std::filesystem::directory_iterator(task)) {
    std::ifstream comm(e.path() / "comm");
    std::string name;
    std::getline(comm, name);
    names.insert(name);
  }
  std::string all;
  for (const std::string& n : names) all += n + " ";
  EXPECT_EQ(names.count("leap-rls"), 1u) << all;
  EXPECT_EQ(names.count("leap-ckpt"), 1u) << all;
  EXPECT_EQ(names.count("leap-shm"), 1u) << all;
  EXPECT_EQ(names.count("leap-complete"), 8u) << all;
  EXPECT_EQ(names.count("leap-conn-write"), 1u) << all;
  EXPECT_TRUE(engine.Finish().ok());
}

}  // namespace
}  // namespace leap

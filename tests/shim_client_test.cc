// The engine shim's Client against a real leapd process: predictions and
// rescores arrive asynchronously, completions are learned, and after a
// sidecar restart (kill -9, same unix socket, state on disk) the client
// reconnects by itself and resubmits its live requests, which get
// predictions again; nothing blocks the caller.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "Eigen/Cholesky"
#include "Eigen/Core"
#include "absl/strings/str_cat.h"
#include "engine_shim/client.h"
#include "gtest/gtest.h"
#include "readout/artifact.h"
#include "tests/support/engine_client.h"
#include "tests/support/process.h"
#include "tests/support/scoped_temp_dir.h"
#include "tests/support/shim_events.h"

namespace leap {
namespace {

namespace pb = ::leap::v1;
using shim::Event;
using testing::ShimEvents;

constexpr int64_t kDim = 32;

int Count(const std::vector<Event>& ev, Event::Kind kind,
          const std::set<std::string>& ids, int64_t min_version = 0) {
  std::set<std::string> seen;
  for (const Event& e : ev) {
    if (e.kind == kind && ids.count(e.request_id) && e.version >= min_version) {
      seen.insert(e.request_id);
    }
  }
  return static_cast<int>(seen.size());
}

shim::CapturedFeatures Features(const std::string& id, std::mt19937& rng) {
  std::normal_distribution<float> n01;
  std::vector<float> x(kDim);
  for (auto& v : x) v = n01(rng);
  return {id, "", std::string(reinterpret_cast<const char*>(x.data()), kDim * 4), 0};
}

// Readout "r" (cold start, lambda 1) at `sock` has learned exactly these
// completions (features, output tokens): its exported theta is the FP64
// closed form over them, so a completion learned twice, or learned from
// other features, fails.
void ExpectLearnedExactly(
    const std::string& sock,
    const std::vector<std::pair<const shim::CapturedFeatures*, int>>& learned) {
  auto admin = pb::Admin::NewStub(testing::MakeChannel(sock));
  grpc::ClientContext ctx;
  pb::ExportReadoutRequest req;
  req.set_name("r");
  pb::ExportReadoutResponse resp;
  ASSERT_TRUE(admin->ExportReadout(&ctx, req, &resp).ok());
  auto state = readout::ParseArtifact(resp.artifact(), "export");
  ASSERT_TRUE(state.ok()) << state.status();
  const int64_t n = kDim + 1;
  Eigen::MatrixXd m = Eigen::MatrixXd::Identity(n, n);  // lambda = 1
  Eigen::VectorXd rhs = Eigen::VectorXd::Zero(n);
  for (const auto& [f, tokens] : learned) {
    Eigen::VectorXd u(n);
    const float* x = reinterpret_cast<const float*>(f->bytes.data());
    for (int64_t j = 0; j < kDim; ++j) u[j] = x[j];
    u[kDim] = 1;
    m += u * u.transpose();
    rhs += u * std::sqrt(static_cast<double>(tokens));
  }
  const Eigen::VectorXd want = m.llt().solve(rhs);
  EXPECT_LT((state->theta - want).norm() / want.norm(), 1e-6);
}

// leapd on a unix socket and a shared-memory segment in a fresh folder, with
// its state on disk and every completion learned at once (batches of 1);
// `endpoint` is the one of the test's transport ("unix" or "shm": there a
// restart also means a new segment).
struct Sidecar {
  testing::ScopedTempDir tmp;
  std::string dir, sock, endpoint;
  std::vector<std::string> args;
  std::unique_ptr<testing::Process> proc;

  Sidecar(const std::string& name, const std::string& transport)
      : tmp(name),
        dir(tmp.path()),
        sock("unix://" + dir + "/leapd.sock"),
        endpoint(transport == "shm" ? "shm://" + dir + "/leap.shm" : sock),
        args({"--listen=" + sock, "--data_dir=" + dir + "/db", "--rls_batch=1",
              "--rls_batch_max=1", "--shm=" + dir + "/leap.shm"}) {}
  // Starts leapd (the same arguments every time, so the same state).
  void Start() {
    std::string addr;
    auto p = testing::StartLeapd(LEAPD_PATH, args, &addr);
    ASSERT_TRUE(p.ok()) << p.status();
    proc = *std::move(p);
  }
  // Starts it and creates a cold-start readout "r" of width kDim routed as
  // the default product line.
  void StartWithReadout() {
    ASSERT_NO_FATAL_FAILURE(Start());
    const grpc::Status s = testing::CreateDefaultReadout(sock, "r", kDim);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  // kill -9; returns once `col` saw the client report it disconnected
  // (after the kConnected of that session: each session's two events come
  // once each, in that order).
  void Kill(ShimEvents& col) {
    const int before = ShimEvents::CountOf(col.events(), Event::Kind::kDisconnected);
    proc->Signal(SIGKILL);
    proc->Wait();
    ASSERT_TRUE(col.Wait([before](const auto& ev) {
      return ShimEvents::CountOf(ev, Event::Kind::kDisconnected) > before;
    }));
    bool open = false;
    for (const Event& e : col.events()) {
      if (e.kind == Event::Kind::kConnected) {
        EXPECT_FALSE(open) << "kConnected twice without a kDisconnected";
        open = true;
      } else if (e.kind == Event::Kind::kDisconnected) {
        EXPECT_TRUE(open) << "kDisconnected without its kConnected";
        open = false;
      }
    }
    EXPECT_FALSE(open);
  }
  // Starts it again on the same socket (a killed leapd leaves the file).
  void Restart() {
    std::filesystem::remove(dir + "/leapd.sock");
    ASSERT_NO_FATAL_FAILURE(Start());
  }
};

// The same engine code over both data planes: gRPC on a unix socket, and
// shared memory (where the restart also means a new segment: the client
// reattaches and resubmits into new slots).
class ShimClient : public ::testing::TestWithParam<std::string> {};

TEST_P(ShimClient, PredictsLearnsRescoresAndSurvivesSidecarRestart) {
  Sidecar leapd("shim-" + GetParam(), GetParam());
  ASSERT_NO_FATAL_FAILURE(leapd.StartWithReadout());
  const std::string& sock = leapd.sock;

  // Before the client: its threads call back into `col` until it is destroyed.
  ShimEvents col;
  auto client = testing::StartConnectedClient(
      testing::TestClientOptions(leapd.endpoint, kDim, "test"), &col);
  ASSERT_TRUE(client.ok()) << client.status();

  std::mt19937 rng(3);
  std::vector<shim::CapturedFeatures> batch;
  std::set<std::string> all, live;
  for (int i = 0; i < 6; ++i) {
    batch.push_back(Features("q" + std::to_string(i), rng));
    all.insert(batch.back().request_id);
  }
  (*client)->Submit(std::move(batch));
  ASSERT_TRUE(col.Wait([&](const auto& ev) {
    return Count(ev, Event::Kind::kPrediction, all) == 6;
  })) << "predictions did not arrive";

  // Two finish; the readout learns them and the others are rescored.
  (*client)->Complete("q0", 400, shim::FinishReason::kStop);
  (*client)->Complete("q1", 30, shim::FinishReason::kStop);
  live = {"q2", "q3", "q4", "q5"};
  ASSERT_TRUE(col.Wait([&](const auto& ev) {
    return Count(ev, Event::Kind::kRescore, live, /*min_version=*/3) == 4;
  })) << "no rescore at version 3 for the live requests";

  // Bad input is an error event, not an exception or a block.
  (*client)->Submit({{"bad", "", std::string(12, '\0'), 0}});
  ASSERT_TRUE(col.Wait([&](const auto& ev) {
    for (const Event& e : ev) {
      if (e.kind == Event::Kind::kError && e.request_id == "bad" && e.code == 3) return true;
    }
    return false;
  }));

  // The sidecar dies and comes back on the same socket with its state.
  ASSERT_NO_FATAL_FAILURE(leapd.Kill(col));
  const size_t before_restart = col.events().size();
  ASSERT_NO_FATAL_FAILURE(leapd.Restart());
  ASSERT_TRUE(col.Wait([&](const auto& ev) {
    std::vector<Event> after(ev.begin() + before_restart, ev.end());
    return Count(after, Event::Kind::kPrediction, live) == 4;
  })) << "live requests were not resubmitted and predicted after the restart";
  EXPECT_GE((*client)->stats().resubmitted, 4);
  EXPECT_GE((*client)->stats().connects, 2);

  // Their completions are learned by the restarted sidecar.
  for (const std::string& id : live) (*client)->Complete(id, 100, shim::FinishReason::kStop);
  EXPECT_EQ(testing::AwaitLearned(sock, "r", 6, std::chrono::seconds(30)), 6);
  // The acks carry no event (a Wait on events would only look again at its
  // timeout): poll the client's counters.
  const absl::Time acked_by = absl::Now() + absl::Seconds(30);
  while ((*client)->stats().live != 0 && absl::Now() < acked_by) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // poll period
  }
  ASSERT_EQ((*client)->stats().live, 0);

  // A completion leapd refuses for good (a negative output length:
  // INVALID_ARGUMENT) is an error event and dropped, never resent (only
  // UNAVAILABLE is resent: shm_fleet_test).
  (*client)->Submit({Features("neg", rng)});
  ASSERT_TRUE(col.Wait([&](const auto& ev) {
    return testing::FindEvent(ev, Event::Kind::kPrediction, "neg") != nullptr;
  }));
  (*client)->Complete("neg", -5, shim::FinishReason::kStop);
  ASSERT_TRUE(col.Wait([&](const auto& ev) {
    return testing::FindEvent(ev, Event::Kind::kError, "neg") != nullptr;
  }));
  const std::vector<Event> seen = col.events();
  const shim::Event* refused = testing::FindEvent(seen, Event::Kind::kError, "neg");
  ASSERT_NE(refused, nullptr);
  EXPECT_EQ(refused->code, 3) << refused->message;
  EXPECT_EQ((*client)->stats().live, 0);
  EXPECT_EQ((*client)->stats().completion_retries, 0);
}

// Two engines that both use the request id "x": each gets its own
// prediction and each completion is learned with its own features (theta vs
// the FP64 closed form); two clients that claim the same instance id get
// the collision as an error event (ALREADY_EXISTS), not silence.
TEST_P(ShimClient, SameIdFromTwoEnginesIsTwoRequestsAndCollisionsAreReported) {
  Sidecar leapd("shim2-" + GetParam(), GetParam());
  ASSERT_NO_FATAL_FAILURE(leapd.StartWithReadout());
  const std::string& sock = leapd.sock;

  auto start = [&](const std::string& instance, ShimEvents* col) {
    // The same pod name: not an identity.
    shim::ClientOptions o = testing::TestClientOptions(leapd.endpoint, kDim, "pod");
    o.instance_id = instance;
    auto c = testing::StartConnectedClient(std::move(o), col);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  };
  ShimEvents col_a, col_b;
  auto a = start("", &col_a);  // random instance ids
  auto b = start("", &col_b);
  ASSERT_TRUE(a != nullptr && b != nullptr);
  std::mt19937 rng(7);
  const shim::CapturedFeatures fa = Features("x", rng);
  const shim::CapturedFeatures fb = Features("x", rng);
  a->Submit({fa});
  ASSERT_TRUE(col_a.Wait([&](const auto& ev) {
    return Count(ev, Event::Kind::kPrediction, {"x"}) == 1;
  }));
  b->Submit({fb});
  ASSERT_TRUE(col_b.Wait([&](const auto& ev) {
    for (const Event& e : ev) {
      if (e.request_id == "x" && (e.kind == Event::Kind::kPrediction ||
                                  e.kind == Event::Kind::kError)) {
        return true;
      }
    }
    return false;
  })) << "engine B got neither a prediction nor an error for its 'x'";
  ASSERT_EQ(Count(col_b.events(), Event::Kind::kPrediction, {"x"}), 1)
      << "engine B's 'x' was not predicted";
  b->Complete("x", 900, shim::FinishReason::kStop);
  a->Complete("x", 100, shim::FinishReason::kStop);
  // The acks carry no event: poll the client's counters.
  auto settled = [](const std::function<bool()>& pred) {
    const absl::Time end = absl::Now() + absl::Seconds(30);
    while (!pred() && absl::Now() < end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));  // poll period
    }
    return pred();
  };
  ASSERT_TRUE(settled([&] { return a->stats().live == 0 && b->stats().live == 0; }));
  EXPECT_EQ(a->stats().errors, 0);
  EXPECT_EQ(b->stats().errors, 0);
  // Both learned, each with its own features.
  EXPECT_EQ(testing::AwaitLearned(sock, "r", 2, std::chrono::seconds(30)), 2);
  ExpectLearnedExactly(sock, {{&fa, 100}, {&fb, 900}});

  // Two clients claiming one instance id: the second "y" is a collision,
  // reported as an error event, and the first is unaffected.
  ShimEvents col_c, col_d;
  auto c = start("shared-instance", &col_c);
  auto d = start("shared-instance", &col_d);
  ASSERT_TRUE(c != nullptr && d != nullptr);
  c->Submit({Features("y", rng)});
  ASSERT_TRUE(col_c.Wait([&](const auto& ev) {
    return Count(ev, Event::Kind::kPrediction, {"y"}) == 1;
  }));
  d->Submit({Features("y", rng)});
  ASSERT_TRUE(col_d.Wait([&](const auto& ev) {
    for (const Event& e : ev) {
      if (e.kind == Event::Kind::kError && e.request_id == "y" && e.code == 6) return true;
    }
    return false;
  })) << "the collision was not reported";
  EXPECT_EQ(d->stats().live, 0);
  EXPECT_EQ(c->stats().live, 1);
}

// A callback set after Start gets the events queued before it, first and
// in order, before SetCallback returns (here an error of Submit, kConnected
// and a prediction, all emitted before the call); later ones as they come.
// Nothing is left for Poll, and nothing is delivered twice.
TEST_P(ShimClient, SetCallbackAfterStartGetsTheEventsQueuedBefore) {
  Sidecar leapd("shimcb-" + GetParam(), GetParam());
  ASSERT_NO_FATAL_FAILURE(leapd.StartWithReadout());
  auto client = shim::Client::Start(testing::TestClientOptions(leapd.endpoint, kDim, "cb"));
  ASSERT_TRUE(client.ok()) << client.status();
  // Emitted by Submit itself, before it returns: queued.
  (*client)->Submit({{"early-bad", "", std::string(12, '\0'), 0}});
  ASSERT_TRUE((*client)->WaitConnected(absl::Seconds(10)));
  std::mt19937 rng(5);
  (*client)->Submit({Features("p0", rng)});
  // The reader counts a prediction after it emitted kConnected (one thread,
  // in order): once counted, kConnected is queued. No event can announce it
  // (no callback yet): poll the counter.
  const absl::Time by = absl::Now() + absl::Seconds(30);
  while ((*client)->stats().predictions < 1 && absl::Now() < by) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // poll period
  }
  ASSERT_EQ((*client)->stats().predictions, 1);

  ShimEvents col;
  shim::Client* c = client->get();
  (*client)->SetCallback([&col, c](const Event& e) {
    col.Add(e);
    // A callback may call Submit; what that emits comes right after it.
    if (e.kind == Event::Kind::kPrediction && e.request_id == "p1") {
      c->Submit({{"nested-bad", "", std::string(12, '\0'), 0}});
    }
  });
  // Delivered during SetCallback: no wait.
  std::vector<Event> now = col.events();
  ASSERT_GE(now.size(), 2u);
  EXPECT_EQ(now[0].kind, Event::Kind::kError);
  EXPECT_EQ(now[0].request_id, "early-bad");
  EXPECT_EQ(now[0].code, 3);
  EXPECT_NE(testing::FindEvent(now, Event::Kind::kConnected, ""), nullptr);
  // The prediction was counted before it was emitted: it comes now or soon.
  ASSERT_TRUE(col.Wait([&](const auto& ev) {
    return testing::FindEvent(ev, Event::Kind::kPrediction, "p0") != nullptr;
  }));
  EXPECT_TRUE((*client)->Poll().empty());
  // Later events go to the callback as they come.
  (*client)->Submit({Features("p1", rng)});
  ASSERT_TRUE(col.Wait([&](const auto& ev) {
    return testing::FindEvent(ev, Event::Kind::kError, "nested-bad") != nullptr;
  }));
  now = col.events();
  ASSERT_GE(now.size(), 2u);
  EXPECT_EQ(now[now.size() - 2].request_id, "p1");
  EXPECT_EQ(now.back().request_id, "nested-bad");
  auto count = [&](Event::Kind kind) {
    return std::count_if(now.begin(), now.end(),
                         [kind](const Event& e) { return e.kind == kind; });
  };
  EXPECT_EQ(count(Event::Kind::kConnected), 1);
  EXPECT_EQ(count(Event::Kind::kError), 2);
  EXPECT_EQ(count(Event::Kind::kPrediction), 2);
  // Back to Poll: later events are queued again.
  (*client)->SetCallback(nullptr);
  (*client)->Submit({{"late-bad", "", std::string(12, '\0'), 0}});
  const std::vector<Event> polled = (*client)->Poll();
  ASSERT_EQ(polled.size(), 1u);
  EXPECT_EQ(polled[0].request_id, "late-bad");
  EXPECT_EQ(col.events().size(), now.size());
}

int CountKind(const std::vector<Event>& ev, Event::Kind kind) {
  return ShimEvents::CountOf(ev, kind);
}

// Submits n requests "<prefix>0".."<prefix>n-1" in one batch and waits for
// a prediction of each; returns their ids (empty after a failed wait).
std::set<std::string> SubmitAndAwaitPredictions(shim::Client& client, ShimEvents& col,
                                                const std::string& prefix, int n,
                                                std::mt19937& rng) {
  std::vector<shim::CapturedFeatures> batch;
  std::set<std::string> ids;
  for (int i = 0; i < n; ++i) {
    batch.push_back(Features(absl::StrCat(prefix, i), rng));
    ids.insert(batch.back().request_id);
  }
  client.Submit(std::move(batch));
  const bool all = col.Wait([&](const auto& ev) {
    return Count(ev, Event::Kind::kPrediction, ids) == n;
  });
  EXPECT_TRUE(all) << n << " predictions did not arrive; errors: "
                   << CountKind(col.events(), Event::Kind::kError);
  return all ? ids : std::set<std::string>();
}

// A request id or product line longer than leapd takes (kMaxIdBytes, 256),
// also one larger than a whole shm frame (20,000 bytes; the smallest ring,
// used here, carries 16,376 per frame), is refused by Submit and by
// RequestPriors as an error event for itself alone: INVALID_ARGUMENT in
// leapd's words, naming the size, the limit and the id's start
// (docs/WIRE.md, "Sizes"). The connection stays up (one connect, no
// disconnect), and the requests around it are predicted and learned; an id
// of exactly 256 bytes is served.
TEST_P(ShimClient, OverlongIdsAreRefusedAloneAndTheConnectionStays) {
  Sidecar leapd("shimid-" + GetParam(), GetParam());
  ASSERT_NO_FATAL_FAILURE(leapd.StartWithReadout());
  ShimEvents col;
  shim::ClientOptions o = testing::TestClientOptions(leapd.endpoint, kDim, "ids");
  o.shm_ring_bytes = 1 << 16;
  auto client = testing::StartConnectedClient(o, &col);
  ASSERT_TRUE(client.ok()) << client.status();

  std::mt19937 rng(11);
  const std::string huge(20000, 'h'), over(257, 'o'), at_limit(256, 'k');
  const std::string huge_prior(20000, 'q');
  shim::CapturedFeatures long_line = Features("long-line", rng);
  long_line.product_line = std::string(257, 'p');
  std::vector<shim::CapturedFeatures> batch;
  for (const std::string& id : {std::string("before"), huge, over}) {
    batch.push_back(Features(id, rng));
  }
  batch.push_back(long_line);
  batch.push_back(Features(at_limit, rng));
  batch.push_back(Features("after", rng));
  (*client)->Submit(std::move(batch));
  (*client)->RequestPriors({{huge_prior, "", 10, 0}, {"prior-ok", "", 10, 0}});
  const std::set<std::string> served = {"before", at_limit, "after"};
  ASSERT_TRUE(col.Wait([&](const auto& ev) {
    return Count(ev, Event::Kind::kPrediction, served) == 3;
  })) << "the requests around the refused ones were not predicted";

  const std::vector<Event> ev = col.events();
  auto refusal = [&](const std::string& id) {
    const Event* e = testing::FindEvent(ev, Event::Kind::kError, id);
    EXPECT_NE(e, nullptr) << id.substr(0, 8) << "... (" << id.size() << " bytes)";
    if (e == nullptr) return std::string();
    EXPECT_EQ(e->code, 3) << e->message;
    return e->message;
  };
  EXPECT_EQ(refusal(huge), "request_id of 20000 bytes is over the limit of 256 bytes "
                           "(it starts \"" + std::string(32, 'h') + "\")");
  EXPECT_EQ(refusal(over), "request_id of 257 bytes is over the limit of 256 bytes "
                           "(it starts \"" + std::string(32, 'o') + "\")");
  EXPECT_EQ(refusal("long-line"), "product_line of 257 bytes is over the limit of 256 "
                                  "bytes (it starts \"" + std::string(32, 'p') + "\")");
  EXPECT_EQ(refusal(huge_prior), "arrival record: request_id of 20000 bytes is over the "
                                 "limit of 256 bytes (it starts \"" +
                                     std::string(32, 'q') + "\")");
  EXPECT_EQ(CountKind(ev, Event::Kind::kError), 4);

  // Completing a refused id does nothing; the served ones are learned.
  (*client)->Complete(huge, 10, shim::FinishReason::kStop);
  for (const std::string& id : served) (*client)->Complete(id, 50, shim::FinishReason::kStop);
  ASSERT_TRUE(testing::AwaitNoneLive(**client)) << "live: " << (*client)->stats().live;
  const shim::ClientStats st = (*client)->stats();
  EXPECT_EQ(st.connects, 1);
  EXPECT_EQ(st.errors, 4);
  EXPECT_EQ(st.predictions, 3);
  EXPECT_EQ(st.completion_retries, 0);
  EXPECT_EQ(CountKind(col.events(), Event::Kind::kDisconnected), 0);
  EXPECT_EQ(CountKind(col.events(), Event::Kind::kError), 4);
}

// leapd takes at most --max_batch_bytes of features per message (here the
// least it allows, 1,024 bytes), and says so in its HelloAck: the client
// sends a larger batch as several messages (100 requests of 128 bytes, one
// Submit, all predicted, no error), and refuses a request whose features
// alone are larger (2,048 bytes: RESOURCE_EXHAUSTED naming both sizes, for
// it alone; the connection stays). Over shm too, where leapd takes the
// features from slots: the client behaves the same on both transports.
TEST_P(ShimClient, BatchesStayWithinLeapdsMaxBatchBytes) {
  Sidecar leapd("shimbb-" + GetParam(), GetParam());
  leapd.args.push_back("--max_batch_bytes=1024");
  ASSERT_NO_FATAL_FAILURE(leapd.Start());
  constexpr int64_t kWide = 512;
  for (const auto& [name, dim] : {std::pair<const char*, int64_t>{"wide", kWide}, {"r", kDim}}) {
    // The default route ends on "r".
    const grpc::Status s = testing::CreateDefaultReadout(leapd.sock, name, dim);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  ShimEvents col;
  shim::ClientOptions o = testing::TestClientOptions(leapd.endpoint, kDim, "batch");
  o.max_batch_records = 1024;
  auto client = testing::StartConnectedClient(o, &col);
  ASSERT_TRUE(client.ok()) << client.status();
  std::mt19937 rng(13);
  ASSERT_EQ(SubmitAndAwaitPredictions(**client, col, "m", 100, rng).size(), 100u);
  EXPECT_EQ(CountKind(col.events(), Event::Kind::kError), 0);

  ShimEvents wide_col;
  auto wide = testing::StartConnectedClient(
      testing::TestClientOptions(leapd.endpoint, kWide, "wide"), &wide_col);
  ASSERT_TRUE(wide.ok()) << wide.status();
  std::normal_distribution<float> n01;
  std::vector<float> x(kWide);
  for (auto& v : x) v = n01(rng);
  (*wide)->Submit({{"w0", "", std::string(reinterpret_cast<const char*>(x.data()), kWide * 4), 0}});
  ASSERT_TRUE(wide_col.Wait([&](const auto& ev) {
    return testing::FindEvent(ev, Event::Kind::kError, "w0") != nullptr;
  }));
  const std::vector<Event> wide_ev = wide_col.events();
  const Event* e = testing::FindEvent(wide_ev, Event::Kind::kError, "w0");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->code, 8) << e->message;
  EXPECT_EQ(e->message, "features of 2048 bytes exceed leapd's max_batch_bytes (1024)");
  EXPECT_EQ((*wide)->stats().live, 0);
  EXPECT_EQ((*wide)->stats().connects, 1);
  EXPECT_EQ(CountKind(wide_col.events(), Event::Kind::kDisconnected), 0);
  EXPECT_EQ((*client)->stats().connects, 1);
}

// Completions given while leapd is down wait in the client; after the
// restart it resubmits the requests' features and then sends their
// completions (a completion never goes before its own request's features,
// though a step's completions otherwise go first): all are learned, none is
// refused, nothing collides.
TEST_P(ShimClient, CompletionsGivenWhileLeapdIsDownAreLearnedAfterTheRestart) {
  Sidecar leapd("shimdown-" + GetParam(), GetParam());
  ASSERT_NO_FATAL_FAILURE(leapd.StartWithReadout());
  ShimEvents col;
  auto client = testing::StartConnectedClient(
      testing::TestClientOptions(leapd.endpoint, kDim, "down"), &col);
  ASSERT_TRUE(client.ok()) << client.status();
  std::mt19937 rng(19);
  const std::set<std::string> ids = SubmitAndAwaitPredictions(**client, col, "d", 5, rng);
  ASSERT_EQ(ids.size(), 5u);
  ASSERT_NO_FATAL_FAILURE(leapd.Kill(col));
  for (const std::string& id : ids) (*client)->Complete(id, 60, shim::FinishReason::kStop);
  ASSERT_NO_FATAL_FAILURE(leapd.Restart());
  ASSERT_TRUE(testing::AwaitNoneLive(**client)) << "live: " << (*client)->stats().live;
  EXPECT_EQ(testing::AwaitLearned(leapd.sock, "r", 5, std::chrono::seconds(30)), 5)
      << "not all learned within 30 s";
  const shim::ClientStats st = (*client)->stats();
  EXPECT_GE(st.resubmitted, 5);
  EXPECT_EQ(st.completion_retries, 0);
  // (Errors without a request id are the failed reconnects meanwhile.)
  for (const Event& e : col.events()) {
    EXPECT_FALSE(e.kind == Event::Kind::kError && !e.request_id.empty())
        << e.request_id << ": " << e.code << " " << e.message;
  }
}

// An id cancelled and submitted again while leapd is down is one new
// request once a leapd answers: the restarted leapd predicts it from the
// new features, the cancel of the old one costs no error, and its
// completion is learned once.
TEST_P(ShimClient, IdCancelledAndResubmittedWhileLeapdIsDownIsOneNewRequest) {
  Sidecar leapd("shimreuse-" + GetParam(), GetParam());
  ASSERT_NO_FATAL_FAILURE(leapd.StartWithReadout());
  ShimEvents col;
  auto client = testing::StartConnectedClient(
      testing::TestClientOptions(leapd.endpoint, kDim, "reuse"), &col);
  ASSERT_TRUE(client.ok()) << client.status();
  std::mt19937 rng(23);
  (*client)->Submit({Features("c", rng)});
  ASSERT_TRUE(col.Wait([&](const auto& ev) {
    return testing::FindEvent(ev, Event::Kind::kPrediction, "c") != nullptr;
  }));
  ASSERT_NO_FATAL_FAILURE(leapd.Kill(col));
  const size_t before = col.events().size();
  const shim::CapturedFeatures fresh = Features("c", rng);
  (*client)->Cancel("c");
  (*client)->Submit({fresh});
  EXPECT_EQ((*client)->stats().live, 1);
  ASSERT_NO_FATAL_FAILURE(leapd.Restart());
  ASSERT_TRUE(col.Wait([&](const auto& ev) {
    for (size_t i = before; i < ev.size(); ++i) {
      if (ev[i].kind == Event::Kind::kPrediction && ev[i].request_id == "c") {
        return true;
      }
    }
    return false;
  })) << "no prediction for the resubmitted request";
  (*client)->Complete("c", 60, shim::FinishReason::kStop);
  ASSERT_TRUE(testing::AwaitNoneLive(**client)) << "live: " << (*client)->stats().live;
  EXPECT_EQ(testing::AwaitLearned(leapd.sock, "r", 1, std::chrono::seconds(30)), 1);
  ExpectLearnedExactly(leapd.sock, {{&fresh, 60}});  // once, from the new features
  EXPECT_EQ((*client)->stats().completion_retries, 0);
  // (Errors without a request id are the failed reconnects meanwhile.)
  for (const Event& e : col.events()) {
    EXPECT_FALSE(e.kind == Event::Kind::kError && !e.request_id.empty())
        << e.request_id << ": " << e.code << " " << e.message;
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, ShimClient, ::testing::Values("unix", "shm"),
                         [](const auto& info) { return info.param; });

// Over shm every live request holds a feature slot until leapd releases it
// (after its completion or cancel). With every slot held, a new request is
// refused at once (RESOURCE_EXHAUSTED, for it alone): the requests holding
// the slots end only when the engine completes them, so waiting for a slot
// would hold up the very completions that free one. A request submitted
// right after a completion (the same step) gets the slot that completion
// frees: the completion goes first and the client waits for the release it
// is owed; a cancel frees one the same way, also for a new request under
// the cancelled id. connect_timeout (the shm send deadline) is far above
// the waits here, so a client that waited for a slot it is not owed would
// miss them. (Whether Complete and the next Submit share one message of
// the client's is up to its thread: when they do, a client that sent the
// features first would refuse n0.)
TEST(ShimClientShm, FullSlotsRefuseAtOnceAndACompletionFreesOneForTheNextRequest) {
  Sidecar leapd("shimslots", "shm");
  ASSERT_NO_FATAL_FAILURE(leapd.StartWithReadout());
  ShimEvents col;
  shim::ClientOptions o = testing::TestClientOptions(leapd.endpoint, kDim, "slots");
  o.shm_slots = 4;
  o.connect_timeout = absl::Seconds(120);
  o.response_timeout = absl::Seconds(300);
  auto client = testing::StartConnectedClient(o, &col, o.connect_timeout);
  ASSERT_TRUE(client.ok()) << client.status();
  std::mt19937 rng(17);
  std::vector<shim::CapturedFeatures> batch;
  const std::set<std::string> first = {"s0", "s1", "s2", "s3"};
  for (const std::string& id : first) batch.push_back(Features(id, rng));
  (*client)->Submit(std::move(batch));
  ASSERT_TRUE(col.Wait([&](const auto& ev) {
    return Count(ev, Event::Kind::kPrediction, first) == 4;
  }));

  // Every slot is held: x0 and x1 are refused, each with its own error.
  batch.clear();
  batch.push_back(Features("x0", rng));
  batch.push_back(Features("x1", rng));
  (*client)->Submit(std::move(batch));
  ASSERT_TRUE(col.Wait([&](const auto& ev) {
    return Count(ev, Event::Kind::kError, {"x0", "x1"}) == 2;
  }, absl::Seconds(60))) << "no refusal within 60 s";
  for (const std::string id : {"x0", "x1"}) {
    const std::vector<Event> ev = col.events();
    const Event* e = testing::FindEvent(ev, Event::Kind::kError, id);
    ASSERT_NE(e, nullptr) << id;
    EXPECT_EQ(e->code, 8) << e->message;
    EXPECT_EQ(e->message, "all 4 shm feature slots hold live requests; raise the "
                          "client's shm_slots");
  }

  // One ends and the next arrives in the same step: n0 gets s0's slot.
  (*client)->Complete("s0", 40, shim::FinishReason::kStop);
  (*client)->Submit({Features("n0", rng)});
  ASSERT_TRUE(col.Wait([&](const auto& ev) {
    return Count(ev, Event::Kind::kPrediction, {"n0"}) == 1 ||
           Count(ev, Event::Kind::kError, {"n0"}) == 1;
  }, absl::Seconds(60))) << "n0 neither predicted nor refused within 60 s";
  EXPECT_EQ(Count(col.events(), Event::Kind::kPrediction, {"n0"}), 1)
      << "n0 was refused: " << testing::FindEvent(col.events(), Event::Kind::kError, "n0")->message;

  // A cancel frees a slot the same way, here for a new request under the
  // cancelled one's id (the cancel goes first, so leapd sees no collision).
  (*client)->Cancel("s1");
  (*client)->Submit({Features("s1", rng)});
  auto s1_predictions = [](const std::vector<Event>& ev) {
    int n = 0;
    for (const Event& e : ev) n += e.kind == Event::Kind::kPrediction && e.request_id == "s1";
    return n;
  };
  ASSERT_TRUE(col.Wait([&](const auto& ev) {
    return s1_predictions(ev) == 2 || Count(ev, Event::Kind::kError, {"s1"}) == 1;
  }, absl::Seconds(60))) << "the new s1 neither predicted nor refused within 60 s";
  EXPECT_EQ(s1_predictions(col.events()), 2);
  EXPECT_EQ(Count(col.events(), Event::Kind::kError, {"s1"}), 0);

  for (const std::string id : {"s1", "s2", "s3", "n0"}) {
    (*client)->Complete(id, 40, shim::FinishReason::kStop);
  }
  ASSERT_TRUE(testing::AwaitNoneLive(**client)) << "live: " << (*client)->stats().live;
  const shim::ClientStats st = (*client)->stats();
  EXPECT_EQ(st.errors, 2);
  EXPECT_EQ(st.predictions, 6);
  EXPECT_EQ(st.connects, 1);
  EXPECT_EQ(CountKind(col.events(), Event::Kind::kDisconnected), 0);
}

// Options checked by Start, before any I/O: the message names the option,
// the allowed values and the value given.
TEST(ShimClientOptions, BadIdsAndShmGeometryAreRefusedByStart) {
  auto refused = [](shim::ClientOptions o) {
    o.endpoint = "unix:///nowhere";
    o.dim = 8;
    auto c = shim::Client::Start(o);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(c.status().message());
  };
  shim::ClientOptions o;
  o.instance_id = std::string(129, 'i');
  EXPECT_EQ(refused(o), "instance_id must be at most 128 bytes without NUL, got 129 bytes");
  o.instance_id = std::string("a\0b", 3);
  EXPECT_EQ(refused(o),
            "instance_id must be at most 128 bytes without NUL, got 3 bytes with a NUL");
  // engine_id and model_id: leapd's bound on a hello's ids, in its words.
  o = {};
  o.engine_id = std::string(257, 'e');
  EXPECT_EQ(refused(o), "engine_id of 257 bytes is over the limit of 256 bytes (it starts \"" +
                            std::string(32, 'e') + "\")");
  o.engine_id = std::string(70000, 'E');
  EXPECT_EQ(refused(o), "engine_id of 70000 bytes is over the limit of 256 bytes (it starts \"" +
                            std::string(32, 'E') + "\")");
  o.engine_id.clear();
  o.model_id = std::string(300, 'm');
  EXPECT_EQ(refused(o), "model_id of 300 bytes is over the limit of 256 bytes (it starts \"" +
                            std::string(32, 'm') + "\")");
  o = {};
  for (uint32_t bad : {0u, (1u << 20) + 1}) {
    o.shm_slots = bad;
    EXPECT_EQ(refused(o), "shm_slots must be in [1, 1048576], got " + std::to_string(bad));
  }
  o = {};
  for (uint32_t bad : {0u, 65535u, 3u * 65536, 1u << 27}) {
    o.shm_ring_bytes = bad;
    EXPECT_EQ(refused(o), "shm_ring_bytes must be a power of two in [65536, 67108864], got " +
                              std::to_string(bad));
  }
  o = {};
  o.endpoint = "unix:///nowhere";
  o.dim = 8;
  o.instance_id = std::string(128, 'i');
  o.engine_id = std::string(256, 'e');
  o.model_id = std::string(256, 'm');
  o.shm_slots = 1u << 20;
  o.shm_ring_bytes = 1u << 16;
  auto c = shim::Client::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->instance_id(), std::string(128, 'i'));
  o.instance_id.clear();
  auto made = shim::Client::Start(o);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ((*made)->instance_id().size(), 32u);  // made up by Start
}

}  // namespace
}  // namespace leap

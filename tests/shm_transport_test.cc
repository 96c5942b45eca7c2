// The shared-memory data plane against real leapd processes.
//
// Conformance: one scripted engine session (predictions, bad input of every
// kind, completions with a publish and rescoring, cancels, message-level
// errors) runs over the gRPC Connect stream and over shm, each against a
// fresh leapd in the same starting state; every answer, every rescore of
// the published version and every publish notice must be identical.
//
// Hostile and broken engines: out-of-range slot indices, reused slots,
// truncated frames and a corrupt ring are refused without harm to leapd or
// to a second engine; refused attaches say why (dim no readout takes, too
// many slots, wrong format version).
#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "engine_shim/shm_channel.h"
#include "engine_shim/internal/transport.h"
#include "gtest/gtest.h"
#include "tests/support/engine_client.h"
#include "tests/support/process.h"
#include "tests/support/scoped_temp_dir.h"

namespace leap {
namespace {

namespace pb = ::leap::v1;
constexpr int64_t kDim = 32;

std::string Features(int seed, float poison = 0.0f) {
  std::vector<float> x(kDim);
  for (int i = 0; i < kDim; ++i) {
    x[i] = std::sin(0.37f * static_cast<float>(seed * kDim + i)) + 0.1f * seed;
  }
  if (poison != 0.0f) x[5] = poison;
  return std::string(reinterpret_cast<const char*>(x.data()), x.size() * 4);
}

// Reads a Transport on a thread and keeps every message.
class Recorder {
 public:
  explicit Recorder(shim::Transport* t) : t_(t), thread_([this] { Loop(); }) {}
  ~Recorder() {
    t_->Close();
    thread_.join();
  }
  bool WaitUntil(const std::function<bool(const std::vector<pb::SidecarMessage>&)>& pred,
                 absl::Duration timeout = absl::Seconds(30)) {
    absl::MutexLock lock(&mu_);
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pred(msgs_); };
    return mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  }
  std::vector<pb::SidecarMessage> messages() {
    absl::MutexLock lock(&mu_);
    return msgs_;
  }

 private:
  void Loop() {
    pb::SidecarMessage m;
    while (t_->Receive(&m)) {
      absl::MutexLock lock(&mu_);
      msgs_.push_back(m);
    }
  }
  shim::Transport* t_;
  absl::Mutex mu_;
  std::vector<pb::SidecarMessage> msgs_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

bool Answered(const std::vector<pb::SidecarMessage>& ms, uint64_t seq) {
  for (const auto& m : ms) {
    if (m.seq() == seq) return true;
  }
  return false;
}

// What a session saw, normalized: answers per seq (records of split
// answers merged, sorted by request id), the rescore of version 3 per
// request, and the versions announced.
struct Outcome {
  std::map<uint64_t, std::string> answers;
  std::map<std::string, std::string> rescore_v3;
  std::set<int64_t> published;
  std::string sidecar_id;
};

Outcome Normalize(const std::vector<pb::SidecarMessage>& ms) {
  Outcome o;
  std::map<uint64_t, pb::SidecarMessage> merged;
  for (const auto& m : ms) {
    if (m.has_rescore()) {
      if (m.rescore().version() == 3) {
        for (const auto& p : m.rescore().predictions()) {
          o.rescore_v3[p.request_id()] = p.DebugString();
        }
      }
      continue;
    }
    if (m.has_published()) {
      o.published.insert(m.published().version());
      continue;
    }
    if (m.has_hello_ack()) {
      o.sidecar_id = m.hello_ack().sidecar_id();
      pb::SidecarMessage c = m;
      c.mutable_hello_ack()->clear_sidecar_id();
      merged[m.seq()] = c;
      continue;
    }
    auto [it, fresh] = merged.emplace(m.seq(), m);
    if (!fresh && m.has_predictions()) {
      for (const auto& p : m.predictions().predictions()) {
        *it->second.mutable_predictions()->add_predictions() = p;
      }
      for (const auto& e : m.predictions().errors()) {
        *it->second.mutable_predictions()->add_errors() = e;
      }
    }
  }
  for (auto& [seq, m] : merged) {
    if (m.has_predictions()) {
      auto* p = m.mutable_predictions()->mutable_predictions();
      std::sort(p->begin(), p->end(), [](const auto& a, const auto& b) {
        return a.request_id() < b.request_id();
      });
      auto* e = m.mutable_predictions()->mutable_errors();
      std::sort(e->begin(), e->end(), [](const auto& a, const auto& b) {
        return a.request_id() < b.request_id();
      });
    }
    o.answers[seq] = m.DebugString();
  }
  return o;
}

struct Leapd {
  // First: removed after proc is stopped.
  std::unique_ptr<testing::ScopedTempDir> tmp;
  std::string dir, sock, shm;
  std::unique_ptr<testing::Process> proc;
};

Leapd StartLeapd(const std::string& name) {
  Leapd l;
  l.tmp = std::make_unique<testing::ScopedTempDir>("shm-" + name);
  l.dir = l.tmp->path();
  l.sock = "unix://" + l.dir + "/leapd.sock";
  l.shm = l.dir + "/leap.shm";
  std::string addr;
  auto p = testing::StartLeapd(
      LEAPD_PATH, {"--listen=" + l.sock, "--shm=" + l.shm, "--rls_batch=1", "--rls_batch_max=1"}, &addr);
  EXPECT_TRUE(p.ok()) << p.status();
  if (!p.ok()) return l;
  l.proc = *std::move(p);
  const grpc::Status s = testing::CreateDefaultReadout(l.sock, "r", kDim);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return l;
}

pb::EngineMessage Hello(uint64_t seq) {
  pb::EngineMessage m;
  m.set_seq(seq);
  m.mutable_hello()->set_engine_id("conformance");
  m.mutable_hello()->set_dim(kDim);
  m.mutable_hello()->set_dtype(pb::FEATURE_DTYPE_FLOAT32);
  return m;
}

void AddRecord(pb::EngineMessage* m, const std::string& id, std::string bytes) {
  auto* r = m->mutable_features()->add_records();
  r->set_request_id(id);
  r->set_features(std::move(bytes));
}

void AddCompletion(pb::EngineMessage* m, const std::string& id, int64_t tokens,
                   pb::FinishReason reason) {
  auto* c = m->mutable_completions()->add_completions();
  c->set_request_id(id);
  c->set_output_tokens(tokens);
  c->set_reason(reason);
}

Outcome RunScenario(const std::string& endpoint) {
  auto t = shim::Dial(endpoint, absl::Seconds(10));
  EXPECT_TRUE(t.ok()) << t.status();
  if (!t.ok()) return {};
  Recorder rec(t->get());
  auto send_and_wait = [&](const pb::EngineMessage& m) {
    EXPECT_TRUE((*t)->Send(m));
    EXPECT_TRUE(rec.WaitUntil([&](const auto& ms) { return Answered(ms, m.seq()); }))
        << "no answer to seq " << m.seq() << " over " << endpoint;
  };
  send_and_wait(Hello(0));

  pb::EngineMessage batch;
  batch.set_seq(1);
  for (int i = 0; i < 6; ++i) AddRecord(&batch, "a" + std::to_string(i), Features(i));
  AddRecord(&batch, "short", std::string(12, '\0'));          // wrong size
  AddRecord(&batch, "nan", Features(9, std::nanf("")));      // NaN
  AddRecord(&batch, "inf", Features(9, INFINITY));            // Inf
  AddRecord(&batch, "a0", Features(11));                      // duplicate live id
  AddRecord(&batch, "", Features(12));                        // empty id
  AddRecord(&batch, std::string(300, 'x'), Features(13));     // id too long
  AddRecord(&batch, std::string(20000, 'y'), Features(14));   // more than 16 KiB
  send_and_wait(batch);
  // The wrong-size record's error may come as its own message on shm.
  EXPECT_TRUE(rec.WaitUntil([](const auto& ms) {
    int errors = 0;
    for (const auto& m : ms) {
      if (m.seq() == 1 && m.has_predictions()) errors += m.predictions().errors_size();
    }
    return errors == 7;
  }));

  pb::EngineMessage done;
  done.set_seq(2);
  AddCompletion(&done, "a0", 400, pb::FINISH_REASON_STOP);
  AddCompletion(&done, "a1", 30, pb::FINISH_REASON_STOP);
  AddCompletion(&done, "ghost", 5, pb::FINISH_REASON_STOP);          // unknown
  AddCompletion(&done, "a2", -5, pb::FINISH_REASON_STOP);            // bad count
  AddCompletion(&done, "a3", 7, pb::FINISH_REASON_UNSPECIFIED);      // bad reason
  AddCompletion(&done, std::string(20000, 'z'), 5, pb::FINISH_REASON_STOP);  // id too long
  send_and_wait(done);
  // Two completions learned (batch 1): versions 2 and 3 publish; the live
  // requests a2..a5 are rescored at version 3.
  EXPECT_TRUE(rec.WaitUntil([](const auto& ms) {
    std::set<std::string> v3;
    for (const auto& m : ms) {
      if (m.has_rescore() && m.rescore().version() == 3) {
        for (const auto& p : m.rescore().predictions()) v3.insert(p.request_id());
      }
    }
    return v3.size() == 4;
  })) << "no rescore of the live requests at version 3 over " << endpoint;

  pb::EngineMessage more;
  more.set_seq(3);
  for (int i = 0; i < 3; ++i) AddRecord(&more, "b" + std::to_string(i), Features(20 + i));
  send_and_wait(more);

  pb::EngineMessage cancels;
  cancels.set_seq(4);
  cancels.mutable_cancels()->add_request_ids("a5");
  cancels.mutable_cancels()->add_request_ids("ghost2");
  cancels.mutable_cancels()->add_request_ids(std::string(300, 'c'));  // id too long
  send_and_wait(cancels);
  send_and_wait(Hello(5));  // a second hello is a message-level error
  pb::EngineMessage empty;
  empty.set_seq(6);
  send_and_wait(empty);
  pb::EngineMessage cancelled;
  cancelled.set_seq(7);
  AddCompletion(&cancelled, "a4", 12, pb::FINISH_REASON_CANCELLED);
  send_and_wait(cancelled);
  // NUL bytes in request ids (docs/WIRE.md: ids hold no NUL; engine keys are
  // instance NUL id). A completion or cancel naming one gets INVALID_ARGUMENT
  // for itself alone: the live request whose id is its prefix is untouched,
  // the rest of the batch is served, and the stream keeps answering. Over
  // shm the cancels travel in a kCancels frame, not protobuf.
  pb::EngineMessage nul_done;
  nul_done.set_seq(8);
  AddCompletion(&nul_done, std::string("b1\0x", 4), 10, pb::FINISH_REASON_STOP);
  AddCompletion(&nul_done, std::string("b1\0", 3), 10, pb::FINISH_REASON_STOP);
  AddCompletion(&nul_done, "b0", 9, pb::FINISH_REASON_CANCELLED);  // skipped
  send_and_wait(nul_done);
  pb::EngineMessage nul_cancels;
  nul_cancels.set_seq(9);
  nul_cancels.mutable_cancels()->add_request_ids(std::string("b2\0", 3));
  nul_cancels.mutable_cancels()->add_request_ids("b1");  // still live
  nul_cancels.mutable_cancels()->add_request_ids(std::string(1, '\0'));
  send_and_wait(nul_cancels);
  pb::EngineMessage after;
  after.set_seq(10);
  after.mutable_cancels()->add_request_ids("b2");  // still live
  send_and_wait(after);
  return Normalize(rec.messages());
}

TEST(ShmTransport, ConformsToGrpcConnect) {
  Outcome grpc_outcome, shm_outcome;
  {
    Leapd l = StartLeapd("grpc");
    ASSERT_NE(l.proc, nullptr);
    grpc_outcome = RunScenario(l.sock);
  }
  {
    Leapd l = StartLeapd("shm");
    ASSERT_NE(l.proc, nullptr);
    shm_outcome = RunScenario("shm://" + l.shm);
    EXPECT_NE(shm_outcome.sidecar_id.find("/shm-"), std::string::npos)
        << "the shm scenario did not run over shm: " << shm_outcome.sidecar_id;
  }
  ASSERT_EQ(grpc_outcome.answers.size(), 11u);
  ASSERT_EQ(shm_outcome.answers.size(), 11u);
  for (const auto& [seq, text] : grpc_outcome.answers) {
    EXPECT_EQ(text, shm_outcome.answers[seq]) << "answer to seq " << seq;
  }
  EXPECT_EQ(grpc_outcome.rescore_v3, shm_outcome.rescore_v3);
  EXPECT_EQ(grpc_outcome.rescore_v3.size(), 4u);
  EXPECT_EQ(grpc_outcome.published, shm_outcome.published);
  EXPECT_TRUE(grpc_outcome.published.count(3));
  // The scenario is not vacuous: the later predictions use the learned
  // version and differ between requests.
  const std::string& b = grpc_outcome.answers[3];
  EXPECT_NE(b.find("version: 3"), std::string::npos) << b;
  EXPECT_NE(grpc_outcome.answers[1].find("code: 6"), std::string::npos);
  // NUL ids: refused one by one with the precise error, nothing else lost.
  auto count = [](const std::string& text, const std::string& what) {
    int n = 0;
    for (size_t at = text.find(what); at != std::string::npos;
         at = text.find(what, at + 1)) {
      ++n;
    }
    return n;
  };
  const std::string nul = "request_id must not contain NUL characters";
  const std::string& done = grpc_outcome.answers[8];
  EXPECT_EQ(count(done, nul), 2) << done;
  EXPECT_EQ(count(done, "code: 3"), 2) << done;
  EXPECT_NE(done.find("skipped: 1"), std::string::npos) << done;
  const std::string& cancels = grpc_outcome.answers[9];
  EXPECT_EQ(count(cancels, nul), 2) << cancels;
  EXPECT_NE(cancels.find("accepted: 1"), std::string::npos) << cancels;  // b1
  const std::string& after = grpc_outcome.answers[10];
  EXPECT_NE(after.find("accepted: 1"), std::string::npos) << after;  // b2
  EXPECT_EQ(after.find("errors"), std::string::npos) << after;
  // Ids over the limit (kMaxIdBytes, 256), a feature record's, a
  // completion's and a cancel's, 300 or 20,000 bytes: INVALID_ARGUMENT
  // naming the size and the limit (a completion or cancel too: no live id
  // is that long), for that record alone; the id echoed at most 4 KiB.
  const std::string over = " bytes is over the limit of 256 bytes (it starts ";
  EXPECT_EQ(count(grpc_outcome.answers[1], "request_id of 300" + over), 1);
  EXPECT_EQ(count(grpc_outcome.answers[1], "request_id of 20000" + over), 1);
  EXPECT_EQ(count(grpc_outcome.answers[1], std::string(4097, 'y')), 0);
  EXPECT_EQ(count(grpc_outcome.answers[2], "request_id of 20000" + over), 1);
  EXPECT_NE(grpc_outcome.answers[2].find("accepted: 2"), std::string::npos)
      << grpc_outcome.answers[2];
  EXPECT_EQ(count(grpc_outcome.answers[4], "request_id of 300" + over), 1);
  EXPECT_EQ(count(grpc_outcome.answers[4], "code: 5"), 1);  // ghost2
}

// ------------------------------------------------------- hostile engines

shim::ShmChannelOptions ChannelOptions(const std::string& path,
                                       uint32_t slots = 16) {
  shim::ShmChannelOptions o;
  o.path = path;
  o.hello.set_engine_id("probe");
  o.hello.set_dim(kDim);
  o.hello.set_dtype(pb::FEATURE_DTYPE_FLOAT32);
  o.slots = slots;
  o.ring_bytes = 1 << 16;
  o.timeout = absl::Seconds(10);
  return o;
}

// Receives until a predictions frame (or a proto) answering `seq`.
shim::ShmIncoming AwaitAnswer(shim::ShmChannel& ch, uint64_t seq) {
  shim::ShmIncoming in;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    absl::Status s = ch.Receive(&in, absl::Seconds(1));
    if (absl::IsDeadlineExceeded(s)) continue;
    EXPECT_TRUE(s.ok()) << s;
    if (!s.ok()) break;
    if (in.kind != shim::ShmIncoming::Kind::kReleased && in.seq == seq) return in;
  }
  ADD_FAILURE() << "no answer to seq " << seq;
  return in;
}

// One good prediction through `ch` (the engine is still served).
void ExpectServed(shim::ShmChannel& ch, const std::string& id, uint64_t seq) {
  const int64_t slot = ch.AcquireSlot();
  ASSERT_GE(slot, 0);
  const std::string x = Features(seq);
  std::memcpy(ch.slot(static_cast<uint32_t>(slot)), x.data(), x.size());
  shim::ShmChannel::Record r{static_cast<uint32_t>(slot), id, "", 0};
  ASSERT_TRUE(ch.SendFeatures(seq, {&r, 1}).ok());
  ch.Flush();
  shim::ShmIncoming in = AwaitAnswer(ch, seq);
  ASSERT_EQ(in.kind, shim::ShmIncoming::Kind::kPredictions);
  ASSERT_EQ(in.predictions.size(), 1u);
  EXPECT_EQ(in.predictions[0].request_id, id);
  EXPECT_EQ(in.predictions[0].slot, static_cast<uint32_t>(slot));
}

TEST(ShmTransport, RefusesBadRecordsAndCorruptRingsAndKeepsServing) {
  Leapd l = StartLeapd("hostile");
  ASSERT_NE(l.proc, nullptr);
  pb::SidecarMessage ack;
  auto good = shim::ShmChannel::Attach(ChannelOptions(l.shm), &ack);
  ASSERT_TRUE(good.ok()) << good.status();
  auto bad = shim::ShmChannel::Attach(ChannelOptions(l.shm), &ack);
  ASSERT_TRUE(bad.ok()) << bad.status();
  ExpectServed(**good, "g1", 1);

  // A slot index out of range and a slot still held by a live request.
  {
    std::string payload(sizeof(shm::FeaturesHead), '\0');
    shm::FeaturesHead head{7, 2, 0};
    std::memcpy(payload.data(), &head, sizeof(head));
    std::string rec(shm::FeatureRecordBytes(2, 0), '\0');
    shm::WriteFeatureRecord(rec.data(), 1u << 30, 0, "o1", "");
    payload += rec;
    const int64_t slot = (*bad)->AcquireSlot();
    const std::string x = Features(3);
    std::memcpy((*bad)->slot(static_cast<uint32_t>(slot)), x.data(), x.size());
    shm::WriteFeatureRecord(rec.data(), static_cast<uint32_t>(slot), 0, "o2", "");
    payload += rec;
    ASSERT_TRUE((*bad)->SendRawForTesting(shm::FrameKind::kFeatures, payload).ok());
    (*bad)->Flush();
    shim::ShmIncoming in = AwaitAnswer(**bad, 7);
    ASSERT_EQ(in.kind, shim::ShmIncoming::Kind::kPredictions);
    ASSERT_EQ(in.errors.size(), 1u);
    EXPECT_EQ(in.errors[0].code, 3);
    EXPECT_NE(in.errors[0].message.find("out of range"), absl::string_view::npos)
        << in.errors[0].message;
    ASSERT_EQ(in.predictions.size(), 1u);  // o2 is live and holds its slot
    // Reusing o2's slot while it is live is refused.
    std::string again(sizeof(shm::FeaturesHead), '\0');
    shm::FeaturesHead h2{8, 1, 0};
    std::memcpy(again.data(), &h2, sizeof(h2));
    shm::WriteFeatureRecord(rec.data(), static_cast<uint32_t>(slot), 0, "o3", "");
    again += rec;
    ASSERT_TRUE((*bad)->SendRawForTesting(shm::FrameKind::kFeatures, again).ok());
    (*bad)->Flush();
    in = AwaitAnswer(**bad, 8);
    ASSERT_EQ(in.errors.size(), 1u);
    EXPECT_NE(in.errors[0].message.find("still held"), absl::string_view::npos);
  }
  // A record count that overruns its frame, and an unknown frame kind.
  {
    std::string payload(sizeof(shm::FeaturesHead), '\0');
    shm::FeaturesHead head{9, 1000, 0};
    std::memcpy(payload.data(), &head, sizeof(head));
    ASSERT_TRUE((*bad)->SendRawForTesting(shm::FrameKind::kFeatures, payload).ok());
    ASSERT_TRUE((*bad)->SendRawForTesting(static_cast<shm::FrameKind>(77), "zz").ok());
    (*bad)->Flush();
    shim::ShmIncoming in = AwaitAnswer(**bad, 9);
    ASSERT_EQ(in.kind, shim::ShmIncoming::Kind::kProto);
    EXPECT_EQ(in.proto.error().code(), 3);
    EXPECT_NE(in.proto.error().message().find("claims 1000 records"), std::string::npos)
        << in.proto.error().message();
  }
  ExpectServed(**bad, "b-still", 10);

  // A corrupt ring: the tail jumps far past the head. leapd never follows
  // it; it detaches that engine with the reason and serves the other.
  (*bad)->CorruptRingForTesting();
  {
    shim::ShmIncoming in;
    absl::Status s;
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    do {
      s = (*bad)->Receive(&in, absl::Milliseconds(200));
    } while ((s.ok() || absl::IsDeadlineExceeded(s)) && absl::Now() < deadline);
    EXPECT_TRUE(absl::IsUnavailable(s)) << s;
    EXPECT_NE((*bad)->close_reason().find("corrupt"), std::string::npos)
        << (*bad)->close_reason();
  }
  ExpectServed(**good, "g2", 11);
}

TEST(ShmTransport, RefusedAttachSaysWhy) {
  Leapd l = StartLeapd("refuse");
  ASSERT_NE(l.proc, nullptr);
  pb::SidecarMessage ack;
  auto o = ChannelOptions(l.shm);
  o.hello.set_dim(48);  // no readout takes 48 values
  auto ch = shim::ShmChannel::Attach(o, &ack);
  ASSERT_FALSE(ch.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(ch.status())) << ch.status();
  EXPECT_NE(ch.status().message().find("no readout takes dim 48"), absl::string_view::npos)
      << ch.status();
  o = ChannelOptions(l.shm, /*slots=*/1u << 20);
  ch = shim::ShmChannel::Attach(o, &ack);
  ASSERT_FALSE(ch.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(ch.status())) << ch.status();
  ch = shim::ShmChannel::Attach(ChannelOptions("/nonexistent/leap.shm"), &ack);
  EXPECT_TRUE(absl::IsUnavailable(ch.status())) << ch.status();
  // The Client surfaces a refusal as an error event instead of hanging.
  auto t = shim::Dial("shm://" + l.shm, absl::Seconds(10));
  ASSERT_TRUE(t.ok());
  Recorder rec(t->get());
  pb::EngineMessage hello = Hello(0);
  hello.mutable_hello()->set_dim(48);
  ASSERT_TRUE((*t)->Send(hello));
  ASSERT_TRUE(rec.WaitUntil([](const auto& ms) { return !ms.empty(); }));
  const auto ms = rec.messages();
  ASSERT_TRUE(ms[0].has_error());
  EXPECT_NE(ms[0].error().message().find("no readout takes dim 48"), std::string::npos);
}

int CountSegments(const std::string& dir) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.size() > 4 && name.compare(name.size() - 4, 4, ".seg") == 0) ++n;
  }
  return n;
}

std::string MetricsAddress(const testing::Process& p) {
  for (const std::string& line : p.lines()) {
    if (line.rfind("metrics on http://", 0) == 0) {
      return line.substr(18, line.find("/metrics") - 18);
    }
  }
  return "";
}

// The value of one series in a /metrics body (-1 when absent).
double Metric(const std::string& body, const std::string& series) {
  const size_t at = body.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(body.substr(at + series.size() + 2));
}

// The engine stops reading until leapd's answers fill its ring and leapd
// sleeps waiting for room (it announces that in the segment); when the
// engine reads again, freeing room wakes leapd and every answer arrives.
TEST(ShmTransport, FullAnswerRingResumesWhenTheEngineReads) {
  Leapd l = StartLeapd("full-ring");
  ASSERT_NE(l.proc, nullptr);
  pb::SidecarMessage ack;
  auto o = ChannelOptions(l.shm, 2048);
  o.ring_bytes = 1 << 16;
  auto ch = shim::ShmChannel::Attach(o, &ack);
  ASSERT_TRUE(ch.ok()) << ch.status();
  const int kRecords = 2000;
  std::vector<std::string> ids;
  for (int i = 0; i < kRecords; ++i) ids.push_back("full-" + std::to_string(i));
  for (int i = 0; i < kRecords; i += 16) {
    std::vector<shim::ShmChannel::Record> recs;
    for (int k = i; k < std::min(kRecords, i + 16); ++k) {
      const int64_t slot = (*ch)->AcquireSlot();
      ASSERT_GE(slot, 0);
      const std::string x = Features(k);
      std::memcpy((*ch)->slot(static_cast<uint32_t>(slot)), x.data(), x.size());
      recs.push_back({static_cast<uint32_t>(slot), ids[k], "", 0});
    }
    ASSERT_TRUE((*ch)->SendFeatures(1 + i / 16, recs).ok());
    (*ch)->Flush();
  }
  // leapd's answers (~50 bytes each) overflow the 64 KiB ring: it waits.
  shm::SegmentHeader* h = (*ch)->header_for_testing();
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (h->to_engine.space_wanted.load() == 0 && absl::Now() < deadline) {
    std::this_thread::yield();
  }
  ASSERT_EQ(h->to_engine.space_wanted.load(), 1u) << "leapd never waited for room";
  std::set<std::string> predicted;
  shim::ShmIncoming in;
  while (predicted.size() < static_cast<size_t>(kRecords) && absl::Now() < deadline) {
    absl::Status s = (*ch)->Receive(&in, absl::Seconds(1));
    if (absl::IsDeadlineExceeded(s)) continue;
    ASSERT_TRUE(s.ok()) << s;
    if (in.kind != shim::ShmIncoming::Kind::kPredictions) continue;
    EXPECT_TRUE(in.errors.empty());
    for (const auto& p : in.predictions) predicted.insert(std::string(p.request_id));
  }
  EXPECT_EQ(predicted.size(), static_cast<size_t>(kRecords));
}

// The parts of the Ack to `seq`: frames with that seq until accepted +
// skipped + errors reach `records` (docs/WIRE.md, "Answers larger than a
// frame").
std::vector<pb::SidecarMessage> AwaitAckParts(shim::ShmChannel& ch, uint64_t seq,
                                             int64_t records) {
  std::vector<pb::SidecarMessage> parts;
  int64_t answered = 0;
  while (answered < records) {
    shim::ShmIncoming in = AwaitAnswer(ch, seq);
    if (in.kind != shim::ShmIncoming::Kind::kProto || !in.proto.has_ack()) {
      ADD_FAILURE() << "not an Ack part: " << in.proto.DebugString();
      break;
    }
    answered += in.proto.ack().accepted() + in.proto.ack().skipped() +
                in.proto.ack().errors_size();
    parts.push_back(in.proto);
  }
  EXPECT_EQ(answered, records);
  return parts;
}

// An answer with more per-request errors than one frame of the engine's
// ring holds comes in several frames with its seq, each within a frame,
// the errors in record order, the counts in the last part: every record's
// outcome arrives (a cancel batch and a completion batch, whose UNAVAILABLE
// refusals the shim must see to resend them).
TEST(ShmTransport, OversizedAnswersComeInParts) {
  Leapd l = StartLeapd("oversized");
  ASSERT_NE(l.proc, nullptr);
  pb::SidecarMessage ack;
  auto o = ChannelOptions(l.shm);
  o.ring_bytes = 1 << 16;  // frames of at most 16 KiB
  auto ch = shim::ShmChannel::Attach(o, &ack);
  ASSERT_TRUE(ch.ok()) << ch.status();
  const size_t frame = (*ch)->max_frame_payload();
  ASSERT_LE(frame, 16u << 10);
  ExpectServed(**ch, "known", 1);
  ExpectServed(**ch, "done", 2);

  // Cancels: one known id, then 60 unknown ones of 200+ bytes (> 16 KiB of
  // errors).
  std::vector<std::string> ids = {"known"};
  for (int i = 0; i < 60; ++i) ids.push_back(std::string(200, 'a' + i % 26) + std::to_string(i));
  std::vector<absl::string_view> views(ids.begin(), ids.end());
  ASSERT_TRUE((*ch)->SendCancels(3, views).ok());
  (*ch)->Flush();
  std::vector<pb::SidecarMessage> parts = AwaitAckParts(**ch, 3, 61);
  ASSERT_GE(parts.size(), 2u);
  std::vector<std::string> named;
  for (size_t p = 0; p < parts.size(); ++p) {
    EXPECT_LE(parts[p].ByteSizeLong(), frame);
    EXPECT_GT(parts[p].ack().errors_size(), 0);
    // The counts travel in the last part.
    EXPECT_EQ(parts[p].ack().accepted(), p + 1 == parts.size() ? 1 : 0);
    for (const pb::RequestError& e : parts[p].ack().errors()) {
      EXPECT_EQ(e.code(), 5) << e.message();  // NOT_FOUND, with its id
      named.push_back(e.request_id());
    }
  }
  EXPECT_EQ(named, std::vector<std::string>(ids.begin() + 1, ids.end()));

  // Completions (one frame): 40 with a negative token count
  // (INVALID_ARGUMENT, the request stays live), 14 unknown (NOT_FOUND, the
  // id twice in the message), one learned: the errors do not fit a frame.
  pb::EngineMessage m;
  m.set_seq(4);
  std::vector<std::string> want;
  for (int i = 0; i < 55; ++i) {
    pb::Completion* c = m.mutable_completions()->add_completions();
    const bool last = i == 54;
    c->set_request_id(last ? "done" : i < 40 ? std::string(250, 'k') + std::to_string(i)
                                             : std::string(220, 'u') + std::to_string(i));
    c->set_output_tokens(last || i >= 40 ? 30 : -1);
    c->set_reason(pb::FINISH_REASON_STOP);
    if (!last) want.push_back(c->request_id());
  }
  ASSERT_LE(m.ByteSizeLong(), frame);
  ASSERT_TRUE((*ch)->SendProto(m).ok());
  (*ch)->Flush();
  parts = AwaitAckParts(**ch, 4, 55);
  ASSERT_GE(parts.size(), 2u);
  named.clear();
  int64_t accepted = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    EXPECT_LE(parts[p].ByteSizeLong(), frame);
    accepted += parts[p].ack().accepted() + parts[p].ack().skipped();
    if (p + 1 < parts.size()) {
      EXPECT_EQ(parts[p].ack().accepted(), 0);
    }
    for (const pb::RequestError& e : parts[p].ack().errors()) {
      EXPECT_EQ(e.code(), named.size() < 40 ? 3 : 5) << e.message();
      named.push_back(e.request_id());
    }
  }
  EXPECT_EQ(accepted, 1);
  EXPECT_EQ(named, want);
  ExpectServed(**ch, "after", 5);  // the stream goes on
}

// leapd keeps answering attach requests and hang-ups while another engine
// keeps it busy without a pause.
TEST(ShmTransport, AttachesWhileAnotherEngineStreams) {
  Leapd l = StartLeapd("busy");
  ASSERT_NE(l.proc, nullptr);
  pb::SidecarMessage ack;
  auto busy = shim::ShmChannel::Attach(ChannelOptions(l.shm, 64), &ack);
  ASSERT_TRUE(busy.ok()) << busy.status();
  for (uint32_t s = 0; s < 64; ++s) {
    const std::string x = Features(static_cast<int>(s));
    std::memcpy((*busy)->slot(s), x.data(), x.size());
  }
  std::atomic<bool> stop{false};
  std::atomic<int64_t> predicted{0};
  std::thread streamer([&] {
    std::vector<uint32_t> free;
    std::vector<std::string> ids(64);
    for (int s = 0; s < 64; ++s) ids[s] = "busy-" + std::to_string(s);
    std::vector<shim::ShmChannel::Record> recs;
    std::vector<absl::string_view> done;
    shim::ShmIncoming in;
    uint64_t seq = 1;
    while (!stop.load()) {
      free.clear();
      recs.clear();
      (*busy)->AcquireSlots(16, &free);
      for (uint32_t s : free) recs.push_back({s, ids[s], "", 0});
      if (!recs.empty() && !(*busy)->SendFeatures(seq++, recs).ok()) return;
      (*busy)->Flush();
      if (!(*busy)->Receive(&in, absl::Milliseconds(100)).ok()) continue;
      if (in.kind != shim::ShmIncoming::Kind::kPredictions) continue;
      done.clear();
      for (const auto& p : in.predictions) done.push_back(p.request_id);
      predicted += static_cast<int64_t>(done.size());
      if (!done.empty()) (*busy)->SendCancels(seq++, done).IgnoreError();
      (*busy)->Flush();
    }
  });
  // Wait until the stream is flowing, then attach a second engine.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (predicted.load() < 1000 && absl::Now() < deadline) std::this_thread::yield();
  ASSERT_GE(predicted.load(), 1000);
  auto second = shim::ShmChannel::Attach(ChannelOptions(l.shm), &ack);
  EXPECT_TRUE(second.ok()) << second.status();
  if (second.ok()) ExpectServed(**second, "second", 99);
  const int64_t before = predicted.load();
  second->reset();  // hangs up: leapd reclaims it while still streaming
  auto gone = l.proc->WaitForLine("shm: engine 'probe' detached", absl::Seconds(30));
  EXPECT_TRUE(gone.ok()) << gone.status();
  // The first engine is still served after the other one left.
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (predicted.load() < before + 1000 && absl::Now() < until) {
    std::this_thread::yield();
  }
  stop.store(true);
  streamer.join();
  EXPECT_GE(predicted.load(), before + 1000);
}

// An engine process dies by kill -9 with live requests holding slots: leapd
// notices at once (its attach socket hangs up), cancels them, releases the
// segment and keeps serving another engine.
TEST(ShmTransport, EngineKilledIsReclaimedAndOthersKeepServing) {
  Leapd l = StartLeapd("kill-engine");
  ASSERT_NE(l.proc, nullptr);
  const std::string metrics = MetricsAddress(*l.proc);
  ASSERT_FALSE(metrics.empty());
  pb::SidecarMessage ack;
  auto witness = shim::ShmChannel::Attach(ChannelOptions(l.shm), &ack);
  ASSERT_TRUE(witness.ok()) << witness.status();
  ExpectServed(**witness, "w1", 1);

  auto engine = testing::Process::Start({SHM_TEST_ENGINE_PATH, l.shm,
                                         std::to_string(kDim), "50"});
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto live = (*engine)->WaitForLine("live ", absl::Seconds(30));
  ASSERT_TRUE(live.ok()) << live.status();
  EXPECT_EQ(live->substr(0, 3), "50 ");
  EXPECT_EQ(CountSegments(l.dir), 2);
  auto body = testing::HttpGet(metrics, "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_EQ(Metric(*body, "leap_feature_cache_entries"), 51);
  EXPECT_EQ(Metric(*body, "leap_connected_engines"), 2);

  (*engine)->Signal(SIGKILL);
  (*engine)->Wait();
  auto gone = l.proc->WaitForLine("shm: engine 'shm-test-engine' detached",
                                  absl::Seconds(30));
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_NE(gone->find("50 live requests reclaimed"), std::string::npos) << *gone;
  EXPECT_EQ(CountSegments(l.dir), 1);
  body = testing::HttpGet(metrics, "/metrics");
  ASSERT_TRUE(body.ok());
  EXPECT_EQ(Metric(*body, "leap_feature_cache_entries"), 1);
  EXPECT_EQ(Metric(*body, "leap_connected_engines"), 1);
  EXPECT_EQ(Metric(*body, "leap_shm_reclaimed_requests_total"), 50);
  EXPECT_EQ(Metric(*body, "leap_shm_detached_total{reason=\"hangup\"}"), 1);
  ExpectServed(**witness, "w2", 2);
}

}  // namespace
}  // namespace leap

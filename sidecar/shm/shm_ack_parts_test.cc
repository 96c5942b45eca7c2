// The engine shim's Client over shared memory against the shm server of a
// fleet member (a Core over a real RocksDB store, a real FleetMember on a
// real nats-server started by the test), where a completion can be refused
// UNAVAILABLE (NATS gone). docs/WIRE.md, "Messages and answers larger than
// a frame":
//  - an Ack whose per-request errors do not fit one frame of the engine's
//    ring comes in parts; the Client adds them up, so a completion refused
//    UNAVAILABLE after more errors than a frame holds is kept, resent by the
//    Client once NATS is back, and in the FEEDBACK stream once;
//  - the completions the Client sends when it (re)connects go in the order
//    the engine completed them, with their own token counts.
// The Client connects only once everything is queued (its endpoint is a
// link to the server's socket made afterwards), so the queued completions
// travel in one message. Fails when /usr/sbin/nats-server is missing
// (scripts/install-deps).
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine_shim/client.h"
#include "gtest/gtest.h"
#include "leap/v1/fleet.pb.h"
#include "sidecar/fleet/member.h"
#include "sidecar/fleet/nats_client.h"
#include "sidecar/shm/shm_server.h"
#include "tests/support/fleet_member.h"
#include "tests/support/nats_cluster.h"
#include "tests/support/readout_fixtures.h"
#include "tests/support/scoped_temp_dir.h"
#include "tests/support/shim_events.h"

namespace leap::sidecar {
namespace {

using ::leap::testing::AwaitNoneLive;
using ::leap::testing::PollUntil;
using ::leap::testing::ShimEvents;

constexpr int64_t kDim = 16;
constexpr char kFleet[] = "parts";

// Error events that name a request (an attach tried before the link to the
// socket exists is an error event without one: "cannot reach leapd's shm
// socket").
int RequestErrors(const std::vector<shim::Event>& ev) {
  return static_cast<int>(std::count_if(ev.begin(), ev.end(), [](const shim::Event& e) {
    return e.kind == shim::Event::Kind::kError && !e.request_id.empty();
  }));
}

class ShmAckPartsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // A short name: the shm path must fit a unix socket path.
    tmp_ = std::make_unique<::leap::testing::ScopedTempDir>("shm_parts");
    dir_ = tmp_->path();
    ::leap::testing::FleetTestMemberOptions mo;
    mo.fleet = kFleet;
    mo.member = "m";
    state_ = ::leap::testing::RandomState(kDim, 43);
    ASSERT_NO_FATAL_FAILURE(fleet_.Start(dir_, mo, "chat", state_));

    ShmServerOptions so;
    so.path = (dir_ / "leap.shm").string();
    so.max_slots = 1024;
    auto server = ShmServer::Start(fleet_.member->core.get(), "parts-sidecar", so);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }
  void TearDown() override {
    server_.reset();
    fleet_.Stop();
    tmp_.reset();
  }

  bool AwaitDegraded(bool want) { return fleet_.degraded.Await(want); }
  fleet::FleetMember& member() { return *fleet_.member->fleet; }
  uint64_t StreamLast() {
    auto last = member().nats().LastSeq(fleet::FeedbackStream(kFleet));
    EXPECT_TRUE(last.ok()) << last.status();
    return last.value_or(0);
  }
  // The completions stored in the FEEDBACK stream after stream seq `after`.
  std::vector<v1::fleet::FleetCompletion> StoredAfter(uint64_t after) {
    std::vector<v1::fleet::FleetCompletion> out;
    const uint64_t last = StreamLast();
    for (uint64_t s = after + 1; s <= last; ++s) {
      auto m = member().nats().GetMsg(fleet::FeedbackStream(kFleet), s);
      EXPECT_TRUE(m.ok()) << m.status();
      if (!m.ok() || m->subject != fleet::FeedbackSubject(kFleet, "chat")) continue;
      v1::fleet::FleetCompletion c;
      EXPECT_TRUE(c.ParseFromString(m->data));
      out.push_back(std::move(c));
    }
    return out;
  }
  // A Client whose endpoint is `link`, which does not lead to the server
  // yet: it stays unattached (degraded) until Link().
  std::unique_ptr<shim::Client> StartUnattached(ShimEvents* events) {
    link_ = (dir_ / "l").string();
    shim::ClientOptions o =
        ::leap::testing::TestClientOptions("shm://" + link_, kDim, "parts");
    o.shm_slots = 256;
    o.shm_ring_bytes = 1 << 16;  // answer frames of at most 16 KiB
    auto c = ::leap::testing::StartRecordedClient(o, events);
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) return nullptr;
    // It tried and could not attach (an error event without a request id).
    EXPECT_TRUE(events->Await([](const shim::Event& e) {
      return e.kind == shim::Event::Kind::kError && e.request_id.empty() &&
             e.message.find("cannot reach leapd's shm socket") != std::string::npos;
    }));
    return std::move(*c);
  }
  void Link() { ASSERT_EQ(symlink(server_->path().c_str(), link_.c_str()), 0); }
  void Submit(shim::Client* c, const std::string& id) {
    const std::vector<float> x = ::leap::testing::RandomFeatures(state_, rng_);
    c->Submit({{id, "", std::string(reinterpret_cast<const char*>(x.data()),
                                     x.size() * sizeof(float)), 0}});
  }

  std::unique_ptr<::leap::testing::ScopedTempDir> tmp_;
  std::filesystem::path dir_;
  std::string link_;
  ::leap::testing::OneNodeFleet fleet_;
  readout::ReadoutState state_;
  std::unique_ptr<ShmServer> server_;
  std::mt19937_64 rng_{5};
};

// 69 completions with a bad token count (INVALID_ARGUMENT, ids of 200
// bytes: their errors alone exceed a 16 KiB frame), then one refused
// UNAVAILABLE (NATS gone), in one completions message: the refused one is
// not taken as acknowledged; it is resent until NATS is back and stored
// once, and each bad one is one error event.
TEST_F(ShmAckPartsTest, AnUnavailableRefusalPastAFrameOfErrorsIsResentAndStoredOnce) {
  ASSERT_TRUE(AwaitDegraded(false));
  const uint64_t stored = StreamLast();
  ASSERT_TRUE(fleet_.nats->Kill(0).ok());
  ASSERT_TRUE(AwaitDegraded(true));

  ShimEvents events;
  std::unique_ptr<shim::Client> c = StartUnattached(&events);
  ASSERT_NE(c, nullptr);
  constexpr int kBad = 69;
  std::vector<std::string> bad;
  size_t error_bytes = 0;
  for (int i = 0; i < kBad; ++i) {
    bad.push_back(std::string(200, static_cast<char>('a' + i % 26)) + std::to_string(i));
    error_bytes += bad.back().size();
    Submit(c.get(), bad.back());
  }
  // The completions fit one frame (one message, one answer)...
  ASSERT_LT(error_bytes + kBad * 20, size_t{16} << 10);
  Submit(c.get(), "good");
  for (const std::string& id : bad) c->Complete(id, -1, shim::FinishReason::kStop);
  c->Complete("good", 40, shim::FinishReason::kStop);
  EXPECT_EQ(c->stats().connects, 0);
  Link();

  // Every bad completion is one error event, the good one none.
  ASSERT_TRUE(events.Wait([&](const std::vector<shim::Event>& ev) {
    return RequestErrors(ev) >= kBad;
  })) << "error events: " << RequestErrors(events.events());
  // The refusal was seen: the completion is kept for a resend.
  ASSERT_TRUE(PollUntil([&] { return c->stats().completion_retries >= 1; }))
      << "the UNAVAILABLE refusal was not seen";
  const shim::ClientStats held = c->stats();
  const int attach_errors =
      events.Count(shim::Event::Kind::kError) - RequestErrors(events.events());
  EXPECT_EQ(held.live, 1);
  EXPECT_EQ(held.errors, kBad + attach_errors);
  EXPECT_EQ(held.connects, 1);
  std::set<std::string> named;
  size_t answer_bytes = 0;
  for (const shim::Event& e : events.events()) {
    if (e.kind != shim::Event::Kind::kError || e.request_id.empty()) continue;
    EXPECT_EQ(e.code, 3) << e.request_id << ": " << e.message;
    EXPECT_TRUE(named.insert(e.request_id).second) << "twice: " << e.request_id;
    answer_bytes += e.request_id.size() + e.message.size();
  }
  EXPECT_EQ(named, std::set<std::string>(bad.begin(), bad.end()));
  // ...their errors do not.
  EXPECT_GT(answer_bytes, size_t{16} << 10);

  // NATS back: a resend is acknowledged without the engine doing anything.
  ASSERT_TRUE(fleet_.nats->Restart(0).ok());
  ASSERT_TRUE(AwaitDegraded(false));
  ASSERT_TRUE(AwaitNoneLive(*c))
      << "the refused completion was not resent and acknowledged";
  EXPECT_EQ(RequestErrors(events.events()), kBad);
  EXPECT_EQ(c->stats().errors, held.errors);
  const std::vector<v1::fleet::FleetCompletion> got = StoredAfter(stored);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].request_id(), "good");
  EXPECT_EQ(got[0].instance_id(), c->instance_id());
  std::printf("70 completions in one message (%zu bytes of ids), %zu bytes of "
              "errors: %d error events, 1 refused UNAVAILABLE %lld times, stored once\n",
              error_bytes, answer_bytes, kBad,
              static_cast<long long>(c->stats().completion_retries));
}

// The completions queued while the Client is not attached go, once it is,
// in the order the engine completed them (not the order of its tables),
// each with its own token count. With ids of 230 bytes the completions
// message is larger than a frame: it goes as several frames with one seq,
// each acknowledged on its own, and the Client adds the Acks up (one
// connection, nothing refused).
TEST_F(ShmAckPartsTest, CompletionsSentAtConnectKeepTheEnginesOrder) {
  ASSERT_TRUE(AwaitDegraded(false));
  const uint64_t stored = StreamLast();
  ShimEvents events;
  std::unique_ptr<shim::Client> c = StartUnattached(&events);
  ASSERT_NE(c, nullptr);
  constexpr int kRequests = 100;
  std::vector<std::string> ids;
  size_t id_bytes = 0;
  for (int i = 0; i < kRequests; ++i) {
    ids.push_back(absl::StrCat(std::string(230, 'r'), i));
    id_bytes += ids.back().size();
    Submit(c.get(), ids.back());
  }
  ASSERT_GT(id_bytes, size_t{16} << 10);  // one message, more than a frame
  std::vector<std::string> order = ids;
  std::shuffle(order.begin(), order.end(), std::mt19937_64(17));
  std::vector<int64_t> tokens;
  for (size_t k = 0; k < order.size(); ++k) {
    tokens.push_back(10 + static_cast<int64_t>(k));
    c->Complete(order[k], tokens.back(), shim::FinishReason::kStop);
  }
  EXPECT_EQ(c->stats().connects, 0);
  Link();
  ASSERT_TRUE(AwaitNoneLive(*c))
      << "live: " << c->stats().live;
  EXPECT_EQ(RequestErrors(events.events()), 0);
  EXPECT_EQ(c->stats().connects, 1);
  EXPECT_EQ(c->stats().completion_retries, 0);
  const std::vector<v1::fleet::FleetCompletion> got = StoredAfter(stored);
  ASSERT_EQ(got.size(), order.size());
  for (size_t k = 0; k < got.size(); ++k) {
    EXPECT_EQ(got[k].request_id(), order[k]) << k;
    EXPECT_NEAR(got[k].true_tokens(), static_cast<double>(tokens[k]), 1e-9) << k;
  }
}

}  // namespace
}  // namespace leap::sidecar

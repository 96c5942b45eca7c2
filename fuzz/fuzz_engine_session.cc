// Fuzz target: what leapd does with the EngineMessages of a Connect stream
// (sidecar/core/engine_messages.h), on an in-process Core with two small
// readouts (d = 4, M = 1024) and routes with a shadow arm and a split.
//
// The input is a sequence of serialized leap.v1.EngineMessage, each
// preceded by its length as a varint (the wire form of a repeated message
// field 1, so a seed is what an engine would send). As in
// PredictorService::Connect, the first message must be a valid hello (else
// the stream ends); every later one goes to HandleEngineMessage. An
// unparseable message ends the stream (gRPC would fail it). At the end the
// requests the session still holds are cancelled and learning is waited
// for, so inputs do not pile state up.
// Checks: no crash or sanitizer report; the answer echoes seq; a feature
// batch gets one prediction or one error per record (or one error for an
// oversized batch); completions and cancels get one count or one error
// each; predictions are finite and within [1, M]; prior queries get one
// prior or one error per record, priors finite and within [0, M].
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "fuzz/fuzz_common.h"
#include "google/protobuf/io/coded_stream.h"
#include "leap/v1/predictor.pb.h"
#include "sidecar/core/core.h"
#include "sidecar/core/engine_messages.h"

namespace {

namespace pb = ::leap::v1;
using leap::sidecar::Core;

constexpr int64_t kDim = 4;
constexpr int64_t kMaxTokens = 1024;

leap::readout::ReadoutState SmallReadout(double sign) {
  leap::readout::ReadoutState s;
  s.spec.dim = kDim;
  s.spec.max_tokens = kMaxTokens;
  s.spec.lambda = 1.0;
  s.spec.model_id = "fuzz";
  s.standardizer.mean = Eigen::VectorXd::LinSpaced(kDim, -1.0, 1.0);
  s.standardizer.scale = Eigen::VectorXd::Constant(kDim, 2.0);
  s.theta = Eigen::VectorXd::Constant(kDim + 1, 0.5 * sign);
  s.theta[kDim] = 10.0;
  s.p = leap::readout::SymMatrix::ScaledIdentity(kDim + 1, 1.0f);
  return s;
}

Core* TheCore() {
  static Core* core = [] {
    leap::sidecar::CoreOptions options;
    options.readout.rls_batch = 2;
    options.readout.flush_after_ns = 1'000'000;
    options.readout.quality_window = 16;
    options.readout.versions_kept = 8;
    options.cache.max_bytes = 1 << 20;
    options.max_batch_bytes = 16 << 10;
    options.max_id_bytes = 64;
    static leap::sidecar::Metrics metrics;
    auto* c = new Core(options, &metrics, nullptr);
    FUZZ_CHECK(c->CreateReadout("a", SmallReadout(1.0)).ok());
    FUZZ_CHECK(c->CreateReadout("b", SmallReadout(-1.0)).ok());
    leap::sidecar::Route def;
    def.arms.push_back({"main", "a", 100.0, false});
    def.arms.push_back({"shadow", "b", 100.0, true});
    FUZZ_CHECK(c->SetRoute(def).ok());
    leap::sidecar::Route split;
    split.product_line = "pl";
    split.arms.push_back({"x", "a", 50.0, false});
    split.arms.push_back({"y", "b", 50.0, false});
    FUZZ_CHECK(c->SetRoute(split).ok());
    return c;
  }();
  return core;
}

// The session's live requests (what ConnectSession keeps for rescoring).
class Tracker : public leap::sidecar::LiveTracker {
 public:
  void Track(std::shared_ptr<leap::sidecar::LiveRequest> r) override {
    FUZZ_CHECK(r != nullptr);
    const std::string id = r->request_id;
    live_[id] = std::move(r);
  }
  void Untrack(absl::string_view id) override { live_.erase(std::string(id)); }
  void CancelAll(Core* core) {
    for (const auto& [id, r] : live_) core->CancelExact(*r);
    live_.clear();
  }

 private:
  std::map<std::string, std::shared_ptr<leap::sidecar::LiveRequest>> live_;
};

void CheckAnswer(const pb::EngineMessage& in_copy, const pb::SidecarMessage& out,
                 int64_t max_batch_bytes) {
  FUZZ_CHECK(out.seq() == in_copy.seq());
  switch (in_copy.body_case()) {
    case pb::EngineMessage::kFeatures: {
      FUZZ_CHECK(out.has_predictions());
      const auto& b = out.predictions();
      int64_t bytes = 0;
      for (const auto& r : in_copy.features().records()) {
        bytes += static_cast<int64_t>(r.features().size());
      }
      if (bytes > max_batch_bytes) {
        FUZZ_CHECK(b.predictions_size() == 0 && b.errors_size() == 1);
        break;
      }
      FUZZ_CHECK(b.predictions_size() + b.errors_size() ==
                 in_copy.features().records_size());
      for (const auto& p : b.predictions()) {
        FUZZ_CHECK(std::isfinite(p.score()));
        FUZZ_CHECK(p.predicted_tokens() >= 1.0 &&
                   p.predicted_tokens() <= kMaxTokens);
        FUZZ_CHECK(p.readout() == "a" || p.readout() == "b");
      }
      break;
    }
    case pb::EngineMessage::kCompletions: {
      FUZZ_CHECK(out.has_ack());
      const auto& a = out.ack();
      FUZZ_CHECK(a.accepted() + a.skipped() + a.errors_size() ==
                 in_copy.completions().completions_size());
      break;
    }
    case pb::EngineMessage::kCancels: {
      FUZZ_CHECK(out.has_ack());
      const auto& a = out.ack();
      FUZZ_CHECK(a.accepted() + a.errors_size() ==
                 in_copy.cancels().request_ids_size());
      break;
    }
    case pb::EngineMessage::kPriorQueries: {
      FUZZ_CHECK(out.has_priors());
      const auto& b = out.priors();
      FUZZ_CHECK(b.priors_size() + b.errors_size() ==
                 in_copy.prior_queries().records_size());
      for (const auto& p : b.priors()) {
        FUZZ_CHECK(std::isfinite(p.predicted_tokens()));
        FUZZ_CHECK(p.predicted_tokens() >= 0 &&
                   p.predicted_tokens() <= kMaxTokens);
        FUZZ_CHECK(p.available() || p.predicted_tokens() == 0);
      }
      break;
    }
    default:
      FUZZ_CHECK(out.has_error());
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static uint64_t next_session = 1;
  Core* core = TheCore();
  google::protobuf::io::CodedInputStream stream(data, static_cast<int>(size));
  pb::Hello hello;
  leap::readout::DType dtype = leap::readout::DType::kFloat32;
  bool have_hello = false;
  const uint64_t session = next_session++;
  Tracker tracker;
  for (int i = 0; i < 64; ++i) {
    uint32_t len = 0;
    std::string bytes;
    if (!stream.ReadVarint32(&len) || !stream.ReadString(&bytes, len)) break;
    pb::EngineMessage in;
    if (!in.ParseFromString(bytes)) break;
    if (!have_hello) {
      if (!in.has_hello()) break;
      absl::StatusOr<leap::readout::DType> d =
          leap::sidecar::CheckHello(in.hello());
      if (!d.ok()) break;
      hello = in.hello();
      dtype = *d;
      have_hello = true;
      continue;
    }
    const pb::EngineMessage in_copy = in;  // HandleEngineMessage may move from `in`
    pb::SidecarMessage out;
    leap::sidecar::HandleEngineMessage(core, session, hello, dtype, &in, &out,
                                       &tracker);
    CheckAnswer(in_copy, out, core->options().max_batch_bytes);
    std::string wire;
    FUZZ_CHECK(out.SerializeToString(&wire));
  }
  tracker.CancelAll(core);
  core->WaitIdle();
  return 0;
}

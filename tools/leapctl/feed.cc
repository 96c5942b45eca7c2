#include "tools/leapctl/feed.h"

#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <thread>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/npy.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "readout/stats.h"
#include "tools/leapctl/data.h"
#include "client/engine_connection.h"

namespace leap::leapctl {

using client::EngineConnection;
using client::FromRequestError;
using client::RandomRunId;

namespace {

namespace pb = ::leap::v1;
using Clock = std::chrono::steady_clock;

nlohmann::json JsonNumber(double v) {
  if (!std::isfinite(v)) return nullptr;
  return v;
}

std::string FormatSpearman(double v) {
  return std::isfinite(v) ? absl::StrFormat("%.4f", v) : "nan";
}

// The reader side of the feed's stream: answers by seq, counts of pushes.
class Inbox {
 public:
  explicit Inbox(EngineConnection* conn) : conn_(conn) {
    reader_ = std::thread([this] { ReadLoop(); });
  }
  ~Inbox() { Join(); }

  // Waits up to `timeout` for the answer to `seq`. DeadlineExceeded on
  // timeout; Unavailable-like (the stream's end) when the stream broke.
  absl::StatusOr<pb::SidecarMessage> Await(uint64_t seq,
                                           absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    const auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return ended_ || answers_.count(seq) != 0;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&ready), timeout)) {
      return absl::DeadlineExceededError(
          absl::StrCat("DEADLINE_EXCEEDED: no answer from leapd within ",
                       absl::FormatDuration(timeout)));
    }
    auto it = answers_.find(seq);
    if (it == answers_.end()) {
      return absl::UnavailableError(
          "UNAVAILABLE: the Connect stream ended before leapd answered");
    }
    pb::SidecarMessage m = std::move(it->second);
    answers_.erase(it);
    return m;
  }

  void Join() {
    if (reader_.joinable()) reader_.join();
  }

  int64_t rescore_messages() const {
    absl::MutexLock lock(&mu_);
    return rescore_messages_;
  }
  int64_t rescored_predictions() const {
    absl::MutexLock lock(&mu_);
    return rescored_predictions_;
  }
  int64_t published() const {
    absl::MutexLock lock(&mu_);
    return published_;
  }

 private:
  void ReadLoop() {
    pb::SidecarMessage m;
    while (conn_->Read(&m)) {
      absl::MutexLock lock(&mu_);
      if (m.seq() != 0) {
        answers_[m.seq()] = std::move(m);
        m = pb::SidecarMessage();
      } else if (m.has_rescore()) {
        ++rescore_messages_;
        rescored_predictions_ += m.rescore().predictions_size();
      } else if (m.has_published()) {
        ++published_;
      }
    }
    absl::MutexLock lock(&mu_);
    ended_ = true;
  }

  EngineConnection* const conn_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, pb::SidecarMessage> answers_ ABSL_GUARDED_BY(mu_);
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  int64_t rescore_messages_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t rescored_predictions_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t published_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread reader_;
};

// Pairs of the window being filled.
struct WindowAccumulator {
  int64_t first_row = 0;
  std::vector<double> predicted;
  std::vector<double> truth;
  std::map<std::string, VersionRange> versions;

  void Add(double p, double t, const std::string& readout, int64_t version) {
    predicted.push_back(p);
    truth.push_back(t);
    auto [it, inserted] =
        versions.try_emplace(readout, VersionRange{version, version});
    if (!inserted) {
      it->second.first = std::min(it->second.first, version);
      it->second.last = std::max(it->second.last, version);
    }
  }
};

}  // namespace

absl::Status FeedOptions::Validate() const {
  RETURN_IF_ERROR(server.Validate());
  if (features_path.empty()) {
    return absl::InvalidArgumentError("missing required flag --features");
  }
  if (lengths_path.empty()) {
    return absl::InvalidArgumentError("missing required flag --lengths");
  }
  if (batch < 1 || batch > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("--batch must be in [1, 65536], got ", batch));
  }
  if (report_every < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("--report-every must be >= 2, got ", report_every));
  }
  return absl::OkStatus();
}

absl::StatusOr<FeedReport> RunFeed(const FeedOptions& o,
                                   const FeedWindowFn& on_window,
                                   const ProgressFn& progress) {
  RETURN_IF_ERROR(o.Validate());
  const auto t0 = Clock::now();
  if (progress) progress(absl::StrCat("reading ", o.features_path));
  ASSIGN_OR_RETURN(LabeledFeatures in,
                   LoadLabeledFeatures(o.features_path, o.lengths_path,
                                       o.finish_reasons_path));
  const LoadedFeatures& f = in.features;
  const std::vector<int64_t>& lengths = in.lengths;
  const std::vector<int32_t>& reasons = in.reasons;
  const bool fp16 = f.array.dtype == NpyDType::kFloat16;
  const int64_t n = f.rows();
  const int64_t d = f.cols();
  const size_t row_bytes = static_cast<size_t>(d) * (fp16 ? 2 : 4);
  const char* data = reinterpret_cast<const char*>(f.array.data.data());

  const std::shared_ptr<grpc::Channel> channel = MakeChannel(o.server);
  ASSIGN_OR_RETURN(std::unique_ptr<EngineConnection> conn,
                   EngineConnection::Open(channel, o.server.address, d,
                                          fp16 ? pb::FEATURE_DTYPE_FLOAT16
                                               : pb::FEATURE_DTYPE_FLOAT32,
                                          o.engine_id));
  if (progress) {
    progress(absl::StrFormat(
        "feeding %d rows of d=%d (%s) to %s in batches "
        "of %d",
        n, d, fp16 ? "float16" : "float32", o.server.address, o.batch));
  }
  Inbox inbox(conn.get());
  const absl::Duration timeout = absl::Seconds(o.server.timeout_s);
  const std::string prefix = RandomRunId("feed");

  FeedReport r;
  r.rows = n;
  r.dim = d;
  r.dtype = fp16 ? "float16" : "float32";
  std::vector<double> all_pred, all_truth;
  all_pred.reserve(static_cast<size_t>(n));
  all_truth.reserve(static_cast<size_t>(n));
  WindowAccumulator window;
  std::map<std::string, bool> readouts_seen;
  const auto note_error = [&](const pb::RequestError& e) {
    if (r.first_error.ok()) r.first_error = FromRequestError(e);
  };

  uint64_t seq = 0;
  pb::EngineMessage features, completions;
  absl::Status stream_error;
  // Per batch: the prediction of each row (index within the batch).
  std::vector<const pb::Prediction*> batch_pred;
  std::unordered_map<std::string, int64_t> index_of;
  for (int64_t begin = 0; begin < n && stream_error.ok(); begin += o.batch) {
    const int64_t end = std::min(n, begin + o.batch);
    features.Clear();
    features.set_seq(++seq);
    index_of.clear();
    for (int64_t i = begin; i < end; ++i) {
      pb::FeatureRecord* rec = features.mutable_features()->add_records();
      rec->set_request_id(absl::StrCat(prefix, i));
      rec->set_product_line(o.product_line);
      rec->set_features(data + static_cast<size_t>(i) * row_bytes, row_bytes);
      index_of[rec->request_id()] = i - begin;
    }
    if (!conn->Write(features)) {
      stream_error = absl::UnavailableError(
          "UNAVAILABLE: the Connect stream broke while sending features");
      break;
    }
    absl::StatusOr<pb::SidecarMessage> answer = inbox.Await(seq, timeout);
    if (!answer.ok()) {
      stream_error = answer.status();
      break;
    }
    if (answer->has_error()) {
      stream_error = FromRequestError(answer->error());
      break;
    }
    const pb::PredictionBatch& preds = answer->predictions();
    r.prediction_errors += preds.errors_size();
    for (const pb::RequestError& e : preds.errors()) note_error(e);
    batch_pred.assign(static_cast<size_t>(end - begin), nullptr);
    completions.Clear();
    for (const pb::Prediction& p : preds.predictions()) {
      auto it = index_of.find(p.request_id());
      if (it == index_of.end()) continue;
      batch_pred[static_cast<size_t>(it->second)] = &p;
      const int64_t row = begin + it->second;
      pb::Completion* c = completions.mutable_completions()->add_completions();
      c->set_request_id(p.request_id());
      c->set_output_tokens(lengths[static_cast<size_t>(row)]);
      c->set_reason(reasons.empty() ? pb::FINISH_REASON_STOP
                                    : static_cast<pb::FinishReason>(
                                          reasons[static_cast<size_t>(row)]));
    }
    r.predicted += preds.predictions_size();
    if (completions.completions().completions_size() > 0) {
      completions.set_seq(++seq);
      if (!conn->Write(completions)) {
        stream_error = absl::UnavailableError(
            "UNAVAILABLE: the Connect stream broke while sending completions");
        break;
      }
      absl::StatusOr<pb::SidecarMessage> ack = inbox.Await(seq, timeout);
      if (!ack.ok()) {
        stream_error = ack.status();
        break;
      }
      r.learned += ack->ack().accepted();
      r.skipped += ack->ack().skipped();
      r.completion_errors += ack->ack().errors_size();
      for (const pb::RequestError& e : ack->ack().errors()) note_error(e);
    }
    // Windows: rows in order; emitted once their batch is acknowledged.
    for (int64_t i = begin; i < end; ++i) {
      const pb::Prediction* p = batch_pred[static_cast<size_t>(i - begin)];
      if (p != nullptr) readouts_seen[p->readout()] = true;
      // Only a natural stop tells the true length.
      const bool stopped = reasons.empty() || reasons[static_cast<size_t>(i)] ==
                                                  pb::FINISH_REASON_STOP;
      if (p != nullptr && stopped) {
        const double truth =
            static_cast<double>(lengths[static_cast<size_t>(i)]);
        window.Add(p->predicted_tokens(), truth, p->readout(), p->version());
        all_pred.push_back(p->predicted_tokens());
        all_truth.push_back(truth);
      }
      if ((i + 1) % o.report_every == 0 || i + 1 == n) {
        FeedWindow w;
        w.first_row = window.first_row;
        w.last_row = i;
        w.n = static_cast<int64_t>(window.predicted.size());
        w.spearman = readout::Spearman(window.predicted, window.truth);
        w.versions = std::move(window.versions);
        w.learned = r.learned;
        w.skipped = r.skipped;
        w.rescore_messages = inbox.rescore_messages();
        w.rescored_predictions = inbox.rescored_predictions();
        if (on_window) on_window(w);
        r.windows.push_back(std::move(w));
        window = WindowAccumulator();
        window.first_row = i + 1;
      }
    }
  }
  if (stream_error.ok()) {
    conn->WritesDone();
  } else {
    conn->Cancel();
  }
  inbox.Join();
  absl::Status finish = conn->Finish();
  if (!stream_error.ok()) {
    // The stream's own status says more than "it broke" when it has one.
    return finish.ok() || finish.code() == absl::StatusCode::kCancelled
               ? stream_error
               : finish;
  }
  if (!finish.ok()) return finish;
  r.rescore_messages = inbox.rescore_messages();
  r.rescored_predictions = inbox.rescored_predictions();
  r.published = inbox.published();
  r.spearman = readout::Spearman(all_pred, all_truth);
  if (r.predicted == 0) {
    if (!r.first_error.ok()) return r.first_error;
    return absl::FailedPreconditionError(
        "FAILED_PRECONDITION: leapd predicted none of the rows");
  }

  AdminClient admin(o.server, channel);
  for (const auto& [name, unused] : readouts_seen) {
    absl::StatusOr<pb::ReadoutInfo> info = admin.GetReadout(name);
    if (!info.ok()) continue;  // deleted meanwhile
    r.finals.push_back({name, info->version(), info->completions_learned(),
                        info->rls_backlog(), info->frozen()});
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

std::string FormatFeedWindow(const FeedWindow& w) {
  std::vector<std::string> versions;
  for (const auto& [name, v] : w.versions) {
    versions.push_back(
        v.first == v.last
            ? absl::StrFormat("%s v%d", name, v.first)
            : absl::StrFormat("%s v%d-v%d", name, v.first, v.last));
  }
  return absl::StrFormat(
      "rows %d-%d: spearman %s (n %d), predicted by %s; learned %d, skipped "
      "%d, rescores %d (%d predictions)\n",
      w.first_row, w.last_row, FormatSpearman(w.spearman), w.n,
      versions.empty() ? "-" : absl::StrJoin(versions, ", "), w.learned,
      w.skipped, w.rescore_messages, w.rescored_predictions);
}

std::string FormatFeedReport(const FeedReport& r) {
  std::string s =
      absl::StrFormat("rows: %d (d=%d %s)\n", r.rows, r.dim, r.dtype);
  absl::StrAppendFormat(&s, "predicted: %d (%d errors)\n", r.predicted,
                        r.prediction_errors);
  absl::StrAppendFormat(&s, "completions: learned %d, skipped %d (%d errors)\n",
                        r.learned, r.skipped, r.completion_errors);
  absl::StrAppendFormat(&s, "rescores: %d messages, %d predictions\n",
                        r.rescore_messages, r.rescored_predictions);
  absl::StrAppendFormat(&s, "published_notices: %d\n", r.published);
  absl::StrAppendFormat(&s, "spearman: %s (all predicted rows that stopped)\n",
                        FormatSpearman(r.spearman));
  for (const FeedFinal& f : r.finals) {
    absl::StrAppendFormat(
        &s,
        "final: readout %s version %d (completions_learned %d, rls_backlog "
        "%d%s)\n",
        f.readout, f.version, f.completions_learned, f.rls_backlog,
        f.frozen ? ", frozen" : "");
  }
  if (!r.first_error.ok()) {
    absl::StrAppendFormat(&s, "first_error: %s\n", r.first_error.message());
  }
  absl::StrAppendFormat(&s, "time_s: %.3f\n", r.seconds);
  return s;
}

std::string FormatFeedJson(const FeedReport& r) {
  nlohmann::json j;
  j["rows"] = r.rows;
  j["dim"] = r.dim;
  j["dtype"] = r.dtype;
  j["predicted"] = r.predicted;
  j["prediction_errors"] = r.prediction_errors;
  j["learned"] = r.learned;
  j["skipped"] = r.skipped;
  j["completion_errors"] = r.completion_errors;
  j["rescore_messages"] = r.rescore_messages;
  j["rescored_predictions"] = r.rescored_predictions;
  j["published"] = r.published;
  j["spearman"] = JsonNumber(r.spearman);
  j["windows"] = nlohmann::json::array();
  for (const FeedWindow& w : r.windows) {
    nlohmann::json o;
    o["first_row"] = w.first_row;
    o["last_row"] = w.last_row;
    o["n"] = w.n;
    o["spearman"] = JsonNumber(w.spearman);
    o["versions"] = nlohmann::json::object();
    for (const auto& [name, v] : w.versions) {
      o["versions"][name] = {{"first", v.first}, {"last", v.last}};
    }
    o["learned"] = w.learned;
    o["skipped"] = w.skipped;
    o["rescore_messages"] = w.rescore_messages;
    o["rescored_predictions"] = w.rescored_predictions;
    j["windows"].push_back(std::move(o));
  }
  j["final"] = nlohmann::json::array();
  for (const FeedFinal& f : r.finals) {
    j["final"].push_back({{"readout", f.readout},
                          {"version", f.version},
                          {"completions_learned", f.completions_learned},
                          {"rls_backlog", f.rls_backlog},
                          {"frozen", f.frozen}});
  }
  j["first_error"] = r.first_error.ok()
                         ? nlohmann::json(nullptr)
                         : nlohmann::json(std::string(r.first_error.message()));
  j["time_s"] = r.seconds;
  return j.dump() + "\n";
}

}  // namespace leap::leapctl

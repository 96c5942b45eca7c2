// leap_shim: the engine shim for Python engines (docs/ARCHITECTURE.md).
// A thin layer
// over leap::shim's Client, capture functions and CountdownScheduler; tensors
// come in through DLPack (dlpack_import.h), so no torch is linked and one
// build serves engines pinned to any torch version.
//
// absl::Status becomes a Python exception here and nowhere else:
// InvalidArgument/OutOfRange/AlreadyExists -> ValueError, NotFound ->
// KeyError, anything else -> RuntimeError naming the status code.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine_shim/capture.h"
#include "engine_shim/client.h"
#include "engine_shim/python/dlpack_import.h"
#include "engine_shim/scheduler.h"

namespace leap::shim::python {
namespace {

namespace py = pybind11;

// Longest stretch a wait spends without the GIL before it looks for a
// KeyboardInterrupt (Ctrl-C must not hang on a long timeout).
constexpr absl::Duration kSignalCheck = absl::Milliseconds(100);

[[noreturn]] void ThrowStatus(const absl::Status& s) {
  std::string msg(s.message());
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kAlreadyExists:
      throw py::value_error(msg);
    case absl::StatusCode::kNotFound:
      throw py::key_error(msg);
    default:
      throw std::runtime_error(
          absl::StrCat(absl::StatusCodeToString(s.code()), ": ", msg));
  }
}

DType ParseDType(std::string name) {
  // Also takes str(torch.float16) etc.
  if (name.rfind("torch.", 0) == 0) name = name.substr(6);
  if (name == "float32" || name == "float") return DType::kFloat32;
  if (name == "bfloat16") return DType::kBFloat16;
  if (name == "float16" || name == "half") return DType::kFloat16;
  throw py::value_error(absl::StrCat(
      "dtype must be 'float32', 'bfloat16' or 'float16', got '", name, "'"));
}


FinishReason ParseReason(const std::string& reason) {
  if (reason == "stop") return FinishReason::kStop;
  if (reason == "length") return FinishReason::kLength;
  if (reason == "cancelled") return FinishReason::kCancelled;
  if (reason == "aborted") return FinishReason::kAborted;
  throw py::value_error(absl::StrCat(
      "reason must be 'stop', 'length', 'cancelled' or 'aborted', got '",
      reason, "'"));
}

const char* KindName(Event::Kind k) {
  switch (k) {
    case Event::Kind::kPrediction:
      return "prediction";
    case Event::Kind::kRescore:
      return "rescore";
    case Event::Kind::kError:
      return "error";
    case Event::Kind::kConnected:
      return "connected";
    case Event::Kind::kDisconnected:
      return "disconnected";
  }
  return "unknown";
}

Event::Kind ParseKind(const std::string& kind) {
  for (Event::Kind k :
       {Event::Kind::kPrediction, Event::Kind::kRescore, Event::Kind::kError,
        Event::Kind::kConnected, Event::Kind::kDisconnected}) {
    if (kind == KindName(k)) return k;
  }
  throw py::value_error(absl::StrCat(
      "kind must be 'prediction', 'rescore', 'error', 'connected' or "
      "'disconnected', got '",
      kind, "'"));
}

absl::Duration Seconds(double s, const char* what) {
  if (std::isnan(s) || s < 0) {
    throw py::value_error(absl::StrCat(what, " must be >= 0 seconds, got ", s));
  }
  return std::isinf(s) ? absl::InfiniteDuration() : absl::Seconds(s);
}

// CudaCaptureAvailable(), asked once per process (device visibility is
// fixed at CUDA's initialisation) and only when a CUDA tensor comes.
bool CudaCaptureCached() {
  static const bool available = CudaCaptureAvailable();
  return available;
}

// Runs `attempt(slice)` without the GIL in slices of at most kSignalCheck
// until it returns true or `timeout` passes; between slices, with the GIL,
// a pending KeyboardInterrupt is raised. Returns attempt's last answer.
template <typename Fn>
bool WaitInterruptibly(absl::Duration timeout, Fn attempt) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    const absl::Duration left =
        std::max(deadline - absl::Now(), absl::ZeroDuration());
    bool done;
    {
      py::gil_scoped_release nogil;
      done = attempt(std::min(left, kSignalCheck));
    }
    if (done || left <= kSignalCheck) return done;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

// Events the client delivers on its reader thread (and, for rejected
// submissions, on the submitting thread), waiting for Python's poll().
// Thread-safe; Push never blocks for long.
class EventQueue {
 public:
  void Push(const Event& e) {
    absl::MutexLock lock(&mu_);
    events_.push_back(e);
  }
  // Events that were queued in the client before this queue took over go
  // in front of everything pushed since.
  void PushFront(std::vector<Event> events) {
    absl::MutexLock lock(&mu_);
    events_.insert(events_.begin(), std::make_move_iterator(events.begin()),
                   std::make_move_iterator(events.end()));
  }
  // Waits up to `timeout` for an event (or Close), then takes up to `max`.
  std::vector<Event> Take(size_t max, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !events_.empty() || closed_;
    };
    if (timeout > absl::ZeroDuration()) {
      mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
    }
    std::vector<Event> out;
    while (!events_.empty() && out.size() < max) {
      out.push_back(std::move(events_.front()));
      events_.pop_front();
    }
    return out;
  }
  bool closed() {
    absl::MutexLock lock(&mu_);
    return closed_;
  }
  void Close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }

 private:
  absl::Mutex mu_;
  std::deque<Event> events_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

// Sets a flag when the last copy of a CUDA capture's sink is destroyed: the
// capturer dropped its job, so the copies out of the tensor have landed
// (or were never issued) and the tensor may be released.
class LandedFlag {
 public:
  explicit LandedFlag(std::shared_ptr<std::atomic<bool>> landed)
      : landed_(std::move(landed)) {}
  ~LandedFlag() { landed_->store(true, std::memory_order_release); }
  LandedFlag(const LandedFlag&) = delete;
  LandedFlag& operator=(const LandedFlag&) = delete;

 private:
  std::shared_ptr<std::atomic<bool>> landed_;
};

// The Python Client. Its own state (capturers, tensors awaiting release) is
// touched with the GIL held, except the capturers, which waits reach
// without the GIL under cuda_mu_.
class PyClient {
 public:
  PyClient(std::string endpoint, int64_t dim, std::string dtype,
           std::string engine_id, std::string model_id, int32_t layer,
           double min_backoff_s, double max_backoff_s, double connect_timeout_s,
           int max_batch_records, int64_t max_live_requests,
           int64_t cuda_staging_bytes) {
    options_.endpoint = std::move(endpoint);
    options_.dim = dim;
    options_.dtype = ParseDType(std::move(dtype));
    options_.engine_id = std::move(engine_id);
    options_.model_id = std::move(model_id);
    options_.layer = layer;
    options_.min_backoff = Seconds(min_backoff_s, "min_backoff_s");
    options_.max_backoff = Seconds(max_backoff_s, "max_backoff_s");
    options_.connect_timeout = Seconds(connect_timeout_s, "connect_timeout_s");
    options_.max_batch_records = max_batch_records;
    options_.max_live_requests = max_live_requests;
    if (cuda_staging_bytes < 256) {
      throw py::value_error(absl::StrCat(
          "cuda_staging_bytes must be >= 256, got ", cuda_staging_bytes));
    }
    cuda_staging_bytes_ = static_cast<size_t>(cuda_staging_bytes);
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Start(options_);
    if (!c.ok()) ThrowStatus(c.status());
    client_ = std::shared_ptr<Client>(std::move(*c));
    events_ = std::make_shared<EventQueue>();
    client_->SetCallback([q = events_](const Event& e) { q->Push(e); });
    // Whatever the reader emitted before the callback was set.
    events_->PushFront(client_->Poll());
  }

  ~PyClient() { Close(); }
  PyClient(const PyClient&) = delete;
  PyClient& operator=(const PyClient&) = delete;

  void Capture(py::object tensor, const std::vector<std::string>& request_ids,
               const std::string& product_line, py::object max_tokens,
               std::optional<int64_t> stream) {
    std::shared_ptr<Client> client = Live();
    ReleaseLanded();
    const std::vector<int64_t> caps = MaxTokens(max_tokens, request_ids.size());
    ImportedTensor in = ImportTensor(tensor, options_.dim, request_ids.size(),
                                     stream, &CudaCaptureCached);
    if (in.view.rows == 0) return;
    if (in.view.device == Device::kCpu) {
      absl::Status status;
      {
        py::gil_scoped_release nogil;
        absl::StatusOr<std::vector<CapturedFeatures>> rows =
            CaptureCpu(in.view, request_ids, product_line, options_.dtype);
        if (rows.ok()) {
          for (size_t i = 0; i < rows->size(); ++i) {
            (*rows)[i].max_tokens = caps[i];
          }
          client->Submit(*std::move(rows));
        } else {
          status = rows.status();
        }
      }
      in.owner.Reset();  // copied: the producer may have its memory back
      if (!status.ok()) ThrowStatus(status);
      return;
    }
    CaptureCuda(*client, std::move(in), request_ids, product_line, caps);
  }

  void Complete(const std::string& request_id, int64_t output_tokens,
                const std::string& reason) {
    if (output_tokens < 0) {
      throw py::value_error(
          absl::StrCat("output_tokens must be >= 0, got ", output_tokens));
    }
    const FinishReason r = ParseReason(reason);
    std::shared_ptr<Client> client = Live();
    py::gil_scoped_release nogil;
    client->Complete(request_id, output_tokens, r);
  }

  void Cancel(const std::string& request_id) {
    std::shared_ptr<Client> client = Live();
    py::gil_scoped_release nogil;
    client->Cancel(request_id);
  }

  std::vector<Event> Poll(std::optional<int64_t> max, double timeout_s) {
    const absl::Duration timeout = Seconds(timeout_s, "timeout_s");
    if (max.has_value() && *max < 0) {
      throw py::value_error(absl::StrCat("max must be >= 0, got ", *max));
    }
    Live();
    ReleaseLanded();
    const size_t n = max.has_value() ? static_cast<size_t>(*max) : SIZE_MAX;
    if (n == 0) return {};
    std::shared_ptr<EventQueue> q = events_;
    std::vector<Event> out;
    WaitInterruptibly(timeout, [&](absl::Duration slice) {
      out = q->Take(n, slice);
      return !out.empty() || q->closed();
    });
    return out;
  }

  bool WaitConnected(double timeout_s) {
    const absl::Duration timeout = Seconds(timeout_s, "timeout_s");
    std::shared_ptr<Client> client = Live();
    return WaitInterruptibly(timeout, [&](absl::Duration slice) {
      return client->WaitConnected(slice);
    });
  }

  bool connected() const { return client_ != nullptr && client_->connected(); }
  bool degraded() const { return client_ == nullptr || client_->degraded(); }

  py::dict Stats() {
    std::shared_ptr<Client> client = Live();
    ReleaseLanded();
    const ClientStats s = client->stats();
    py::dict d;
    d["connected"] = client->connected();
    d["connects"] = s.connects;
    d["resubmitted"] = s.resubmitted;
    d["predictions"] = s.predictions;
    d["rescores"] = s.rescores;
    d["errors"] = s.errors;
    d["live"] = s.live;
    d["stalls"] = s.stalls;
    d["degraded"] = s.degraded;
    d["degraded_reason"] = s.degraded_reason;
    d["cuda_captures_in_flight"] = pending_.size();
    return d;
  }

  void Flush() {
    Live();
    absl::Status first;
    {
      py::gil_scoped_release nogil;
      absl::MutexLock lock(&cuda_mu_);
      for (auto& [device, capturer] : capturers_) {
        absl::Status s = capturer->Flush();
        if (first.ok()) first = s;
      }
    }
    ReleaseLanded();
    if (!first.ok()) ThrowStatus(first);
  }

  void Close() {
    if (client_ == nullptr) return;
    // From here on every method sees a closed client.
    std::shared_ptr<Client> client = std::move(client_);
    client_ = nullptr;
    std::map<int, std::unique_ptr<CudaCapturer>> capturers;
    {
      py::gil_scoped_release nogil;
      {
        absl::MutexLock lock(&cuda_mu_);
        capturers.swap(capturers_);
      }
      // Each destructor drains its side stream: every sink has run and
      // no copy still reads a pending tensor.
      capturers.clear();
    }
    pending_.clear();  // with the GIL: the producers' deleters run
    events_->Close();  // wakes pollers in other threads
    py::gil_scoped_release nogil;
    client.reset();  // joins the client's threads (when the last owner)
  }

  int64_t dim() const { return options_.dim; }
  std::string dtype() const { return std::string(DTypeName(options_.dtype)); }
  const std::string& endpoint() const { return options_.endpoint; }
  bool closed() const { return client_ == nullptr; }

 private:
  struct Pending {
    OwnedTensor tensor;
    std::shared_ptr<std::atomic<bool>> landed;
  };

  std::shared_ptr<Client> Live() const {
    if (client_ == nullptr) throw std::runtime_error("the client is closed");
    return client_;
  }

  static std::vector<int64_t> MaxTokens(py::handle max_tokens, size_t rows) {
    std::vector<int64_t> caps;
    if (py::isinstance<py::int_>(max_tokens)) {
      caps.assign(rows, max_tokens.cast<int64_t>());
    } else {
      try {
        caps = max_tokens.cast<std::vector<int64_t>>();
      } catch (const py::cast_error&) {
        throw py::type_error(
            "max_tokens must be an int or a sequence of ints (one per row)");
      }
      if (caps.size() != rows) {
        throw py::value_error(
            absl::StrCat("expected one max_tokens per request id: ", rows,
                         " request ids, got ", caps.size(), " max_tokens"));
      }
    }
    for (int64_t c : caps) {
      if (c < 0) {
        throw py::value_error(
            absl::StrCat("max_tokens must be >= 0 (0 = none), got ", c));
      }
    }
    return caps;
  }

  // Releases the CUDA captures' tensors whose copies have landed. GIL held.
  void ReleaseLanded() {
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->landed->load(std::memory_order_acquire)) {
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void CaptureCuda(Client& client, ImportedTensor in,
                   const std::vector<std::string>& request_ids,
                   const std::string& product_line,
                   const std::vector<int64_t>& caps) {
    auto landed = std::make_shared<std::atomic<bool>>(false);
    absl::Status s;
    {
      absl::MutexLock lock(&cuda_mu_);
      std::unique_ptr<CudaCapturer>& capturer =
          capturers_[in.view.device_index];
      if (capturer == nullptr) {
        absl::StatusOr<std::unique_ptr<CudaCapturer>> created =
            CudaCapturer::Create(in.view.device_index, cuda_staging_bytes_);
        if (!created.ok()) {
          capturers_.erase(in.view.device_index);
          ThrowStatus(created.status());
        }
        capturer = *std::move(created);
      }
      // The sink runs on a CUDA host-callback thread: no GIL, no CUDA.
      // The client outlives it: Close destroys (drains) the capturers
      // before the client.
      s = capturer->Capture(
          in.view, request_ids, product_line, options_.dtype,
          [client = &client, caps, flag = std::make_shared<LandedFlag>(landed)](
              std::vector<CapturedFeatures> rows) {
            for (size_t i = 0; i < rows.size() && i < caps.size(); ++i) {
              rows[i].max_tokens = caps[i];
            }
            client->Submit(std::move(rows));
          });
    }
    if (!s.ok()) ThrowStatus(s);  // in.owner releases the tensor
    pending_.push_back({std::move(in.owner), std::move(landed)});
  }

  ClientOptions options_;
  size_t cuda_staging_bytes_ = 0;
  std::shared_ptr<Client> client_;
  std::shared_ptr<EventQueue> events_;
  absl::Mutex cuda_mu_;
  std::map<int, std::unique_ptr<CudaCapturer>> capturers_ ABSL_GUARDED_BY(cuda_mu_);
  std::deque<Pending> pending_;
};

// The Python Scheduler: a CountdownScheduler plus the version of the
// prediction applied last per request, so apply() keeps the newest one.
// Not thread-safe, like the scheduler; every method runs with the GIL.
class PyScheduler {
 public:
  explicit PyScheduler(CountdownScheduler s) : s_(std::move(s)) {}

  void Add(const std::string& id) {
    Check(s_.Add(id));
    version_.erase(id);
  }
  void SetPrediction(const std::string& id, double tokens) {
    Check(s_.SetPrediction(id, tokens));
  }
  void Rescore(const std::string& id, double tokens) {
    Check(s_.Rescore(id, tokens));
  }
  void Remove(const std::string& id) {
    Check(s_.Remove(id));
    version_.erase(id);
  }
  std::vector<std::string> Select(std::optional<int> slots) {
    return slots.has_value() ? s_.Select(*slots) : s_.Select();
  }

  int Apply(py::iterable events) {
    int applied = 0;
    for (py::handle h : events) {
      if (!py::isinstance<Event>(h)) {
        throw py::type_error(absl::StrCat(
            "apply() takes leap_shim.Event objects, got ",
            std::string(py::str(py::type::handle_of(h).attr("__name__")))));
      }
      const Event& e = h.cast<const Event&>();
      if (e.kind != Event::Kind::kPrediction &&
          e.kind != Event::Kind::kRescore) {
        continue;
      }
      auto v = version_.find(e.request_id);
      if (v != version_.end() && e.version < v->second) continue;  // stale
      // Rescore also takes a first prediction; a prediction after a
      // sidecar restart (same or newer version) replaces the old one.
      if (!s_.Rescore(e.request_id, e.predicted_tokens).ok()) continue;
      version_[e.request_id] = e.version;
      ++applied;
    }
    return applied;
  }

  py::dict Request(const std::string& id) const {
    absl::StatusOr<RequestStats> r = s_.GetRequest(id);
    if (!r.ok()) ThrowStatus(r.status());
    py::dict d;
    d["predicted_tokens"] = r->predicted_tokens.has_value()
                                ? py::object(py::float_(*r->predicted_tokens))
                                : py::object(py::none());
    d["generated"] = r->generated;
    d["steps_waited"] = r->steps_waited;
    d["arrival"] = r->arrival;
    d["predictions"] = r->predictions;
    return d;
  }

  py::dict Counters() const {
    const SchedulerCounters& c = s_.counters();
    py::dict d;
    d["steps"] = c.steps;
    d["selections"] = c.selections;
    d["cap_promotions"] = c.cap_promotions;
    d["aging_promotions"] = c.aging_promotions;
    d["max_steps_waited"] = c.max_steps_waited;
    d["added"] = c.added;
    d["removed"] = c.removed;
    return d;
  }

  size_t size() const { return s_.size(); }
  bool Contains(const std::string& id) const { return s_.GetRequest(id).ok(); }

 private:
  static void Check(const absl::Status& s) {
    if (!s.ok()) ThrowStatus(s);
  }

  CountdownScheduler s_;
  absl::flat_hash_map<std::string, int64_t> version_;
};

UnpredictedPolicy ParsePolicy(const std::string& p) {
  if (p == "median") return UnpredictedPolicy::kMedian;
  if (p == "fixed") return UnpredictedPolicy::kFixed;
  if (p == "first") return UnpredictedPolicy::kFirst;
  if (p == "last") return UnpredictedPolicy::kLast;
  throw py::value_error(absl::StrCat(
      "unpredicted must be 'median', 'fixed', 'first' or 'last', got '", p,
      "'"));
}

leap::shim::SchedulingPolicy ParseSchedulingPolicy(const std::string& p) {
  using leap::shim::SchedulingPolicy;
  if (p == "countdown") return SchedulingPolicy::kCountdown;
  if (p == "bounded") return SchedulingPolicy::kBounded;
  if (p == "hrrn") return SchedulingPolicy::kHrrn;
  if (p == "linear-aging") return SchedulingPolicy::kLinearAging;
  throw py::value_error(absl::StrCat(
      "policy must be 'countdown', 'bounded', 'hrrn' or 'linear-aging', got '",
      p, "'"));
}

std::string EventRepr(const Event& e) {
  std::string s = absl::StrCat("Event(kind='", KindName(e.kind), "'");
  if (!e.request_id.empty())
    absl::StrAppend(&s, ", request_id='", e.request_id, "'");
  if (e.kind == Event::Kind::kPrediction || e.kind == Event::Kind::kRescore) {
    absl::StrAppend(&s, ", predicted_tokens=", e.predicted_tokens,
                    ", score=", e.score, ", readout='", e.readout,
                    "', version=", e.version);
  }
  if (e.code != 0) absl::StrAppend(&s, ", code=", e.code);
  if (!e.message.empty()) absl::StrAppend(&s, ", message='", e.message, "'");
  return s + ")";
}

}  // namespace
}  // namespace leap::shim::python

PYBIND11_MODULE(leap_shim, m) {
  namespace py = pybind11;
  using leap::shim::Event;
  using namespace leap::shim::python;  // NOLINT: the binding's own names

  m.doc() = R"doc(LEAP engine shim for Python engines (vLLM, SGLang, ...).

Ships the hidden state of each request's last prompt token to leapd, which
predicts the request's output length; feeds the predictions to a countdown
scheduler that picks the requests of each decode step; reports how each
request ended so leapd keeps learning.

  client = leap_shim.Client("unix:///run/leapd.sock", dim=4096, dtype="bfloat16")
  sched = leap_shim.Scheduler(slots=64)
  sched.add(rid)                                  # request admitted
  client.capture(hidden[:, -1, :], [rid])         # at prefill, layer L
  events = client.poll(); sched.apply(events)     # every decode step
  batch = sched.select()                          # ids that decode now
  client.complete(rid, n_tokens, "stop"); sched.remove(rid)

Tensors come in through DLPack (__dlpack__): torch, numpy, CuPy, JAX, ...
This module links no torch, so it works with whatever torch the engine pins.
Errors: ValueError / TypeError for bad arguments, KeyError for unknown
request ids in the Scheduler, RuntimeError for everything else.)doc";
  m.attr("__version__") = LEAP_VERSION_STRING;

  m.def(
      "cuda_capture_available", &leap::shim::CudaCaptureAvailable,
      R"doc(True when this build has the CUDA capture path and a CUDA device is
visible; otherwise Client.capture accepts only CPU tensors.)doc");

  py::class_<Event>(m, "Event",
                    R"doc(Something leapd said, delivered by Client.poll().

Attributes (read-only):
  kind: 'prediction' (first prediction of a request), 'rescore' (a new
    readout version re-predicted a live request), 'error' (a request or the
    connection failed; see code/message), 'connected' (message = the
    sidecar's id) or 'disconnected'.
  request_id: the request ('' for connection events and stream errors).
  predicted_tokens: predicted output length L-hat in tokens (prediction,
    rescore).
  score: the readout's raw score (prediction, rescore).
  readout: the readout that predicted (prediction, rescore).
  version: that readout's version (prediction, rescore).
  code: google.rpc code of an error (3 INVALID_ARGUMENT, 5 NOT_FOUND, ...).
  message: error text, or the sidecar id of a 'connected' event.)doc")
      .def(
          py::init([](const std::string& kind, std::string request_id,
                      double predicted_tokens, double score,
                      std::string readout, int64_t version, int32_t code,
                      std::string message) {
            Event e;
            e.kind = ParseKind(kind);
            e.request_id = std::move(request_id);
            e.predicted_tokens = predicted_tokens;
            e.score = score;
            e.readout = std::move(readout);
            e.version = version;
            e.code = code;
            e.message = std::move(message);
            return e;
          }),
          py::arg("kind"), py::arg("request_id") = "",
          py::arg("predicted_tokens") = 0.0, py::arg("score") = 0.0,
          py::arg("readout") = "", py::arg("version") = 0, py::arg("code") = 0,
          py::arg("message") = "",
          R"doc(Builds an event by hand (replays, simulators, tests); the client
makes its own.)doc")
      .def_property_readonly(
          "kind", [](const Event& e) { return std::string(KindName(e.kind)); },
          "'prediction', 'rescore', 'error', 'connected' or 'disconnected'.")
      .def_readonly("request_id", &Event::request_id, "The request's id.")
      .def_readonly("predicted_tokens", &Event::predicted_tokens,
                    "Predicted output length in tokens.")
      .def_readonly("score", &Event::score, "The readout's raw score.")
      .def_readonly("readout", &Event::readout, "Name of the readout.")
      .def_readonly("version", &Event::version, "Version of the readout.")
      .def_readonly("code", &Event::code, "google.rpc code of an error.")
      .def_readonly("message", &Event::message,
                    "Error text; the sidecar id for 'connected'.")
      .def("__repr__", &EventRepr);

  py::class_<PyClient>(m, "Client", R"doc(The engine's client of leapd.

Thread-safe and non-blocking: capture/complete/cancel queue their work and a
background thread ships it, keeps the connection alive (reconnecting with
backoff) and, after a sidecar restart, resubmits the features of every live
request and resends unacknowledged completions. Results arrive as events
through poll(). Usable as a context manager (close() on exit).)doc")
      .def(py::init<std::string, int64_t, std::string, std::string, std::string,
                    int32_t, double, double, double, int, int64_t, int64_t>(),
           py::arg("endpoint"), py::arg("dim"), py::arg("dtype") = "float32",
           py::arg("engine_id") = "", py::arg("model_id") = "",
           py::arg("layer") = -1, py::arg("min_backoff_s") = 0.05,
           py::arg("max_backoff_s") = 5.0, py::arg("connect_timeout_s") = 1.0,
           py::arg("max_batch_records") = 256,
           py::arg("max_live_requests") = 65536,
           py::arg("cuda_staging_bytes") = int64_t{64} << 20,
           R"doc(Starts the client; connecting happens in the background.

Args:
  endpoint: leapd's address, "host:port", "unix:///path/to/socket" or
    "shm:///path/to/leap.shm"; anything else (e.g. "http://host") raises
    ValueError.
  dim: feature width d (the model's hidden size); every captured row must
    have exactly d values.
  dtype: element type shipped to leapd: "float32" (default), "bfloat16" or
    "float16"; captured tensors of another of these types are converted.
  engine_id, model_id, layer: identity shown in leapd's logs and metrics
    (layer = the L whose hidden state is captured).
  min_backoff_s, max_backoff_s: reconnect backoff, doubling from min to max.
  connect_timeout_s: how long one connection attempt may take.
  max_batch_records: records per message to leapd.
  max_live_requests: requests kept for resubmission; more are refused with
    an 'error' event (code 8).
  cuda_staging_bytes: pinned host memory per CUDA device for CUDA captures.

Raises:
  ValueError: a bad option (dim outside [1, 16384], unknown dtype, ...).)doc")
      .def(
          "capture", &PyClient::Capture, py::arg("tensor"),
          py::arg("request_ids"), py::arg("product_line") = "",
          py::arg("max_tokens") = 0, py::arg("stream") = py::none(),
          R"doc(Ships the hidden states of new requests to leapd for prediction.

Args:
  tensor: [batch, dim] rows, one per request, of float32, bfloat16 or
    float16, on the CPU or a CUDA device, any strides (slices, transposes,
    last-token rows of a packed batch). Anything with __dlpack__ (torch,
    numpy, CuPy, JAX) or a 'dltensor' PyCapsule (consumed: renamed
    'used_dltensor').
  request_ids: one id (str) per row, in row order.
  product_line: routing key of these requests in leapd ('' = default route).
  max_tokens: each request's own output cap (0 = none); an int for all rows
    or one int per row.
  stream: CUDA tensors only, the DLPack stream number of the stream the
    tensor is produced on: an int cudaStream_t (torch:
    torch.cuda.current_stream().cuda_stream), 1 = legacy default stream,
    2 = per-thread default stream. None means 1. The producer is asked, via
    __dlpack__(stream=...), to order its work before that stream, and the
    copy to the host is ordered after the work queued on it so far.
    Ignored for CPU tensors.

CPU tensors are read before capture() returns; the tensor is released
right away. CUDA tensors are copied asynchronously on a side stream into
pinned memory and shipped from a CUDA callback: capture() returns at once,
the tensor is kept alive until its copy landed, but the engine must not
write into it before then (capture a fresh slice, not a buffer the next
step overwrites). flush() waits for the copies.

Results come later through poll(): one 'prediction' per request, or an
'error' (e.g. a duplicate id, code 6).

Raises:
  TypeError: not a DLPack tensor, or not float32/bfloat16/float16.
  ValueError: not 2-D, not dim columns, not one id per row, another device,
    non-positive strides, a bad stream or max_tokens, a consumed capsule.
  RuntimeError: a CUDA tensor without CUDA capture in this build or
    process, the pinned staging memory full (RESOURCE_EXHAUSTED: flush()
    and retry), or the client is closed.)doc")
      .def("complete", &PyClient::Complete, py::arg("request_id"),
           py::arg("output_tokens"), py::arg("reason") = "stop",
           R"doc(Reports how a request ended, so leapd learns from it.

Args:
  request_id: a captured request.
  output_tokens: tokens the request generated.
  reason: "stop" (EOS or stop string: learned), "length" (hit max_tokens:
    learned only when it reached leapd's budget), "cancelled" or "aborted"
    (not learned).

The request stays known to the client until leapd acknowledges it (resent
after a reconnect). Unknown or already completed ids are ignored.

Raises:
  ValueError: negative output_tokens or an unknown reason.)doc")
      .def(
          "cancel", &PyClient::Cancel, py::arg("request_id"),
          R"doc(Drops a request without learning from it. Unknown ids are ignored.)doc")
      .def("poll", &PyClient::Poll, py::arg("max") = py::none(),
           py::arg("timeout_s") = 0.0,
           R"doc(Takes the events that arrived, oldest first.

Args:
  max: at most this many (None = all).
  timeout_s: 0 (default) never waits: the call for an engine's step loop.
    Otherwise waits up to timeout_s seconds for at least one event (the GIL
    is released while waiting).

Returns:
  list[Event], possibly empty.)doc")
      .def("wait_connected", &PyClient::WaitConnected, py::arg("timeout_s"),
           R"doc(Waits up to timeout_s seconds until the client is connected to
leapd (startup checks and tests; the GIL is released while waiting).

Returns:
  True when connected, False at the deadline.)doc")
      .def(
          "flush", &PyClient::Flush,
          R"doc(Waits until every CUDA capture issued so far has been copied and
handed to the client, and releases those tensors (no-op without CUDA
captures). The GIL is released while waiting.

Raises:
  RuntimeError: a CUDA copy or conversion failed.)doc")
      .def(
          "close", &PyClient::Close,
          R"doc(Drains the CUDA captures, stops the background threads and closes
the connection. Idempotent; later calls other than close() raise
RuntimeError. Queued, unsent work is dropped.)doc")
      .def_property_readonly(
          "stats", &PyClient::Stats,
          R"doc(Counters since start, as a dict: connected, connects, resubmitted
(features resent after a sidecar restart), predictions, rescores, errors,
live (requests kept for resubmission), stalls (connections abandoned because
leapd answered nothing for 2 s), degraded, degraded_reason,
cuda_captures_in_flight.)doc")
      .def_property_readonly("connected", &PyClient::connected,
                             "True while a session with leapd is up.")
      .def_property_readonly(
          "degraded", &PyClient::degraded,
          "True while no leapd answers (absent, hung, restarting): requests "
          "get no prediction and the scheduler keeps their arrival order; "
          "predictions resume by themselves. Never blocks.")
      .def_property_readonly("closed", &PyClient::closed, "True after close().")
      .def_property_readonly("dim", &PyClient::dim, "Feature width d.")
      .def_property_readonly("dtype", &PyClient::dtype,
                             "Element type shipped to leapd.")
      .def_property_readonly("endpoint", &PyClient::endpoint,
                             "leapd's address.")
      .def(
          "__enter__", [](py::object self) { return self; },
          "Returns the client.")
      .def(
          "__exit__",
          [](PyClient& c, py::handle, py::handle, py::handle) {
            c.Close();
            return false;
          },
          "Closes the client.");

  py::class_<PyScheduler>(
      m, "Scheduler",
      R"doc(Countdown scheduler: which live requests get this decode step's slots.

Each step takes the `slots` live requests with the smallest
remaining = max(predicted_tokens - generated, remaining_floor), ties by
arrival; requests that waited `waiting_cap` steps without a slot go first;
optional exponential aging (priority = remaining * exp(-aging_rate *
steps_waited)). Requests without a prediction yet are placed by
`unpredicted`. Deterministic, no I/O.

Not thread-safe: call it from the engine's step loop only.)doc")
      .def(py::init([](int slots, int waiting_cap, double aging_rate,
                       double remaining_floor, const std::string& unpredicted,
                       double unpredicted_tokens, const std::string& policy,
                       double max_slowdown, double linear_aging,
                       int tail_window, double tail_quantile) {
             leap::shim::SchedulerOptions o;
             o.policy = ParseSchedulingPolicy(policy);
             o.max_slowdown = max_slowdown;
             o.tail_window = tail_window;
             o.tail_quantile = tail_quantile;
             o.linear_aging = linear_aging;
             o.slots = slots;
             o.waiting_cap = waiting_cap;
             o.aging_rate = aging_rate;
             o.remaining_floor = remaining_floor;
             o.unpredicted = ParsePolicy(unpredicted);
             o.unpredicted_tokens = unpredicted_tokens;
             auto s = leap::shim::CountdownScheduler::Create(o);
             if (!s.ok())
               throw py::value_error(std::string(s.status().message()));
             return std::make_unique<PyScheduler>(*std::move(s));
           }),
           py::arg("slots") = 64, py::arg("waiting_cap") = 128,
           py::arg("aging_rate") = 0.0, py::arg("remaining_floor") = 1.0,
           py::arg("unpredicted") = "median",
           py::arg("unpredicted_tokens") = 256.0,
           py::arg("policy") = "countdown", py::arg("max_slowdown") = 2.5,
           py::arg("linear_aging") = 1.0, py::arg("tail_window") = 1000,
           py::arg("tail_quantile") = 0.99,
           R"doc(Args:
  slots: decode slots per step taken by select() (>= 1).
  waiting_cap: steps without a slot after which a request is promoted
    ahead of all others (0 disables).
  aging_rate: exponential aging rate (0 disables).
  remaining_floor: lower bound of remaining.
  unpredicted: where requests without a prediction go: "median" (as if
    their remaining were the median of the predicted ones; FCFS when the
    sidecar is down), "fixed" (as if it were unpredicted_tokens), "first"
    or "last".
  unpredicted_tokens: remaining assumed by "fixed", and by "median" while
    nothing is predicted.
  policy: "countdown" (the default), "bounded" (the countdown with the tail
    bound: a request whose remaining work no longer fits before its
    deadline, max_slowdown times the latency a virtual FCFS system with the
    same slots would give it, goes first, earliest deadline first), "hrrn"
    or "linear-aging" (baselines); see docs/SCHEDULING.md.
  max_slowdown: S of "bounded" (>= 1).
  tail_window, tail_quantile: "bounded"'s tail reference, the
    tail_quantile of the virtual FCFS latencies of the last tail_window
    requests (0 = off); a request may take S x max(its own, that).
  linear_aging: tokens of priority per step waited of "linear-aging".

Raises:
  ValueError: an option out of range.)doc")
      .def("add", &PyScheduler::Add, py::arg("request_id"),
           R"doc(Makes a request live (no prediction yet, 0 generated). Add it
before capturing it, so its prediction finds it.

Raises:
  ValueError: the id is live already.)doc")
      .def("set_prediction", &PyScheduler::SetPrediction, py::arg("request_id"),
           py::arg("predicted_tokens"),
           R"doc(Sets a request's first prediction (tokens).

Raises:
  KeyError: unknown id. ValueError: negative or non-finite value.
  RuntimeError: it has a prediction already (use rescore).)doc")
      .def(
          "rescore", &PyScheduler::Rescore, py::arg("request_id"),
          py::arg("predicted_tokens"),
          R"doc(Replaces a request's prediction; its generated tokens are kept, so
the countdown continues from the new value. Also takes a first prediction.

Raises:
  KeyError: unknown id. ValueError: negative or non-finite value.)doc")
      .def("remove", &PyScheduler::Remove, py::arg("request_id"),
           R"doc(Forgets a finished or cancelled request.

Raises:
  KeyError: unknown id.)doc")
      .def("select", &PyScheduler::Select, py::arg("slots") = py::none(),
           R"doc(Decides and commits one decode step.

Args:
  slots: slots this step (None = the scheduler's slots).

Returns:
  list[str]: up to `slots` live request ids, in priority order. They count
  one generated token each; every other live request waited one step.)doc")
      .def("apply", &PyScheduler::Apply, py::arg("events"),
           R"doc(Feeds a client's events into the scheduler: 'prediction' and
'rescore' events set the request's predicted_tokens, unless an event of a
newer readout version was applied to it already; events of requests that
are not live here and all other kinds are skipped.

  events = client.poll(); sched.apply(events); batch = sched.select()

Returns:
  int: how many events changed a prediction.

Raises:
  TypeError: an element is not a leap_shim.Event.)doc")
      .def("request", &PyScheduler::Request, py::arg("request_id"),
           R"doc(A snapshot of a live request: dict with predicted_tokens (None
until predicted), generated, steps_waited, arrival, predictions.

Raises:
  KeyError: unknown id.)doc")
      .def_property_readonly("size", &PyScheduler::size,
                             "Number of live requests.")
      .def_property_readonly(
          "counters", &PyScheduler::Counters,
          R"doc(Counters since creation, as a dict: steps, selections,
cap_promotions, aging_promotions, max_steps_waited, added, removed.)doc")
      .def("__len__", &PyScheduler::size, "Number of live requests.")
      .def("__contains__", &PyScheduler::Contains, py::arg("request_id"),
           "True when the request is live.");
}

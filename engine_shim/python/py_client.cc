#include "engine_shim/python/py_client.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/shm_format.h"
#include "engine_shim/python/py_convert.h"

namespace leap::shim::python {

namespace py = pybind11;

namespace {

// Longest stretch a wait spends without the GIL before it looks for a
// KeyboardInterrupt (Ctrl-C must not hang on a long timeout).
constexpr absl::Duration kSignalCheck = absl::Milliseconds(100);

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

// A Python int for a uint32 option; a value outside [0, 2^32) raises
// ValueError saying what the option must be (the Client checks the rest).
uint32_t Uint32Option(int64_t v, const char* what, const std::string& must_be) {
  if (v < 0 || v > int64_t{UINT32_MAX}) {
    throw py::value_error(absl::StrCat(what, " must be ", must_be, ", got ", v));
  }
  return static_cast<uint32_t>(v);
}

}  // namespace

PyClient::PyClient(std::string endpoint, int64_t dim, std::string dtype,
                   std::string engine_id, std::string model_id, int32_t layer,
                   double min_backoff_s, double max_backoff_s,
                   double connect_timeout_s, int max_batch_records,
                   int64_t max_live_requests, int64_t cuda_staging_bytes,
                   std::string tls_ca_file, std::string tls_cert_file,
                   std::string tls_key_file, std::string instance_id,
                   double response_timeout_s, int64_t shm_slots,
                   int64_t shm_ring_bytes) {
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
  options_.tls_ca_file = std::move(tls_ca_file);
  options_.tls_cert_file = std::move(tls_cert_file);
  options_.tls_key_file = std::move(tls_key_file);
  options_.instance_id = std::move(instance_id);
  if (!(response_timeout_s > 0)) {  // NaN too
    throw py::value_error(absl::StrCat(
        "response_timeout_s must be > 0 seconds, got ", response_timeout_s));
  }
  options_.response_timeout = Seconds(response_timeout_s, "response_timeout_s");
  // Python ints wider than the options' uint32 are refused here with the
  // Client's own wording (ClientOptions::Validate checks the rest), never
  // truncated.
  options_.shm_slots = Uint32Option(
      shm_slots, "shm_slots", absl::StrCat("in [1, ", ::leap::shm::kMaxSlots, "]"));
  options_.shm_ring_bytes = Uint32Option(
      shm_ring_bytes, "shm_ring_bytes",
      absl::StrCat("a power of two in [", ::leap::shm::kMinRingBytes, ", ",
                   ::leap::shm::kMaxRingBytes, "]"));
  if (cuda_staging_bytes < 256) {
    throw py::value_error(absl::StrCat(
        "cuda_staging_bytes must be >= 256, got ", cuda_staging_bytes));
  }
  cuda_staging_bytes_ = static_cast<size_t>(cuda_staging_bytes);
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Start(options_);
  if (!c.ok()) ThrowStatus(c.status());
  client_ = std::shared_ptr<Client>(std::move(*c));
  instance_id_ = client_->instance_id();
  events_ = std::make_shared<EventQueue>();
  // (Whatever the client emitted before goes to the callback first.)
  client_->SetCallback([q = events_](const Event& e) { q->Push(e); });
}

PyClient::~PyClient() { Close(); }

void PyClient::Capture(py::object tensor,
                       const std::vector<std::string>& request_ids,
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

void PyClient::Complete(const std::string& request_id, int64_t output_tokens,
                        const std::string& reason, int64_t prompt_tokens) {
  if (output_tokens < 0) {
    throw py::value_error(
        absl::StrCat("output_tokens must be >= 0, got ", output_tokens));
  }
  if (prompt_tokens < 0) {
    throw py::value_error(absl::StrCat(
        "prompt_tokens must be >= 0 (0 = not given), got ", prompt_tokens));
  }
  const FinishReason r = ParseReason(reason);
  std::shared_ptr<Client> client = Live();
  py::gil_scoped_release nogil;
  client->Complete(request_id, output_tokens, r, prompt_tokens);
}

void PyClient::Cancel(const std::string& request_id) {
  std::shared_ptr<Client> client = Live();
  py::gil_scoped_release nogil;
  client->Cancel(request_id);
}

std::vector<Event> PyClient::Poll(std::optional<int64_t> max,
                                  double timeout_s) {
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

bool PyClient::WaitConnected(double timeout_s) {
  const absl::Duration timeout = Seconds(timeout_s, "timeout_s");
  std::shared_ptr<Client> client = Live();
  return WaitInterruptibly(timeout, [&](absl::Duration slice) {
    return client->WaitConnected(slice);
  });
}

py::dict PyClient::Stats() {
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
  d["completion_retries"] = s.completion_retries;
  d["priors"] = s.priors;
  d["priors_unavailable"] = s.priors_unavailable;
  d["priors_dropped"] = s.priors_dropped;
  d["priors_unsupported"] = s.priors_unsupported;
  d["degraded"] = s.degraded;
  d["degraded_reason"] = s.degraded_reason;
  d["cuda_captures_in_flight"] = pending_.size();
  return d;
}

void PyClient::Flush() {
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

void PyClient::Close() {
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

std::shared_ptr<Client> PyClient::Live() const {
  if (client_ == nullptr) throw std::runtime_error("the client is closed");
  return client_;
}

std::vector<int64_t> PyClient::MaxTokens(py::handle max_tokens, size_t rows) {
  return Counts(max_tokens, rows, "max_tokens", 0, "(0 = none)");
}

std::vector<int64_t> PyClient::Counts(py::handle value, size_t rows,
                                      const char* what, int64_t min,
                                      const char* note) {
  std::vector<int64_t> out;
  if (value.is_none()) {
    out.assign(rows, 0);
  } else if (py::isinstance<py::int_>(value)) {
    out.assign(rows, value.cast<int64_t>());
  } else {
    try {
      out = value.cast<std::vector<int64_t>>();
    } catch (const py::cast_error&) {
      throw py::type_error(absl::StrCat(
          what, " must be an int or a sequence of ints (one per row)"));
    }
    if (out.size() != rows) {
      throw py::value_error(absl::StrCat("expected one ", what,
                                         " per request id: ", rows,
                                         " request ids, got ", out.size(),
                                         " ", what));
    }
  }
  for (int64_t c : out) {
    if (c < min) {
      throw py::value_error(
          absl::StrCat(what, " must be >= ", min, " ", note, ", got ", c));
    }
  }
  return out;
}

void PyClient::RequestPriors(const std::vector<std::string>& request_ids,
                             const std::string& product_line,
                             py::object prompt_tokens, py::object max_tokens) {
  std::shared_ptr<Client> client = Live();
  if (prompt_tokens.is_none()) {
    throw py::value_error("prompt_tokens is required (>= 1)");
  }
  const std::vector<int64_t> prompts =
      Counts(prompt_tokens, request_ids.size(), "prompt_tokens", 1, "");
  const std::vector<int64_t> caps = MaxTokens(max_tokens, request_ids.size());
  std::vector<Arrival> arrivals(request_ids.size());
  for (size_t i = 0; i < request_ids.size(); ++i) {
    arrivals[i].request_id = request_ids[i];
    arrivals[i].product_line = product_line;
    arrivals[i].prompt_tokens = prompts[i];
    arrivals[i].max_tokens = caps[i];
  }
  py::gil_scoped_release nogil;
  client->RequestPriors(std::move(arrivals));
}

void PyClient::ReleaseLanded() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->landed->load(std::memory_order_acquire)) {
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
}

void PyClient::CaptureCuda(Client& client, ImportedTensor in,
                           const std::vector<std::string>& request_ids,
                           const std::string& product_line,
                           const std::vector<int64_t>& caps) {
  auto landed = std::make_shared<std::atomic<bool>>(false);
  absl::Status s;
  {
    absl::MutexLock lock(&cuda_mu_);
    std::unique_ptr<CudaCapturer>& capturer = capturers_[in.view.device_index];
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

}  // namespace leap::shim::python

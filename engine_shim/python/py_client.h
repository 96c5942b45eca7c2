// leap_shim.Client: the engine's client of leapd for Python engines, a
// thin layer over leap::shim::Client and the capture functions; tensors come
// in through DLPack (dlpack_import.h). Internal to the leap_shim module
// (module.cc registers it).
//
// Threads: every PyClient method is called by Python, with the GIL held; it
// releases the GIL around work that may block (capture, waits, flush,
// close). Its own state (capturers, tensors awaiting release) is touched
// with the GIL held, except the capturers, which waits reach without the
// GIL under cuda_mu_. The EventQueue is filled on the client's reader
// thread (and, for rejected submissions, on the submitting thread).
#ifndef LEAP_ENGINE_SHIM_PYTHON_PY_CLIENT_H_
#define LEAP_ENGINE_SHIM_PYTHON_PY_CLIENT_H_

#include <pybind11/pybind11.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine_shim/capture.h"
#include "engine_shim/client.h"
#include "engine_shim/python/dlpack_import.h"

namespace leap::shim::python {

// Events the client delivers on its reader thread (and, for rejected
// submissions, on the submitting thread), waiting for Python's poll().
// Thread-safe; Push never blocks for long.
class EventQueue {
 public:
  void Push(const Event& e) {
    absl::MutexLock lock(&mu_);
    events_.push_back(e);
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

// The Python Client (see the thread contract above).
class PyClient {
 public:
  PyClient(std::string endpoint, int64_t dim, std::string dtype,
           std::string engine_id, std::string model_id, int32_t layer,
           double min_backoff_s, double max_backoff_s, double connect_timeout_s,
           int max_batch_records, int64_t max_live_requests,
           int64_t cuda_staging_bytes, std::string tls_ca_file,
           std::string tls_cert_file, std::string tls_key_file,
           std::string instance_id, double response_timeout_s,
           int64_t shm_slots, int64_t shm_ring_bytes);

  ~PyClient();
  PyClient(const PyClient&) = delete;
  PyClient& operator=(const PyClient&) = delete;

  void Capture(pybind11::object tensor,
               const std::vector<std::string>& request_ids,
               const std::string& product_line, pybind11::object max_tokens,
               std::optional<int64_t> stream);
  void RequestPriors(const std::vector<std::string>& request_ids,
                     const std::string& product_line,
                     pybind11::object prompt_tokens,
                     pybind11::object max_tokens);
  void Complete(const std::string& request_id, int64_t output_tokens,
                const std::string& reason, int64_t prompt_tokens);
  void Cancel(const std::string& request_id);
  std::vector<Event> Poll(std::optional<int64_t> max, double timeout_s);
  bool WaitConnected(double timeout_s);
  bool connected() const { return client_ != nullptr && client_->connected(); }
  bool degraded() const { return client_ == nullptr || client_->degraded(); }
  pybind11::dict Stats();
  void Flush();
  void Close();

  int64_t dim() const { return options_.dim; }
  std::string dtype() const { return std::string(DTypeName(options_.dtype)); }
  const std::string& endpoint() const { return options_.endpoint; }
  // The Client's instance id (the given one, or the one Start made up).
  const std::string& instance_id() const { return instance_id_; }
  double response_timeout_s() const {
    return absl::ToDoubleSeconds(options_.response_timeout);
  }
  int64_t shm_slots() const { return options_.shm_slots; }
  int64_t shm_ring_bytes() const { return options_.shm_ring_bytes; }
  bool closed() const { return client_ == nullptr; }

 private:
  struct Pending {
    OwnedTensor tensor;
    std::shared_ptr<std::atomic<bool>> landed;
  };

  std::shared_ptr<Client> Live() const;
  static std::vector<int64_t> MaxTokens(pybind11::handle max_tokens,
                                        size_t rows);
  // An int (every row), a sequence of one int per row, or None (0 each),
  // each >= min; ValueError / TypeError naming `what` otherwise.
  static std::vector<int64_t> Counts(pybind11::handle value, size_t rows,
                                     const char* what, int64_t min,
                                     const char* note);
  // Releases the CUDA captures' tensors whose copies have landed. GIL held.
  void ReleaseLanded();
  void CaptureCuda(Client& client, ImportedTensor in,
                   const std::vector<std::string>& request_ids,
                   const std::string& product_line,
                   const std::vector<int64_t>& caps);

  ClientOptions options_;
  size_t cuda_staging_bytes_ = 0;
  std::string instance_id_;  // stays readable after close()
  std::shared_ptr<Client> client_;
  std::shared_ptr<EventQueue> events_;
  absl::Mutex cuda_mu_;
  std::map<int, std::unique_ptr<CudaCapturer>> capturers_
      ABSL_GUARDED_BY(cuda_mu_);
  std::deque<Pending> pending_;
};

}  // namespace leap::shim::python

#endif  // LEAP_ENGINE_SHIM_PYTHON_PY_CLIENT_H_

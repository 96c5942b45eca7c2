// The CUDA capture path (docs/ARCHITECTURE.md, "Feature capture").
// Plain C++ against the CUDA runtime API:
// no kernels, so no nvcc and no GPU-architecture setup. Built when
// LEAP_WITH_CUDA resolves ON; capture.cc holds the stubs otherwise.
//
// Per capture, on the engine's thread (returns at once):
//   compute stream:  ... layer L ... [event] ... rest of prefill ...
//   side stream:              wait(event) -> D2H copies -> host callback
// The copies land in a slot of a pinned staging ring; the host callback
// (a CUDA driver thread) converts the staged rows on the CPU with
// CaptureCpu, frees the slot and hands the rows to the sink. The side stream
// is non-blocking, so it never serialises against the legacy default
// stream, and its copies use the copy engine while the compute stream runs.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "engine_shim/capture.h"

namespace leap::shim {
namespace {

// Slots start on this boundary (DMA-friendly, any element type aligned).
constexpr size_t kSlotAlignment = 256;

absl::Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  const std::string msg = absl::StrCat(what, ": ", cudaGetErrorName(e), " (",
                                       cudaGetErrorString(e), ")");
  switch (e) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      return absl::FailedPreconditionError(msg);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidPitchValue:
      return absl::InvalidArgumentError(msg);
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(msg);
    default:
      return absl::InternalError(msg);
  }
}

#define LEAP_CUDA_RETURN_IF_ERROR(call)                        \
  do {                                                         \
    if (absl::Status leap_cuda_s_ = CudaStatus((call), #call); \
        !leap_cuda_s_.ok()) {                                  \
      return leap_cuda_s_;                                     \
    }                                                          \
  } while (0)

// Makes `device` current on this thread for the scope and restores the
// engine's own current device after (it may be another one).
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    status_ = cudaGetDevice(&previous_);
    if (status_ == cudaSuccess && previous_ != device) {
      status_ = cudaSetDevice(device);
      restore_ = status_ == cudaSuccess;
    }
  }
  ~ScopedDevice() {
    if (restore_) cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  cudaError_t status() const { return status_; }

 private:
  int previous_ = 0;
  bool restore_ = false;
  cudaError_t status_ = cudaSuccess;
};

class CudaCapturerImpl final : public CudaCapturer {
 public:
  CudaCapturerImpl(int device, size_t pinned_bytes)
      : device_(device),
        pinned_bytes_(pinned_bytes),
        ring_(pinned_bytes, kSlotAlignment) {}

  ~CudaCapturerImpl() override {
    ScopedDevice scoped(device_);
    // Every callback references this object and a staging slot.
    if (side_ != nullptr) cudaStreamSynchronize(side_);
    for (const auto& [base, bytes] : registered_) cudaHostUnregister(base);
    if (ready_ != nullptr) cudaEventDestroy(ready_);
    if (side_ != nullptr) cudaStreamDestroy(side_);
    if (staging_ != nullptr) cudaFreeHost(staging_);
  }

  absl::Status Init() {
    ScopedDevice scoped(device_);
    LEAP_CUDA_RETURN_IF_ERROR(scoped.status());
    LEAP_CUDA_RETURN_IF_ERROR(
        cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    // Ordering only: timing would make every record heavier.
    LEAP_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    void* p = nullptr;
    LEAP_CUDA_RETURN_IF_ERROR(
        cudaHostAlloc(&p, pinned_bytes_, cudaHostAllocPortable));
    staging_ = static_cast<char*>(p);
    return absl::OkStatus();
  }

  absl::Status Capture(const TensorView& view,
                       std::span<const std::string> request_ids,
                       const std::string& product_line, DType out_dtype,
                       FeatureSink sink) override {
    if (view.device != Device::kCuda) {
      return absl::InvalidArgumentError(
          "CudaCapturer needs a CUDA view; CPU views go through CaptureCpu");
    }
    if (absl::Status s = ValidateView(view, view.cols, request_ids.size());
        !s.ok()) {
      return s;
    }
    if (view.device_index != device_) {
      return absl::InvalidArgumentError(
          absl::StrCat("view is on cuda:", view.device_index,
                       " but this capturer serves cuda:", device_));
    }
    if (out_dtype != DType::kFloat32 && out_dtype != DType::kBFloat16 &&
        out_dtype != DType::kFloat16) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown output dtype ", static_cast<int>(out_dtype)));
    }
    if (!sink) return absl::InvalidArgumentError("sink is empty");
    if (view.rows == 0) return absl::OkStatus();

    const internal::StagingPlan plan = internal::PlanStaging(view);
    const size_t bytes = static_cast<size_t>(plan.bytes);
    // Slots are whole alignment units (see StagingRing::Allocate).
    const size_t slot_bytes =
        (std::max<size_t>(bytes, 1) + kSlotAlignment - 1) &
        ~(kSlotAlignment - 1);
    if (slot_bytes > pinned_bytes_) {
      return absl::InvalidArgumentError(
          absl::StrCat("a capture of ", view.rows, " rows needs ", bytes,
                       " staging bytes, more than the ", pinned_bytes_,
                       " pinned bytes this capturer has"));
    }
    size_t offset;
    {
      absl::MutexLock lock(&mu_);
      std::optional<size_t> slot = ring_.Allocate(bytes);
      if (!slot.has_value()) {
        return absl::ResourceExhaustedError(
            absl::StrCat("pinned staging full: need ", bytes, " bytes, ",
                         ring_.used(), " of ", ring_.capacity(), " held by ",
                         ring_.live(), " captures in flight"));
      }
      offset = *slot;
    }

    auto job = std::make_unique<Job>();
    job->owner = this;
    job->staged.data = staging_ + offset;
    job->staged.dtype = view.dtype;
    job->staged.rows = view.rows;
    job->staged.cols = view.cols;
    job->staged.row_stride = plan.row_stride;
    job->staged.col_stride = plan.col_stride;
    job->staged.device = Device::kCpu;
    job->request_ids.assign(request_ids.begin(), request_ids.end());
    job->product_line = product_line;
    job->out_dtype = out_dtype;
    job->sink = std::move(sink);

    if (absl::Status s = Issue(view, plan, staging_ + offset, job.get());
        !s.ok()) {
      absl::MutexLock lock(&mu_);
      ring_.ReleaseNewest();  // nothing will call back for this slot
      return s;
    }
    job.release();  // the callback owns it now
    return absl::OkStatus();
  }

  absl::Status Flush() override {
    ScopedDevice scoped(device_);
    LEAP_CUDA_RETURN_IF_ERROR(scoped.status());
    LEAP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(side_));
    absl::MutexLock lock(&mu_);
    return std::exchange(callback_error_, absl::OkStatus());
  }

  absl::Status RegisterHostMemory(void* base, size_t bytes) override {
    if (base == nullptr || bytes == 0) {
      return absl::InvalidArgumentError("nothing to register");
    }
    ScopedDevice scoped(device_);
    LEAP_CUDA_RETURN_IF_ERROR(scoped.status());
    LEAP_CUDA_RETURN_IF_ERROR(
        cudaHostRegister(base, bytes, cudaHostRegisterPortable));
    absl::MutexLock lock(&mu_);
    registered_.emplace_back(static_cast<char*>(base), bytes);
    return absl::OkStatus();
  }

  absl::Status UnregisterHostMemory(void* base) override {
    ScopedDevice scoped(device_);
    LEAP_CUDA_RETURN_IF_ERROR(scoped.status());
    // Copies into it may still be queued.
    LEAP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(side_));
    {
      absl::MutexLock lock(&mu_);
      auto it = std::find_if(registered_.begin(), registered_.end(),
                             [base](const auto& r) { return r.first == base; });
      if (it == registered_.end()) {
        return absl::NotFoundError("memory was not registered");
      }
      registered_.erase(it);
    }
    LEAP_CUDA_RETURN_IF_ERROR(cudaHostUnregister(base));
    return absl::OkStatus();
  }

  absl::Status CaptureInto(const TensorView& view, std::span<void* const> dst,
                           std::function<void()> done) override {
    if (view.device != Device::kCuda) {
      return absl::InvalidArgumentError("CaptureInto needs a CUDA view");
    }
    if (absl::Status s = ValidateView(view, view.cols, dst.size()); !s.ok()) {
      return s;
    }
    if (view.device_index != device_) {
      return absl::InvalidArgumentError(
          absl::StrCat("view is on cuda:", view.device_index,
                       " but this capturer serves cuda:", device_));
    }
    if (!done) return absl::InvalidArgumentError("done is empty");
    const size_t esize = DTypeSize(view.dtype);
    const size_t row_bytes = static_cast<size_t>(view.cols) * esize;
    {
      absl::MutexLock lock(&mu_);
      for (size_t r = 0; r < dst.size(); ++r) {
        const char* d = static_cast<const char*>(dst[r]);
        const bool inside = std::any_of(
            registered_.begin(), registered_.end(), [&](const auto& reg) {
              return d >= reg.first && d + row_bytes <= reg.first + reg.second;
            });
        if (!inside) {
          return absl::InvalidArgumentError(absl::StrCat(
              "destination of row ", r,
              " is not inside memory registered with RegisterHostMemory"));
        }
      }
    }
    if (view.rows == 0) return absl::OkStatus();
    ScopedDevice scoped(device_);
    LEAP_CUDA_RETURN_IF_ERROR(scoped.status());
    auto compute = static_cast<cudaStream_t>(view.cuda_stream);
    LEAP_CUDA_RETURN_IF_ERROR(cudaEventRecord(ready_, compute));
    LEAP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_, ready_, 0));
    const char* src = static_cast<const char*>(view.data);
    for (int64_t r = 0; r < view.rows; ++r) {
      const char* row = src + static_cast<size_t>(r * view.row_stride) * esize;
      absl::Status s;
      if (view.col_stride == 1) {
        s = CudaStatus(cudaMemcpyAsync(dst[r], row, row_bytes,
                                       cudaMemcpyDeviceToHost, side_),
                       "cudaMemcpyAsync");
      } else {
        // A strided row: gather its elements (one per "line").
        s = CudaStatus(
            cudaMemcpy2DAsync(dst[r], esize, row,
                              static_cast<size_t>(view.col_stride) * esize,
                              esize, static_cast<size_t>(view.cols),
                              cudaMemcpyDeviceToHost, side_),
            "cudaMemcpy2DAsync");
      }
      if (!s.ok()) {
        cudaStreamSynchronize(side_);  // nothing half-queued stays behind
        return s;
      }
    }
    auto* cb = new std::function<void()>(std::move(done));
    if (absl::Status s = CudaStatus(
            cudaLaunchHostFunc(side_, &OnLanded, cb), "cudaLaunchHostFunc");
        !s.ok()) {
      cudaStreamSynchronize(side_);
      delete cb;
      return s;
    }
    return absl::OkStatus();
  }

 private:
  static void CUDART_CB OnLanded(void* arg) {
    std::unique_ptr<std::function<void()>> done(
        static_cast<std::function<void()>*>(arg));
    (*done)();
  }

  struct Job {
    CudaCapturerImpl* owner = nullptr;
    TensorView staged;  // a CPU view over the staging slot
    std::vector<std::string> request_ids;
    std::string product_line;
    DType out_dtype = DType::kFloat32;
    FeatureSink sink;
  };

  // Queues the capture on the side stream. On failure no callback is queued
  // and no copy is still writing into `slot`.
  absl::Status Issue(const TensorView& view, const internal::StagingPlan& plan,
                     char* slot, Job* job) {
    ScopedDevice scoped(device_);
    LEAP_CUDA_RETURN_IF_ERROR(scoped.status());
    bool issued_copies = false;
    absl::Status s = IssueOnDevice(view, plan, slot, job, &issued_copies);
    // A copy queued before the failure may still land in the slot, which
    // the caller is about to free: let the side stream drain first.
    if (!s.ok() && issued_copies) cudaStreamSynchronize(side_);
    return s;
  }

  absl::Status IssueOnDevice(const TensorView& view,
                             const internal::StagingPlan& plan, char* slot,
                             Job* job, bool* issued_copies) {
    auto compute = static_cast<cudaStream_t>(view.cuda_stream);
    // The wait takes the event as recorded now; re-recording it for the
    // next capture does not move this one, so one event serves all.
    LEAP_CUDA_RETURN_IF_ERROR(cudaEventRecord(ready_, compute));
    LEAP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_, ready_, 0));
    const char* src = static_cast<const char*>(view.data);
    for (const internal::Copy2D& c : plan.copies) {
      *issued_copies = true;
      if (c.height == 1) {
        LEAP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
            slot + c.dst_offset, src + c.src_offset,
            static_cast<size_t>(c.width), cudaMemcpyDeviceToHost, side_));
      } else {
        LEAP_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
            slot + c.dst_offset, static_cast<size_t>(c.dpitch),
            src + c.src_offset, static_cast<size_t>(c.spitch),
            static_cast<size_t>(c.width), static_cast<size_t>(c.height),
            cudaMemcpyDeviceToHost, side_));
      }
    }
    LEAP_CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc(side_, &OnStaged, job));
    return absl::OkStatus();
  }

  // Runs on a CUDA driver thread once the copies landed; calls no CUDA.
  static void CUDART_CB OnStaged(void* arg) {
    std::unique_ptr<Job> job(static_cast<Job*>(arg));
    CudaCapturerImpl* self = job->owner;
    absl::StatusOr<std::vector<CapturedFeatures>> rows = CaptureCpu(
        job->staged, job->request_ids, job->product_line, job->out_dtype);
    {
      // The rows are in their own buffers now: free the slot before the
      // sink runs, so a slow sink does not hold staging memory.
      absl::MutexLock lock(&self->mu_);
      self->ring_.ReleaseOldest();
      if (!rows.ok() && self->callback_error_.ok()) {
        self->callback_error_ = rows.status();
      }
    }
    if (rows.ok()) job->sink(*std::move(rows));
  }

  const int device_;
  const size_t pinned_bytes_;
  cudaStream_t side_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  char* staging_ = nullptr;

  absl::Mutex mu_;
  internal::StagingRing ring_ ABSL_GUARDED_BY(mu_);
  // The first conversion failure in a callback, reported by Flush.
  absl::Status callback_error_ ABSL_GUARDED_BY(mu_);
  // Host memory registered for CaptureInto.
  std::vector<std::pair<char*, size_t>> registered_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

bool CudaCaptureAvailable() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

absl::StatusOr<std::unique_ptr<CudaCapturer>> CudaCapturer::Create(
    int device, size_t pinned_bytes) {
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no CUDA device: cudaGetDeviceCount: ", cudaGetErrorName(e), " (",
        cudaGetErrorString(e), ")"));
  }
  if (count == 0) {
    return absl::FailedPreconditionError("no CUDA device present");
  }
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device ", device, " out of range: ", count, " CUDA devices"));
  }
  if (pinned_bytes < kSlotAlignment) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pinned_bytes must be >= ", kSlotAlignment, ", got ", pinned_bytes));
  }
  auto capturer = std::make_unique<CudaCapturerImpl>(device, pinned_bytes);
  if (absl::Status s = capturer->Init(); !s.ok()) return s;
  return std::unique_ptr<CudaCapturer>(std::move(capturer));
}

}  // namespace leap::shim

// Feature capture: the last-prompt-token hidden states of a prefill batch,
// taken from a raw tensor view so the shim is tied to no framework version
// (a LibTorch adapter and the DLPack-based Python binding build the view).
//
// CPU tensors are read in place (any strides) straight into the outgoing
// buffers. CUDA tensors (docs/ARCHITECTURE.md, "Feature capture"): an event
// recorded on the compute stream
// orders a cudaMemcpyAsync on a side stream into pinned memory, and a host
// callback hands the rows over, so the rest of prefill keeps the GPU.
#ifndef LEAP_ENGINE_SHIM_CAPTURE_H_
#define LEAP_ENGINE_SHIM_CAPTURE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine_shim/client.h"

namespace leap::shim {

enum class Device : uint8_t { kCpu = 1, kCuda = 2 };

// A [rows, cols] view: element (r, c) lives at
// data + (r * row_stride + c * col_stride) * DTypeSize(dtype). Strides are in
// elements and may be any positive values (non-contiguous views are fine).
struct TensorView {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;
  int64_t col_stride = 1;
  Device device = Device::kCpu;
  int device_index = 0;
  // The compute stream (cudaStream_t) the hidden state is produced on; null
  // means the legacy default stream. CUDA only.
  void* cuda_stream = nullptr;
};

// Checks the view against what the client ships: cols == dim, one request
// id per row, positive strides, a known dtype. Precise InvalidArgument
// messages ("expected 4096 columns, got 4095").
absl::Status ValidateView(const TensorView& view, int64_t dim,
                          size_t request_ids);

// CPU capture: reads the rows in place and converts to `out_dtype` on the
// fly when it differs (fp32 <-> bf16 <-> fp16). One CapturedFeatures per row.
absl::StatusOr<std::vector<CapturedFeatures>> CaptureCpu(
    const TensorView& view, std::span<const std::string> request_ids,
    const std::string& product_line, DType out_dtype);

// Receives the captured rows of a CUDA capture (on a CUDA host-callback
// thread: must not call CUDA, must not block; Client::Submit is fine).
using FeatureSink = std::function<void(std::vector<CapturedFeatures>)>;

// True when this build has the CUDA path and a device is present.
bool CudaCaptureAvailable();

// Asynchronous device-to-host capture with pinned staging buffers. One per
// engine process (or device). Thread-compatible: call Capture from the
// engine's step loop.
class CudaCapturer {
 public:
  virtual ~CudaCapturer() = default;
  // Creates the side stream and `pinned_bytes` of pinned staging memory on
  // `device`. Unimplemented when built without CUDA; FailedPrecondition
  // when no device is present.
  static absl::StatusOr<std::unique_ptr<CudaCapturer>> Create(
      int device, size_t pinned_bytes = size_t{64} << 20);
  // Orders the copy after the work queued on view.cuda_stream so far and
  // returns at once; `sink` gets the rows (converted to `out_dtype`) when
  // the copy lands. RESOURCE_EXHAUSTED when the staging memory is full
  // (retry after earlier captures land); INVALID_ARGUMENT when one capture
  // needs more staging than the capturer has at all.
  virtual absl::Status Capture(const TensorView& view,
                               std::span<const std::string> request_ids,
                               const std::string& product_line,
                               DType out_dtype, FeatureSink sink) = 0;
  // Blocks until every capture issued so far reached its sink (shutdown,
  // tests).
  virtual absl::Status Flush() = 0;

  // --- straight into shared-memory slots (no staging, no CPU copy)
  // Registers host memory the capturer may copy into directly: a
  // ShmChannel's slot arena (arena(), arena_bytes()), with cudaHostRegister.
  // Unregister it (or destroy the capturer) before the memory goes away.
  virtual absl::Status RegisterHostMemory(void* base, size_t bytes) = 0;
  virtual absl::Status UnregisterHostMemory(void* base) = 0;
  // Copies row r of `view` to dst[r] (view.cols values of view.dtype, which
  // must be the slots' dtype: no conversion on this path), ordered after the
  // work queued on view.cuda_stream so far; returns at once. `done` runs on
  // a CUDA driver thread once every row landed (submit the slots to leapd
  // there; it must not call CUDA). INVALID_ARGUMENT when a destination is
  // not inside registered memory.
  virtual absl::Status CaptureInto(const TensorView& view,
                                   std::span<void* const> dst,
                                   std::function<void()> done) = 0;
};

namespace internal {

// Pieces of the CUDA capturer that need no GPU, declared here so they are
// tested on every machine (capture_test.cc). Not part of the shim's API.

// One cudaMemcpy2DAsync of a staged capture: `height` lines of `width` bytes,
// source lines `spitch` bytes apart starting `src_offset` bytes past
// view.data, destination lines `dpitch` bytes apart starting `dst_offset`
// bytes into the staging slot. height == 1 is a plain cudaMemcpyAsync.
struct Copy2D {
  int64_t src_offset = 0;
  int64_t spitch = 0;
  int64_t dst_offset = 0;
  int64_t dpitch = 0;
  int64_t width = 0;
  int64_t height = 0;
};

// How a device view lands in pinned memory: the copies, the bytes of the
// staging slot they fill, and the strides (elements) of the staged rows, so
// that TensorView{slot, dtype, rows, cols, row_stride, col_stride} on the
// CPU reads the same values as `view` on the device. Only bytes between the
// view's first and last element are read.
struct StagingPlan {
  std::vector<Copy2D> copies;
  int64_t bytes = 0;
  int64_t row_stride = 0;
  int64_t col_stride = 0;
};

// `view` must have passed ValidateView.
StagingPlan PlanStaging(const TensorView& view);

// First-in-first-out allocator of contiguous byte ranges in a fixed ring:
// the pinned staging memory of the CUDA capturer, whose copies complete in
// issue order. Thread-compatible (the capturer holds a mutex around it).
class StagingRing {
 public:
  // Offsets are multiples of `alignment` (a power of two).
  StagingRing(size_t capacity, size_t alignment);
  // Offset of `n` free contiguous bytes, or nullopt when they do not fit now
  // (n == 0 takes one alignment unit).
  std::optional<size_t> Allocate(size_t n);
  // Frees the oldest live range (a capture that reached its sink).
  void ReleaseOldest();
  // Takes back the newest live range (a capture that failed to issue).
  void ReleaseNewest();
  size_t capacity() const { return capacity_; }
  // Bytes held, including the tail skipped when a range wrapped around.
  size_t used() const { return used_; }
  size_t live() const { return ranges_.size(); }

 private:
  struct Range {
    size_t offset;
    size_t size;     // aligned
    size_t charged;  // size plus the skipped tail, when it wrapped
  };
  const size_t capacity_;
  const size_t alignment_;
  size_t head_ = 0;  // next free byte
  size_t tail_ = 0;  // first byte still held
  size_t used_ = 0;
  std::deque<Range> ranges_;
};

}  // namespace internal

}  // namespace leap::shim

#endif  // LEAP_ENGINE_SHIM_CAPTURE_H_

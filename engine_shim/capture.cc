#include "engine_shim/capture.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/half.h"

namespace leap::shim {
namespace {

// The wire is little-endian and rows are copied as bytes.
static_assert(std::endian::native == std::endian::little);

bool KnownDType(DType d) {
  return d == DType::kFloat32 || d == DType::kBFloat16 || d == DType::kFloat16;
}

// Element loads and stores through memcpy: views may be unaligned.
template <DType D>
float Load(const char* p) {
  if constexpr (D == DType::kFloat32) {
    float f;
    std::memcpy(&f, p, sizeof f);
    return f;
  } else {
    uint16_t h;
    std::memcpy(&h, p, sizeof h);
    if constexpr (D == DType::kBFloat16) {
      return Bf16ToFloat(h);
    } else {
      return Fp16ToFloat(h);
    }
  }
}

template <DType D>
void Store(float f, char* p) {
  if constexpr (D == DType::kFloat32) {
    std::memcpy(p, &f, sizeof f);
  } else {
    const uint16_t h = D == DType::kBFloat16 ? FloatToBf16(f) : FloatToFp16(f);
    std::memcpy(p, &h, sizeof h);
  }
}

// One row of `cols` elements, `col_stride` elements apart, into `dst`
// (contiguous). Same dtype copies the bits (NaN payloads included); a
// different one goes through float, which holds every fp16/bf16 exactly.
template <DType In, DType Out>
void ConvertRow(const char* src, int64_t cols, int64_t col_stride, char* dst) {
  constexpr int64_t kIn = In == DType::kFloat32 ? 4 : 2;
  constexpr int64_t kOut = Out == DType::kFloat32 ? 4 : 2;
  if constexpr (In == Out) {
    if (col_stride == 1) {
      std::memcpy(dst, src, static_cast<size_t>(cols * kIn));
      return;
    }
    for (int64_t c = 0; c < cols; ++c) {
      std::memcpy(dst + c * kOut, src + c * col_stride * kIn, kIn);
    }
  } else {
    for (int64_t c = 0; c < cols; ++c) {
      Store<Out>(Load<In>(src + c * col_stride * kIn), dst + c * kOut);
    }
  }
}

using RowFn = void (*)(const char*, int64_t, int64_t, char*);

template <DType In>
RowFn PickOut(DType out) {
  switch (out) {
    case DType::kFloat32:
      return &ConvertRow<In, DType::kFloat32>;
    case DType::kBFloat16:
      return &ConvertRow<In, DType::kBFloat16>;
    case DType::kFloat16:
      return &ConvertRow<In, DType::kFloat16>;
  }
  return nullptr;
}

RowFn PickRowFn(DType in, DType out) {
  switch (in) {
    case DType::kFloat32:
      return PickOut<DType::kFloat32>(out);
    case DType::kBFloat16:
      return PickOut<DType::kBFloat16>(out);
    case DType::kFloat16:
      return PickOut<DType::kFloat16>(out);
  }
  return nullptr;
}

}  // namespace

absl::Status ValidateView(const TensorView& view, int64_t dim,
                          size_t request_ids) {
  if (!KnownDType(view.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown dtype ", static_cast<int>(view.dtype),
                     "; expected float32, bfloat16 or float16"));
  }
  if (view.device != Device::kCpu && view.device != Device::kCuda) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown device ", static_cast<int>(view.device),
                     "; expected cpu or cuda"));
  }
  if (view.device_index < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device index must be >= 0, got ", view.device_index));
  }
  if (view.rows < 0 || view.cols < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("negative shape [", view.rows, ", ", view.cols, "]"));
  }
  if (view.cols != dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected ", dim, " columns, got ", view.cols));
  }
  if (static_cast<size_t>(view.rows) != request_ids) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected one request id per row: ", view.rows,
                     " rows, got ", request_ids, " request ids"));
  }
  if (view.row_stride <= 0 || view.col_stride <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("strides must be positive, got row_stride ",
                     view.row_stride, " and col_stride ", view.col_stride));
  }
  if (view.rows == 0) return absl::OkStatus();
  if (view.data == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("view data is null for ", view.rows, " rows"));
  }
  // The last element's byte offset must fit an int64 (it is computed so).
  int64_t a, b, last, span, bytes;
  if (__builtin_mul_overflow(view.rows - 1, view.row_stride, &a) ||
      __builtin_mul_overflow(view.cols - 1, view.col_stride, &b) ||
      __builtin_add_overflow(a, b, &last) ||
      __builtin_add_overflow(last, 1, &span) ||
      __builtin_mul_overflow(span, static_cast<int64_t>(DTypeSize(view.dtype)),
                             &bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "strides ", view.row_stride, " and ", view.col_stride, " over shape [",
        view.rows, ", ", view.cols, "] overflow a 64-bit byte offset"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<CapturedFeatures>> CaptureCpu(
    const TensorView& view, std::span<const std::string> request_ids,
    const std::string& product_line, DType out_dtype) {
  if (view.device != Device::kCpu) {
    return absl::InvalidArgumentError(
        "CaptureCpu needs a CPU view; CUDA views go through CudaCapturer");
  }
  if (!KnownDType(out_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown output dtype ", static_cast<int>(out_dtype)));
  }
  if (absl::Status s = ValidateView(view, view.cols, request_ids.size());
      !s.ok()) {
    return s;
  }
  const RowFn row_fn = PickRowFn(view.dtype, out_dtype);
  const int64_t in_size = static_cast<int64_t>(DTypeSize(view.dtype));
  const size_t out_bytes =
      static_cast<size_t>(view.cols) * DTypeSize(out_dtype);
  const char* base = static_cast<const char*>(view.data);
  std::vector<CapturedFeatures> out(static_cast<size_t>(view.rows));
  for (int64_t r = 0; r < view.rows; ++r) {
    CapturedFeatures& f = out[static_cast<size_t>(r)];
    f.request_id = request_ids[static_cast<size_t>(r)];
    f.product_line = product_line;
    f.bytes.resize(out_bytes);
    row_fn(base + r * view.row_stride * in_size, view.cols, view.col_stride,
           f.bytes.data());
  }
  return out;
}

namespace internal {

StagingPlan PlanStaging(const TensorView& view) {
  const int64_t es = static_cast<int64_t>(DTypeSize(view.dtype));
  const int64_t rows = view.rows;
  const int64_t cols = view.cols;
  StagingPlan plan;
  if (rows == 0 || cols == 0) {
    plan.row_stride = std::max<int64_t>(cols, 1);
    plan.col_stride = 1;
    return plan;
  }
  // A stride along a dimension of size 1 is never used: pick values that
  // let the cases below apply.
  const int64_t cs = cols == 1 ? 1 : view.col_stride;
  const int64_t rs = rows == 1 ? cols * cs : view.row_stride;
  const int64_t packed = rows * cols * es;

  // Rows contiguous and not overlapping: one 2-D copy, rows packed.
  if (cs == 1 && rs >= cols) {
    plan.copies.push_back({0, rs * es, 0, cols * es, cols * es, rows});
    plan.bytes = packed;
    plan.row_stride = cols;
    plan.col_stride = 1;
    return plan;
  }
  // Columns contiguous (a transposed view): one 2-D copy, columns packed.
  if (rs == 1 && cs >= rows) {
    plan.copies.push_back({0, cs * es, 0, rows * es, rows * es, cols});
    plan.bytes = packed;
    plan.row_stride = 1;
    plan.col_stride = rows;
    return plan;
  }
  // Neither dimension is contiguous (or rows overlap). Copy the bounding
  // block from the first to the last element when it is at most 4x the
  // packed size — one large DMA beats many element-sized ones — and read it
  // with the view's own strides on the host.
  const int64_t span = ((rows - 1) * rs + (cols - 1) * cs + 1) * es;
  constexpr int64_t kMaxSpanFactor = 4;
  if (span <= kMaxSpanFactor * packed) {
    plan.copies.push_back({0, span, 0, span, span, 1});
    plan.bytes = span;
    plan.row_stride = rs;
    plan.col_stride = cs;
    return plan;
  }
  // Sparse in both dimensions: gather element by element, one 2-D copy per
  // line (element-wide lines `stride` apart) along the longer dimension, so
  // there are min(rows, cols) copies.
  plan.bytes = packed;
  if (rows <= cols) {
    for (int64_t r = 0; r < rows; ++r) {
      plan.copies.push_back(
          {r * rs * es, cs * es, r * cols * es, es, es, cols});
    }
    plan.row_stride = cols;
    plan.col_stride = 1;
  } else {
    for (int64_t c = 0; c < cols; ++c) {
      plan.copies.push_back(
          {c * cs * es, rs * es, c * rows * es, es, es, rows});
    }
    plan.row_stride = 1;
    plan.col_stride = rows;
  }
  return plan;
}

StagingRing::StagingRing(size_t capacity, size_t alignment)
    : capacity_(capacity), alignment_(alignment) {
  LEAP_CHECK(alignment > 0 && (alignment & (alignment - 1)) == 0)
      << "alignment " << alignment;
}

std::optional<size_t> StagingRing::Allocate(size_t n) {
  const size_t size =
      (std::max<size_t>(n, 1) + alignment_ - 1) & ~(alignment_ - 1);
  if (size > capacity_ || size < n) return std::nullopt;
  if (used_ == 0) head_ = tail_ = 0;
  size_t offset;
  size_t charged = size;
  if (used_ == 0 || tail_ < head_) {
    // Held bytes are [tail, head): free at the end, then at the start.
    if (capacity_ - head_ >= size) {
      offset = head_;
    } else if (tail_ >= size) {
      offset = 0;
      charged += capacity_ - head_;  // the skipped tail is held with it
    } else {
      return std::nullopt;
    }
  } else {
    // Wrapped: held bytes are [tail, capacity) and [0, head).
    if (tail_ - head_ < size) return std::nullopt;
    offset = head_;
  }
  head_ = offset + size;
  used_ += charged;
  ranges_.push_back({offset, size, charged});
  return offset;
}

void StagingRing::ReleaseOldest() {
  LEAP_CHECK(!ranges_.empty());
  const Range r = ranges_.front();
  ranges_.pop_front();
  used_ -= r.charged;
  tail_ = r.offset + r.size;
  if (used_ == 0) head_ = tail_ = 0;
}

void StagingRing::ReleaseNewest() {
  LEAP_CHECK(!ranges_.empty());
  const Range r = ranges_.back();
  ranges_.pop_back();
  used_ -= r.charged;
  head_ = r.charged > r.size ? capacity_ - (r.charged - r.size) : r.offset;
  if (used_ == 0) head_ = tail_ = 0;
}

}  // namespace internal

#ifndef LEAP_HAVE_CUDA
// Built without the CUDA toolkit (LEAP_WITH_CUDA=OFF or not found): the
// CUDA path is absent; capture_cuda.cc defines these otherwise.

bool CudaCaptureAvailable() { return false; }

absl::StatusOr<std::unique_ptr<CudaCapturer>> CudaCapturer::Create(
    int device, size_t pinned_bytes) {
  return absl::UnimplementedError(
      "CUDA capture is not built in: configure with the CUDA toolkit present "
      "(LEAP_WITH_CUDA=AUTO or ON), or capture CPU tensors with CaptureCpu");
}
#endif  // LEAP_HAVE_CUDA

}  // namespace leap::shim

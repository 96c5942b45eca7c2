// The only translation unit of the shim library that includes LibTorch.
#include "engine_shim/torch_adapter.h"

#include <algorithm>
#include <exception>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace leap::shim {
namespace {

absl::StatusOr<DType> ToDType(c10::ScalarType s) {
  switch (s) {
    case c10::ScalarType::Float:
      return DType::kFloat32;
    case c10::ScalarType::BFloat16:
      return DType::kBFloat16;
    case c10::ScalarType::Half:
      return DType::kFloat16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("expected a float32, bfloat16 or float16 tensor, got ",
                       c10::toString(s)));
  }
}

std::string Shape(c10::IntArrayRef sizes) {
  return absl::StrCat("[", absl::StrJoin(sizes, ", "), "]");
}

absl::StatusOr<TensorView> ViewOfUnchecked(const at::Tensor& t,
                                           void* cuda_stream) {
  if (!t.defined()) {
    return absl::InvalidArgumentError(
        "expected a tensor, got an undefined one");
  }
  if (t.dim() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected a 2-D [batch, d] tensor, got ", t.dim(), "-D ",
                     Shape(t.sizes())));
  }
  if (t.layout() != c10::kStrided) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected a strided (dense) tensor, got layout ",
                     c10::toString(t.layout())));
  }
  TensorView v;
  auto dtype = ToDType(t.scalar_type());
  if (!dtype.ok()) return dtype.status();
  v.dtype = *dtype;
  const c10::Device device = t.device();
  if (device.is_cpu()) {
    v.device = Device::kCpu;
  } else if (device.is_cuda()) {
    v.device = Device::kCuda;
    v.device_index = device.has_index() ? device.index() : 0;
    v.cuda_stream = cuda_stream;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "expected a CPU or CUDA tensor, got one on ", device.str()));
  }
  if (t.is_neg()) {
    return absl::InvalidArgumentError(
        "tensor has a lazy negation bit; call .resolve_neg() first");
  }
  v.rows = t.size(0);
  v.cols = t.size(1);
  v.row_stride = t.stride(0);
  v.col_stride = t.stride(1);
  // A size-1 dimension's stride is never used and torch leaves it
  // arbitrary (0 after expand, anything after a slice): make it valid.
  if (v.rows == 1) v.row_stride = std::max<int64_t>(v.cols, 1);
  if (v.cols == 1) v.col_stride = 1;
  if ((v.rows > 1 && v.row_stride <= 0) || (v.cols > 1 && v.col_stride <= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expected positive strides, got ", Shape(t.strides()), " for shape ",
        Shape(t.sizes()), " (a broadcast tensor?); call .contiguous() first"));
  }
  if (v.rows == 0 || v.cols == 0) {
    // Nothing to read; torch may have no storage behind it.
    v.row_stride = std::max<int64_t>(v.row_stride, 1);
    v.col_stride = std::max<int64_t>(v.col_stride, 1);
    v.data = t.numel() == 0 ? nullptr : t.data_ptr();
    return v;
  }
  v.data = t.data_ptr();  // includes the storage offset
  return v;
}

}  // namespace

absl::StatusOr<TensorView> ViewOf(const at::Tensor& t, void* cuda_stream) {
  try {
    return ViewOfUnchecked(t, cuda_stream);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("torch rejected the tensor: ", e.what()));
  }
}

absl::Status CaptureInto(Client& client, int64_t dim, DType dtype,
                         const at::Tensor& t,
                         std::span<const std::string> request_ids,
                         const std::string& product_line, CudaCapturer* cuda,
                         void* cuda_stream) {
  absl::StatusOr<TensorView> view = ViewOf(t, cuda_stream);
  if (!view.ok()) return view.status();
  if (absl::Status s = ValidateView(*view, dim, request_ids.size()); !s.ok()) {
    return s;
  }
  if (view->device == Device::kCpu) {
    absl::StatusOr<std::vector<CapturedFeatures>> rows =
        CaptureCpu(*view, request_ids, product_line, dtype);
    if (!rows.ok()) return rows.status();
    client.Submit(*std::move(rows));
    return absl::OkStatus();
  }
  if (cuda == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("a CUDA tensor (cuda:", view->device_index,
                     ") needs a CudaCapturer; none was given"));
  }
  return cuda->Capture(*view, request_ids, product_line, dtype,
                       [&client](std::vector<CapturedFeatures> rows) {
                         client.Submit(std::move(rows));
                       });
}

}  // namespace leap::shim

// LibTorch adapter: builds the shim's raw TensorView from a tensor and
// submits captured rows to a Client. A thin layer for C++ engines linked
// against LibTorch; the shim's core (capture.h) never sees torch, so an
// engine pinned to another torch version uses the core or the DLPack-based
// Python binding instead (docs/ARCHITECTURE.md). torch::Tensor is at::Tensor.
//
// The one public header that includes torch (the small <ATen/core/Tensor.h>).
// torch/c10 exceptions are converted to absl::Status inside; none escapes.
#ifndef LEAP_ENGINE_SHIM_TORCH_ADAPTER_H_
#define LEAP_ENGINE_SHIM_TORCH_ADAPTER_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine_shim/capture.h"
#include "engine_shim/client.h"

namespace leap::shim {

// A view of a 2-D [batch, d] tensor of float32, bfloat16 or float16 on the
// CPU or a CUDA device, with any (positive) strides: slices, .t(), row
// subsets all work without a copy. `cuda_stream` (a cudaStream_t) is the
// stream the tensor is produced on, for CUDA tensors; null is the legacy
// default stream. Strides of size-1 dimensions are normalised (torch leaves
// them arbitrary). InvalidArgument, naming what was expected and what came,
// for an undefined tensor, another rank, dtype, device or layout, and a
// broadcast (stride 0) dimension. The tensor must outlive the view.
absl::StatusOr<TensorView> ViewOf(const at::Tensor& t,
                                  void* cuda_stream = nullptr);

// Captures the rows of `t` (one per id in `request_ids`, in order) for
// `client`, whose ClientOptions say `dim` and `dtype` (Client does not
// expose them), and submits them. CPU tensors are read and submitted before
// this returns; CUDA tensors go through `cuda` (required for them), which
// copies after the work queued on `cuda_stream` so far and submits from its
// host callback — `client` must outlive that (CudaCapturer::Flush). The
// request's max_tokens is left 0. Thread-compatible like the capturer.
absl::Status CaptureInto(Client& client, int64_t dim, DType dtype,
                         const at::Tensor& t,
                         std::span<const std::string> request_ids,
                         const std::string& product_line,
                         CudaCapturer* cuda = nullptr,
                         void* cuda_stream = nullptr);

}  // namespace leap::shim

#endif  // LEAP_ENGINE_SHIM_TORCH_ADAPTER_H_

// The consumer side of the DLPack exchange for the leap_shim Python module:
// any tensor with __dlpack__ (torch, numpy, CuPy, JAX, ...) or a raw
// "dltensor" capsule becomes a leap::shim::TensorView, without linking any
// framework. Part of the binding (the edge where Python exceptions are
// made): errors are thrown as pybind11 exceptions, TypeError for what is not
// a usable tensor of a usable element type, ValueError for a wrong shape,
// device, stream or request-id count.
//
// Only unversioned DLPack (< 1.0, dlpack/dlpack.h from libdlpack-dev 0.6)
// is spoken: __dlpack__ is called without max_version, which every producer
// answers with a "dltensor" capsule.
//
// Every function here needs the GIL.
#ifndef LEAP_ENGINE_SHIM_PYTHON_DLPACK_IMPORT_H_
#define LEAP_ENGINE_SHIM_PYTHON_DLPACK_IMPORT_H_

#include <dlpack/dlpack.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <optional>

#include "engine_shim/capture.h"

namespace leap::shim::python {

// DLPack's stream number for the legacy default CUDA stream (the value of
// cudaStreamLegacy); what a consumer that names no stream asks for.
inline constexpr int64_t kLegacyDefaultStream = 1;

// A DLManagedTensor this module took from its capsule: the producer's memory
// stays valid until Reset() (or destruction) calls the tensor's deleter,
// exactly once. Producers' deleters may touch Python objects, so Reset and
// the destructor must run with the GIL held. Move-only.
class OwnedTensor {
 public:
  OwnedTensor() = default;
  explicit OwnedTensor(DLManagedTensor* managed) : managed_(managed) {}
  ~OwnedTensor() { Reset(); }
  OwnedTensor(OwnedTensor&& other) noexcept;
  OwnedTensor& operator=(OwnedTensor&& other) noexcept;
  OwnedTensor(const OwnedTensor&) = delete;
  OwnedTensor& operator=(const OwnedTensor&) = delete;

  // Calls the deleter (when there is one) and forgets the tensor.
  void Reset();
  bool holds() const { return managed_ != nullptr; }

 private:
  DLManagedTensor* managed_ = nullptr;
};

// A tensor taken from Python: the view and the ownership that keeps the
// memory behind it alive.
struct ImportedTensor {
  OwnedTensor owner;
  TensorView view;
};

// Takes the tensor of `obj`, which must hold `request_ids` rows of `dim`
// columns of float32, bfloat16 or float16 on the CPU (kDLCPU, or pinned
// kDLCUDAHost memory) or a CUDA device (kDLCUDA), with any positive strides
// (NULL strides = row-major contiguous).
//
// `obj` is either an object with __dlpack__ or a capsule named "dltensor".
// For an object that reports a CUDA device through __dlpack_device__,
// __dlpack__(stream=S) is called with S = `cuda_stream`, or 1 (the legacy
// default stream) when it is unset, so that the producer orders its pending
// work before S (DLPack's stream protocol); the view's cuda_stream is S.
// CPU producers are called as __dlpack__(). `cuda_stream` must be unset or
// >= 1 (DLPack: 0 is ambiguous, -1 would skip the producer's ordering).
//
// The input is checked completely before anything is consumed: on a
// TypeError/ValueError the capsule (the caller's, or the one __dlpack__
// returned) is left as it was. On success the capsule is renamed
// "used_dltensor", as the protocol asks of a consumer, and the returned
// OwnedTensor owns the DLManagedTensor.
//
// `cuda_capture` says whether this process can capture CUDA tensors; it is
// called only for CUDA tensors. When it says no, a CUDA tensor raises
// RuntimeError, also before anything is consumed or a producer is asked to
// synchronise.
ImportedTensor ImportTensor(pybind11::handle obj, int64_t dim,
                            size_t request_ids,
                            std::optional<int64_t> cuda_stream,
                            bool (*cuda_capture)());

// The view of a DLTensor, before the width and id-count checks: element
// type (TypeError), rank, device and strides (ValueError). Strides of
// size-1 dimensions are normalised (producers leave them arbitrary). The
// view's cuda_stream is left null.
TensorView ViewOfDLTensor(const DLTensor& t);

}  // namespace leap::shim::python

#endif  // LEAP_ENGINE_SHIM_PYTHON_DLPACK_IMPORT_H_

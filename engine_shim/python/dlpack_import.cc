#include "engine_shim/python/dlpack_import.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace leap::shim::python {
namespace py = pybind11;

namespace {

constexpr char kCapsuleName[] = "dltensor";
constexpr char kUsedCapsuleName[] = "used_dltensor";

std::string DTypeName(const DLDataType& d) {
  std::string base;
  switch (d.code) {
    case kDLInt:
      base = "int";
      break;
    case kDLUInt:
      base = "uint";
      break;
    case kDLFloat:
      base = "float";
      break;
    case kDLBfloat:
      base = "bfloat";
      break;
    case kDLComplex:
      base = "complex";
      break;
    case kDLOpaqueHandle:
      base = "opaque";
      break;
    default:
      base = absl::StrCat("code ", static_cast<int>(d.code), " bits ");
      break;
  }
  std::string name = absl::StrCat(base, static_cast<int>(d.bits));
  if (d.lanes != 1) absl::StrAppend(&name, "x", d.lanes);
  return name;
}

std::string DeviceName(int device_type) {
  switch (device_type) {
    case kDLCPU:
      return "cpu";
    case kDLCUDA:
      return "cuda";
    case kDLCUDAHost:
      return "cuda_host";
    case kDLOpenCL:
      return "opencl";
    case kDLVulkan:
      return "vulkan";
    case kDLMetal:
      return "metal";
    case kDLVPI:
      return "vpi";
    case kDLROCM:
      return "rocm";
    case kDLROCMHost:
      return "rocm_host";
    case kDLExtDev:
      return "ext_dev";
    case kDLCUDAManaged:
      return "cuda_managed";
    default:
      return absl::StrCat("type ", device_type);
  }
}

bool IsHost(int device_type) {
  // Pinned host memory (cudaMallocHost) is plain host memory to the CPU.
  return device_type == kDLCPU || device_type == kDLCUDAHost;
}

[[noreturn]] void ThrowDevice(int device_type, int device_id) {
  throw py::value_error(
      absl::StrCat("expected a CPU or CUDA tensor, got one on DLPack device ",
                   DeviceName(device_type), ":", device_id));
}

[[noreturn]] void ThrowNoCuda(int device_id) {
  throw std::runtime_error(absl::StrCat(
      "cannot capture a tensor on cuda:", device_id,
      ": this leap_shim has no CUDA capture (built without the CUDA toolkit) "
      "or sees no CUDA device (cuda_capture_available() is False); pass the "
      "rows on the CPU instead"));
}

std::string ShapeString(const int64_t* v, int n) {
  if (v == nullptr) return "(none)";
  return absl::StrCat("[", absl::StrJoin(v, v + n, ", "), "]");
}

// The capsule __dlpack__ gives (or `obj` itself when it is one).
py::object CapsuleOf(py::handle obj, std::optional<int64_t> cuda_stream,
                     bool (*cuda_capture)()) {
  if (PyCapsule_CheckExact(obj.ptr())) {
    return py::reinterpret_borrow<py::object>(obj);
  }
  if (!py::hasattr(obj, "__dlpack__")) {
    throw py::type_error(absl::StrCat(
        "expected a tensor that supports DLPack (an object with __dlpack__: "
        "torch, numpy, CuPy, JAX, ...) or a 'dltensor' capsule, got ",
        std::string(py::str(py::type::handle_of(obj).attr("__name__")))));
  }
  // The protocol: ask the device first, then pass a stream only to a CUDA
  // producer (for the CPU the stream must be None).
  if (py::hasattr(obj, "__dlpack_device__")) {
    py::tuple device = obj.attr("__dlpack_device__")();
    const int device_type = py::int_(device[0]);
    const int device_id = py::int_(device[1]);
    if (device_type == kDLCUDA) {
      if (!cuda_capture()) ThrowNoCuda(device_id);
      return obj.attr("__dlpack__")(
          py::arg("stream") = cuda_stream.value_or(kLegacyDefaultStream));
    }
    if (!IsHost(device_type)) ThrowDevice(device_type, device_id);
  }
  return obj.attr("__dlpack__")();
}

}  // namespace

OwnedTensor::OwnedTensor(OwnedTensor&& other) noexcept
    : managed_(std::exchange(other.managed_, nullptr)) {}

OwnedTensor& OwnedTensor::operator=(OwnedTensor&& other) noexcept {
  if (this != &other) {
    Reset();
    managed_ = std::exchange(other.managed_, nullptr);
  }
  return *this;
}

void OwnedTensor::Reset() {
  DLManagedTensor* m = std::exchange(managed_, nullptr);
  if (m != nullptr && m->deleter != nullptr) m->deleter(m);
}

TensorView ViewOfDLTensor(const DLTensor& t) {
  TensorView v;
  const DLDataType& d = t.dtype;
  if (d.lanes == 1 && d.code == kDLFloat && d.bits == 32) {
    v.dtype = DType::kFloat32;
  } else if (d.lanes == 1 && d.code == kDLFloat && d.bits == 16) {
    v.dtype = DType::kFloat16;
  } else if (d.lanes == 1 && d.code == kDLBfloat && d.bits == 16) {
    v.dtype = DType::kBFloat16;
  } else {
    throw py::type_error(absl::StrCat(
        "expected float32, bfloat16 or float16 elements, got ", DTypeName(d)));
  }
  if (t.ndim != 2) {
    throw py::value_error(
        absl::StrCat("expected a 2-D [batch, d] tensor, got ", t.ndim, "-D ",
                     ShapeString(t.shape, std::max(t.ndim, 0))));
  }
  const int device_type = static_cast<int>(t.device.device_type);
  if (IsHost(device_type)) {
    v.device = Device::kCpu;
  } else if (device_type == kDLCUDA) {
    v.device = Device::kCuda;
    v.device_index = t.device.device_id;
  } else {
    ThrowDevice(device_type, t.device.device_id);
  }
  v.rows = t.shape[0];
  v.cols = t.shape[1];
  if (v.rows < 0 || v.cols < 0) {
    throw py::value_error(
        absl::StrCat("negative shape ", ShapeString(t.shape, 2)));
  }
  if (t.strides == nullptr) {
    v.row_stride = v.cols;
    v.col_stride = 1;
  } else {
    v.row_stride = t.strides[0];
    v.col_stride = t.strides[1];
  }
  // A size-1 dimension's stride is never used and producers leave it
  // arbitrary (0 after a broadcast, anything after a slice).
  if (v.rows <= 1) v.row_stride = std::max<int64_t>(v.cols, 1);
  if (v.cols <= 1) v.col_stride = 1;
  if (v.row_stride <= 0 || v.col_stride <= 0) {
    throw py::value_error(absl::StrCat(
        "expected positive strides, got ", ShapeString(t.strides, 2),
        " for shape ", ShapeString(t.shape, 2),
        " (a broadcast or flipped view?); make it contiguous first"));
  }
  v.data = t.data == nullptr ? nullptr
                             : static_cast<const char*>(t.data) + t.byte_offset;
  return v;
}

ImportedTensor ImportTensor(py::handle obj, int64_t dim, size_t request_ids,
                            std::optional<int64_t> cuda_stream,
                            bool (*cuda_capture)()) {
  if (cuda_stream.has_value() && *cuda_stream < 1) {
    throw py::value_error(absl::StrCat(
        "stream must be None or a DLPack CUDA stream number >= 1 (1: legacy "
        "default stream, 2: per-thread default stream, else a cudaStream_t), "
        "got ",
        *cuda_stream));
  }
  py::object capsule = CapsuleOf(obj, cuda_stream, cuda_capture);
  if (!PyCapsule_CheckExact(capsule.ptr())) {
    throw py::type_error(absl::StrCat(
        "__dlpack__ returned a ",
        std::string(py::str(py::type::handle_of(capsule).attr("__name__"))),
        ", not a capsule"));
  }
  const char* name = PyCapsule_GetName(capsule.ptr());
  if (name != nullptr && std::strcmp(name, kUsedCapsuleName) == 0) {
    throw py::value_error(
        "this DLPack capsule was consumed already (it is named "
        "'used_dltensor'); take a new one from the tensor");
  }
  if (name == nullptr || std::strcmp(name, kCapsuleName) != 0) {
    throw py::type_error(absl::StrCat(
        "expected a capsule named 'dltensor' (unversioned DLPack), got one "
        "named '",
        name == nullptr ? "" : name, "'"));
  }
  auto* managed = static_cast<DLManagedTensor*>(
      PyCapsule_GetPointer(capsule.ptr(), kCapsuleName));
  if (managed == nullptr) throw py::error_already_set();

  ImportedTensor out;
  out.view = ViewOfDLTensor(managed->dl_tensor);
  if (absl::Status s = ValidateView(out.view, dim, request_ids); !s.ok()) {
    throw py::value_error(std::string(s.message()));
  }
  if (out.view.device == Device::kCuda) {
    if (!cuda_capture()) ThrowNoCuda(out.view.device_index);
    out.view.cuda_stream = reinterpret_cast<void*>(
        static_cast<intptr_t>(cuda_stream.value_or(kLegacyDefaultStream)));
  }
  // Consume: from here on the producer's capsule destructor leaves the
  // tensor alone and its deleter is ours to call.
  if (PyCapsule_SetName(capsule.ptr(), kUsedCapsuleName) != 0) {
    throw py::error_already_set();
  }
  out.owner = OwnedTensor(managed);
  return out;
}

}  // namespace leap::shim::python

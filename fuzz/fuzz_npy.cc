// Fuzz target: the .npy reader (common/npy.h). The input is the whole file,
// held in a memfd and read through its /proc/self/fd path (ReadNpy takes a
// path). Checks: no crash or sanitizer report; an accepted array has exactly
// num_elements * dtype-size bytes and non-negative dimensions; every error
// message starts with the path, as ReadNpy documents.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <string>

#include "absl/strings/match.h"
#include "common/npy.h"
#include "fuzz/fuzz_common.h"

volatile uint64_t g_sink;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const int fd = memfd_create("fuzz_npy", MFD_CLOEXEC);
  static const std::string path = "/proc/self/fd/" + std::to_string(fd);
  FUZZ_CHECK(fd >= 0);
  FUZZ_CHECK(ftruncate(fd, 0) == 0);
  size_t done = 0;
  while (done < size) {
    const ssize_t w = pwrite(fd, data + done, size - done,
                             static_cast<off_t>(done));
    FUZZ_CHECK(w > 0);
    done += static_cast<size_t>(w);
  }
  absl::StatusOr<leap::NpyArray> a = leap::ReadNpy(path);
  if (!a.ok()) {
    FUZZ_CHECK(absl::StartsWith(a.status().message(), path));
    return 0;
  }
  int64_t n = 1;
  for (int64_t d : a->shape) {
    FUZZ_CHECK(d >= 0);
    n *= d;
  }
  FUZZ_CHECK(n == a->num_elements());
  FUZZ_CHECK(a->data.size() ==
             static_cast<size_t>(n) * leap::NpyDTypeSize(a->dtype));
  // The typed view must be usable for the array's own dtype.
  uint64_t sum = 0;
  const auto* bytes = a->data.data();
  for (size_t i = 0; i < a->data.size(); ++i) sum += bytes[i];
  switch (a->dtype) {
    case leap::NpyDType::kFloat16:
      if (n > 0) sum += a->as<uint16_t>()[n - 1];
      break;
    case leap::NpyDType::kFloat32:
      if (n > 0) sum += static_cast<uint64_t>(a->as<float>()[n - 1] != 0);
      break;
    case leap::NpyDType::kFloat64:
      if (n > 0) sum += static_cast<uint64_t>(a->as<double>()[n - 1] != 0);
      break;
    case leap::NpyDType::kInt32:
      if (n > 0) sum += static_cast<uint64_t>(a->as<int32_t>()[n - 1]);
      break;
    case leap::NpyDType::kInt64:
      if (n > 0) sum += static_cast<uint64_t>(a->as<int64_t>()[n - 1]);
      break;
  }
  g_sink = g_sink + sum;  // keeps the reads
  return 0;
}

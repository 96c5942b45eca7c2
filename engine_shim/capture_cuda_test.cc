// The CUDA capture path on a real device (ctest label `gpu`: runs only where
// a GPU exists; skips with a message elsewhere). Checks the staged rows
// against CaptureCpu over the same bytes on the host (CaptureCpu is checked
// against common/half.h in capture_test), the ordering after the compute
// stream, the staging limit, and measures the overlap with "the rest of
// prefill".
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/half.h"
#include "engine_shim/capture.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace leap::shim {
namespace {

using Clock = std::chrono::steady_clock;

#define ASSERT_CUDA(call)                                                  \
  do {                                                                     \
    const cudaError_t e_ = (call);                                         \
    ASSERT_EQ(e_, cudaSuccess) << #call << ": " << cudaGetErrorString(e_); \
  } while (0)

std::vector<std::string> Ids(int64_t n) {
  std::vector<std::string> ids;
  for (int64_t i = 0; i < n; ++i) ids.push_back("req-" + std::to_string(i));
  return ids;
}

// Collects what the sink receives (on a CUDA callback thread).
class Collector {
 public:
  FeatureSink Sink() {
    return [this](std::vector<CapturedFeatures> rows) {
      absl::MutexLock lock(&mu_);
      for (auto& r : rows) rows_.push_back(std::move(r));
      ++calls_;
    };
  }
  std::vector<CapturedFeatures> Take() {
    absl::MutexLock lock(&mu_);
    return std::exchange(rows_, {});
  }
  int calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }

 private:
  absl::Mutex mu_;
  std::vector<CapturedFeatures> rows_ ABSL_GUARDED_BY(mu_);
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
};

// Holds a stream at this point until Open() (or destruction): a host
// function that waits, so the test decides when the compute stream moves
// on, without sleeps.
class StreamGate {
 public:
  explicit StreamGate(cudaStream_t s) : stream_(s) {
    ok_ = cudaLaunchHostFunc(s, &Wait, &open_) == cudaSuccess;
  }
  // Opens the gate and waits until the host function returned: it still
  // touches `open_` after it wakes.
  ~StreamGate() {
    Open();
    cudaStreamSynchronize(stream_);
  }
  bool ok() const { return ok_; }
  void Open() {
    if (!open_.HasBeenNotified()) open_.Notify();
  }

 private:
  static void CUDART_CB Wait(void* n) {
    static_cast<absl::Notification*>(n)->WaitForNotification();
  }
  cudaStream_t stream_;
  absl::Notification open_;
  bool ok_ = false;
};

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) {
    if (cudaMalloc(&p_, bytes) != cudaSuccess) p_ = nullptr;
  }
  ~DeviceBuffer() {
    if (p_ != nullptr) cudaFree(p_);
  }
  char* get() const { return static_cast<char*>(p_); }

 private:
  void* p_ = nullptr;
};

class CudaCaptureTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaCaptureAvailable()) {
      GTEST_SKIP() << "no CUDA device: this test runs only on GPU machines "
                      "(ctest label gpu)";
    }
    ASSERT_CUDA(cudaSetDevice(0));
    ASSERT_CUDA(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (compute_ != nullptr) {
      cudaStreamSynchronize(compute_);
      cudaStreamDestroy(compute_);
    }
  }
  cudaStream_t compute_ = nullptr;
};

struct Layout {
  const char* name;
  int64_t rows, cols, row_stride, col_stride;
};

TEST_F(CudaCaptureTest, StagedRowsMatchTheHostReference) {
  auto capturer = CudaCapturer::Create(0, size_t{1} << 20);
  ASSERT_TRUE(capturer.ok()) << capturer.status();
  const Layout layouts[] = {
      {"contiguous", 8, 256, 256, 1}, {"every other row", 8, 256, 512, 1},
      {"transposed", 8, 256, 1, 8},   {"every other column", 8, 128, 256, 2},
      {"sparse", 4, 32, 4096, 33},    {"single row", 1, 256, 7, 1},
  };
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (DType in : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    const int64_t es = static_cast<int64_t>(DTypeSize(in));
    for (const Layout& l : layouts) {
      const int64_t span =
          ((l.rows - 1) * l.row_stride + (l.cols - 1) * l.col_stride + 1) * es;
      std::vector<char> host(static_cast<size_t>(span));
      for (int64_t i = 0; i < span / es; ++i) {
        const float x = normal(rng);
        if (in == DType::kFloat32) {
          std::memcpy(host.data() + i * es, &x, 4);
        } else {
          const uint16_t h =
              in == DType::kBFloat16 ? FloatToBf16(x) : FloatToFp16(x);
          std::memcpy(host.data() + i * es, &h, 2);
        }
      }
      DeviceBuffer dev(host.size());
      ASSERT_NE(dev.get(), nullptr);
      ASSERT_CUDA(cudaMemcpy(dev.get(), host.data(), host.size(),
                             cudaMemcpyHostToDevice));
      for (DType out : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
        SCOPED_TRACE(::testing::Message()
                     << l.name << " in " << static_cast<int>(in) << " out "
                     << static_cast<int>(out));
        TensorView view{dev.get(),    in,           l.rows,        l.cols,
                        l.row_stride, l.col_stride, Device::kCuda, 0,
                        compute_};
        Collector got;
        const auto ids = Ids(l.rows);
        ASSERT_TRUE((*capturer)->Capture(view, ids, "p", out, got.Sink()).ok());
        ASSERT_TRUE((*capturer)->Flush().ok());
        TensorView host_view = view;
        host_view.data = host.data();
        host_view.device = Device::kCpu;
        auto want = CaptureCpu(host_view, ids, "p", out);
        ASSERT_TRUE(want.ok()) << want.status();
        const auto rows = got.Take();
        ASSERT_EQ(rows.size(), want->size());
        for (size_t r = 0; r < rows.size(); ++r) {
          EXPECT_EQ(rows[r].request_id, (*want)[r].request_id);
          EXPECT_EQ(rows[r].product_line, "p");
          EXPECT_EQ(rows[r].bytes, (*want)[r].bytes) << "row " << r;
        }
      }
    }
  }
}

// The shm path: rows land straight in slots of a registered arena (here a
// page-aligned buffer laid out like a ShmChannel's: slot_bytes apart, in
// scrambled slot order), contiguous and column-strided views, fp32 and bf16;
// destinations outside registered memory are refused.
TEST_F(CudaCaptureTest, CaptureIntoWritesRowsStraightIntoRegisteredSlots) {
  auto capturer = CudaCapturer::Create(0, size_t{1} << 20);
  ASSERT_TRUE(capturer.ok()) << capturer.status();
  const int64_t cols = 4096, slots = 16;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const size_t es = DTypeSize(dtype), slot_bytes = cols * es;
    void* arena = nullptr;
    ASSERT_EQ(posix_memalign(&arena, 4096, slot_bytes * slots), 0);
    std::memset(arena, 0, slot_bytes * slots);
    ASSERT_TRUE((*capturer)->RegisterHostMemory(arena, slot_bytes * slots).ok());
    for (int64_t col_stride : {1, 3}) {
      const int64_t rows = 5, row_stride = cols * col_stride;
      std::vector<char> host(rows * row_stride * es);
      std::mt19937 rng(static_cast<unsigned>(col_stride));
      for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<char>(rng());
      DeviceBuffer dev(host.size());
      ASSERT_CUDA(cudaMemcpy(dev.get(), host.data(), host.size(),
                             cudaMemcpyHostToDevice));
      const int64_t order[rows] = {11, 2, 7, 0, 15};
      std::vector<void*> dst;
      for (int64_t r = 0; r < rows; ++r) {
        dst.push_back(static_cast<char*>(arena) + order[r] * slot_bytes);
      }
      TensorView view{dev.get(), dtype,         rows, cols, row_stride,
                      col_stride, Device::kCuda, 0,    compute_};
      absl::Notification landed;
      ASSERT_TRUE((*capturer)->CaptureInto(view, dst, [&] { landed.Notify(); }).ok());
      ASSERT_TRUE(landed.WaitForNotificationWithTimeout(absl::Seconds(30)));
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          ASSERT_EQ(std::memcmp(static_cast<char*>(dst[r]) + c * es,
                                host.data() + (r * row_stride + c * col_stride) * es, es),
                    0)
              << "row " << r << " col " << c << " stride " << col_stride;
        }
      }
    }
    std::vector<char> outside(slot_bytes);
    DeviceBuffer dev(slot_bytes);
    TensorView one{dev.get(), dtype, 1, cols, cols, 1, Device::kCuda, 0, compute_};
    std::vector<void*> bad = {outside.data()};
    EXPECT_TRUE(absl::IsInvalidArgument((*capturer)->CaptureInto(one, bad, [] {})));
    std::vector<void*> overrun = {static_cast<char*>(arena) + slot_bytes * slots - 8};
    EXPECT_TRUE(absl::IsInvalidArgument((*capturer)->CaptureInto(one, overrun, [] {})));
    ASSERT_TRUE((*capturer)->UnregisterHostMemory(arena).ok());
    free(arena);
  }
}

TEST_F(CudaCaptureTest, CopiesAfterTheWorkQueuedOnTheComputeStream) {
  auto capturer = CudaCapturer::Create(0);
  ASSERT_TRUE(capturer.ok()) << capturer.status();
  const int64_t rows = 4, cols = 1024;
  const size_t bytes = rows * cols * sizeof(float);
  DeviceBuffer dev(bytes);
  ASSERT_NE(dev.get(), nullptr);
  ASSERT_CUDA(cudaMemset(dev.get(), 0, bytes));
  float* src = nullptr;  // pinned, so the upload below is truly async
  ASSERT_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&src), bytes, 0));
  for (int64_t i = 0; i < rows * cols; ++i) src[i] = 1.0f + i;

  Collector got;
  {
    StreamGate gate(compute_);
    ASSERT_TRUE(gate.ok());
    // "Layer L" writes the hidden state, after the gate.
    ASSERT_CUDA(cudaMemcpyAsync(dev.get(), src, bytes, cudaMemcpyHostToDevice,
                                compute_));
    TensorView view{dev.get(), DType::kFloat32, rows, cols,    cols,
                    1,         Device::kCuda,   0,    compute_};
    ASSERT_TRUE((*capturer)
                    ->Capture(view, Ids(rows), "p", DType::kFloat32, got.Sink())
                    .ok());
    EXPECT_EQ(got.calls(), 0);  // the compute stream is held at the gate
    gate.Open();
    ASSERT_TRUE((*capturer)->Flush().ok());
  }
  const auto out = got.Take();
  ASSERT_EQ(out.size(), static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> v(cols);
    std::memcpy(v.data(), out[r].bytes.data(), cols * sizeof(float));
    for (int64_t c = 0; c < cols; ++c) {
      ASSERT_EQ(v[c], 1.0f + r * cols + c) << "row " << r << " col " << c;
    }
  }
  cudaFreeHost(src);
}

TEST_F(CudaCaptureTest, FullStagingIsResourceExhaustedThenRecovers) {
  const int64_t rows = 3, cols = 256;  // 3 KiB of fp32
  auto capturer = CudaCapturer::Create(0, 4096);
  ASSERT_TRUE(capturer.ok()) << capturer.status();
  DeviceBuffer dev(rows * cols * sizeof(float));
  ASSERT_NE(dev.get(), nullptr);
  TensorView view{dev.get(), DType::kFloat32, rows, cols,    cols,
                  1,         Device::kCuda,   0,    compute_};
  Collector got;
  const auto ids = Ids(rows);
  {
    StreamGate gate(compute_);
    ASSERT_TRUE(gate.ok());
    ASSERT_TRUE(
        (*capturer)->Capture(view, ids, "p", DType::kFloat32, got.Sink()).ok());
    absl::Status full =
        (*capturer)->Capture(view, ids, "p", DType::kFloat32, got.Sink());
    EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
    EXPECT_THAT(std::string(full.message()),
                ::testing::HasSubstr("pinned staging full"));
    gate.Open();
    ASSERT_TRUE((*capturer)->Flush().ok());
  }
  EXPECT_EQ(got.calls(), 1);
  EXPECT_TRUE(
      (*capturer)->Capture(view, ids, "p", DType::kFloat32, got.Sink()).ok());
  ASSERT_TRUE((*capturer)->Flush().ok());
  EXPECT_EQ(got.calls(), 2);

  // Never fits: a clear error, not a wait.
  TensorView huge = view;
  huge.rows = 2;
  huge.cols = 4096;
  huge.row_stride = 4096;
  absl::Status s =
      (*capturer)->Capture(huge, Ids(2), "p", DType::kFloat32, got.Sink());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

TEST_F(CudaCaptureTest, RejectsViewsItCannotServe) {
  auto capturer = CudaCapturer::Create(0);
  ASSERT_TRUE(capturer.ok()) << capturer.status();
  std::vector<float> host(16);
  Collector got;
  TensorView cpu{host.data(), DType::kFloat32, 2, 8, 8, 1};
  EXPECT_EQ((*capturer)
                ->Capture(cpu, Ids(2), "p", DType::kFloat32, got.Sink())
                .code(),
            absl::StatusCode::kInvalidArgument);
  DeviceBuffer dev(64);
  TensorView other{dev.get(), DType::kFloat32, 2, 8, 8, 1, Device::kCuda, 3};
  absl::Status s =
      (*capturer)->Capture(other, Ids(2), "p", DType::kFloat32, got.Sink());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("cuda:3"));
}

// The overlap probe (docs/ARCHITECTURE.md, "Feature capture"): the
// capture is issued right after the
// "layer L" point, then the compute stream gets a long kernel-free workload
// standing in for the rest of prefill (memsets over a large buffer). The
// capture's host callback should fire while that workload still runs; the
// last op of the compute stream writes a flag into pinned host memory, and
// the sink reads it (no CUDA call) to tell whether compute had finished.
TEST_F(CudaCaptureTest, OverlapProbe) {
  const int64_t rows = 64, cols = 4096;  // a prefill batch of bf16 states
  const size_t hidden_bytes = rows * cols * 2;
  DeviceBuffer hidden(hidden_bytes);
  const size_t scratch_bytes = size_t{1} << 30;
  DeviceBuffer scratch(scratch_bytes);
  DeviceBuffer one(sizeof(int));
  ASSERT_NE(hidden.get(), nullptr);
  ASSERT_NE(scratch.get(), nullptr);
  ASSERT_NE(one.get(), nullptr);
  ASSERT_CUDA(cudaMemset(hidden.get(), 0x3F, hidden_bytes));
  const int kOne = 1;
  ASSERT_CUDA(
      cudaMemcpy(one.get(), &kOne, sizeof kOne, cudaMemcpyHostToDevice));
  int* done_flag = nullptr;
  ASSERT_CUDA(
      cudaHostAlloc(reinterpret_cast<void**>(&done_flag), sizeof(int), 0));
  *done_flag = 0;

  cudaEvent_t t0, t1, layer, final_ev;
  ASSERT_CUDA(cudaEventCreate(&t0));
  ASSERT_CUDA(cudaEventCreate(&t1));
  ASSERT_CUDA(cudaEventCreate(&layer));
  ASSERT_CUDA(cudaEventCreate(&final_ev));

  // Calibrate: how long one memset of the scratch buffer takes here, so the
  // stand-in for the rest of prefill lasts about 200 ms on any GPU.
  constexpr int kCalibration = 10;
  ASSERT_CUDA(cudaEventRecord(t0, compute_));
  for (int i = 0; i < kCalibration; ++i) {
    ASSERT_CUDA(cudaMemsetAsync(scratch.get(), i, scratch_bytes, compute_));
  }
  ASSERT_CUDA(cudaEventRecord(t1, compute_));
  ASSERT_CUDA(cudaEventSynchronize(t1));
  float calib_ms = 0;
  ASSERT_CUDA(cudaEventElapsedTime(&calib_ms, t0, t1));
  const double per_memset_ms = std::max(1e-3, calib_ms / double{kCalibration});
  const int memsets =
      static_cast<int>(std::clamp(200.0 / per_memset_ms, 10.0, 20000.0));

  // Declared before the capturer: its destructor drains the callbacks.
  absl::Notification fired;
  Clock::time_point callback_at;
  int flag_at_callback = -1;
  size_t rows_at_callback = 0;
  FeatureSink sink = [&](std::vector<CapturedFeatures> r) {
    callback_at = Clock::now();
    flag_at_callback = *static_cast<volatile int*>(done_flag);
    rows_at_callback = r.size();
    fired.Notify();
  };
  auto capturer = CudaCapturer::Create(0);
  ASSERT_TRUE(capturer.ok()) << capturer.status();

  TensorView view{
      hidden.get(), DType::kBFloat16, rows, cols, cols, 1, Device::kCuda, 0,
      compute_};
  ASSERT_CUDA(cudaEventRecord(layer, compute_));  // the "layer L" point
  const Clock::time_point issued = Clock::now();
  ASSERT_TRUE(
      (*capturer)->Capture(view, Ids(rows), "p", DType::kBFloat16, sink).ok());
  for (int i = 0; i < memsets; ++i) {  // the rest of prefill
    ASSERT_CUDA(cudaMemsetAsync(scratch.get(), i, scratch_bytes, compute_));
  }
  ASSERT_CUDA(cudaMemcpyAsync(done_flag, one.get(), sizeof(int),
                              cudaMemcpyDeviceToHost, compute_));
  ASSERT_CUDA(cudaEventRecord(final_ev, compute_));
  const Clock::time_point enqueued = Clock::now();
  ASSERT_CUDA(cudaEventSynchronize(final_ev));
  const Clock::time_point compute_done = Clock::now();
  ASSERT_TRUE((*capturer)->Flush().ok());
  ASSERT_TRUE(fired.WaitForNotificationWithTimeout(absl::Seconds(10)));

  float prefill_ms = 0;
  ASSERT_CUDA(cudaEventElapsedTime(&prefill_ms, layer, final_ev));
  auto ms = [](Clock::duration d) {
    return std::chrono::duration<double, std::milli>(d).count();
  };
  const double callback_ms = ms(callback_at - issued);
  const double compute_ms = ms(compute_done - issued);
  std::printf(
      "overlap probe: %d memsets of %zu MiB (%.3f ms each), rest of prefill "
      "%.1f ms on the GPU; enqueue took %.2f ms\n"
      "  capture callback fired %.3f ms after issue, compute finished %.1f ms "
      "after issue: overlap %.1f ms (%.1f%% of the rest of prefill); compute "
      "done flag at callback: %d\n",
      memsets, scratch_bytes >> 20, per_memset_ms, prefill_ms,
      ms(enqueued - issued), callback_ms, compute_ms, compute_ms - callback_ms,
      100.0 * (compute_ms - callback_ms) / std::max(1e-9, compute_ms),
      flag_at_callback);
  RecordProperty("callback_ms", std::to_string(callback_ms));
  RecordProperty("compute_ms", std::to_string(compute_ms));
  RecordProperty("prefill_gpu_ms", std::to_string(prefill_ms));

  EXPECT_EQ(rows_at_callback, static_cast<size_t>(rows));
  EXPECT_EQ(flag_at_callback, 0)
      << "the capture reached the sink only after the compute stream finished";
  EXPECT_LT(callback_at, compute_done);

  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  cudaEventDestroy(layer);
  cudaEventDestroy(final_ev);
  cudaFreeHost(done_flag);
}

}  // namespace
}  // namespace leap::shim

// CPU feature capture, checked element by element against the scalar
// conversions of common/half.h; the staging plan of the CUDA path, run
// against a host emulation of cudaMemcpy2D; the staging ring, against a
// byte-occupancy model. None of this needs a GPU.
#include "engine_shim/capture.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/half.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace leap::shim {
namespace {

using ::testing::HasSubstr;

std::vector<std::string> Ids(int64_t n) {
  std::vector<std::string> ids;
  for (int64_t i = 0; i < n; ++i) ids.push_back("req-" + std::to_string(i));
  return ids;
}

// Float values that exercise every conversion path: zeros, fp16 subnormals
// and underflow, fp16 overflow, ties, infinities, NaN, ordinary values.
std::vector<float> InterestingFloats(size_t n, uint32_t seed) {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -2.5f,
                          1e-8f,
                          -3e-6f,
                          6.1e-5f,
                          65504.0f,
                          65520.0f,
                          70000.f,
                          1.00390625f /* bf16 tie */,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(),
                          3.4e38f,
                          1e-40f /* float subnormal */};
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  while (v.size() < n) v.push_back(normal(rng));
  v.resize(n);
  return v;
}

// The reference: what element `x` (given as a float that is exact in the
// source dtype) must become in `out`, as little-endian bytes.
std::string Expected(float x, DType out) {
  std::string b;
  if (out == DType::kFloat32) {
    b.resize(4);
    std::memcpy(b.data(), &x, 4);
  } else {
    const uint16_t h =
        out == DType::kBFloat16 ? FloatToBf16(x) : FloatToFp16(x);
    b.resize(2);
    std::memcpy(b.data(), &h, 2);
  }
  return b;
}

// Float -> fp32 bytes, bits preserved (NaN payload included).
std::string Fp32Bytes(float x) {
  std::string b(4, '\0');
  std::memcpy(b.data(), &x, 4);
  return b;
}
std::string HalfBytes(uint16_t h) {
  std::string b(2, '\0');
  std::memcpy(b.data(), &h, 2);
  return b;
}

// Compares `got` against element (r, c) -> expected bytes, with a message
// naming the element.
template <typename Fn>
void ExpectRows(const std::vector<CapturedFeatures>& got, int64_t rows,
                int64_t cols, DType out, const std::string& product_line,
                Fn expected_bytes) {
  ASSERT_EQ(got.size(), static_cast<size_t>(rows));
  const size_t es = DTypeSize(out);
  for (int64_t r = 0; r < rows; ++r) {
    const CapturedFeatures& f = got[static_cast<size_t>(r)];
    EXPECT_EQ(f.request_id, "req-" + std::to_string(r));
    EXPECT_EQ(f.product_line, product_line);
    EXPECT_EQ(f.max_tokens, 0);
    ASSERT_EQ(f.bytes.size(), static_cast<size_t>(cols) * es);
    for (int64_t c = 0; c < cols; ++c) {
      const std::string want = expected_bytes(r, c);
      ASSERT_EQ(f.bytes.substr(static_cast<size_t>(c) * es, es), want)
          << "row " << r << " col " << c;
    }
  }
}

constexpr DType kAllDTypes[] = {DType::kFloat32, DType::kBFloat16,
                                DType::kFloat16};

TEST(CaptureCpuTest, Fp32ToEveryDType) {
  const int64_t rows = 4, cols = 40;
  std::vector<float> buf = InterestingFloats(rows * cols, 1);
  TensorView v{buf.data(), DType::kFloat32, rows, cols, cols, 1};
  const auto ids = Ids(rows);
  for (DType out : kAllDTypes) {
    SCOPED_TRACE(static_cast<int>(out));
    auto got = CaptureCpu(v, ids, "chat", out);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectRows(*got, rows, cols, out, "chat", [&](int64_t r, int64_t c) {
      const float x = buf[r * cols + c];
      return out == DType::kFloat32 ? Fp32Bytes(x) : Expected(x, out);
    });
  }
}

TEST(CaptureCpuTest, Bf16AndFp16ToEveryDType) {
  const int64_t rows = 3, cols = 33;
  const std::vector<float> src = InterestingFloats(rows * cols, 2);
  for (DType in : {DType::kBFloat16, DType::kFloat16}) {
    std::vector<uint16_t> buf;
    for (float x : src) {
      buf.push_back(in == DType::kBFloat16 ? FloatToBf16(x) : FloatToFp16(x));
    }
    auto exact = [&](uint16_t h) {
      return in == DType::kBFloat16 ? Bf16ToFloat(h) : Fp16ToFloat(h);
    };
    TensorView v{buf.data(), in, rows, cols, cols, 1};
    const auto ids = Ids(rows);
    for (DType out : kAllDTypes) {
      SCOPED_TRACE(::testing::Message() << "in " << static_cast<int>(in)
                                        << " out " << static_cast<int>(out));
      auto got = CaptureCpu(v, ids, "p", out);
      ASSERT_TRUE(got.ok()) << got.status();
      ExpectRows(*got, rows, cols, out, "p", [&](int64_t r, int64_t c) {
        const uint16_t h = buf[r * cols + c];
        // Same dtype: the bits as they are.
        return out == in ? HalfBytes(h) : Expected(exact(h), out);
      });
    }
  }
}

TEST(CaptureCpuTest, NanPassesThrough) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> buf = {1.0f, nan, -nan, 2.0f};
  TensorView v{buf.data(), DType::kFloat32, 1, 4, 4, 1};
  const auto ids = Ids(1);
  for (DType out : kAllDTypes) {
    auto got = CaptureCpu(v, ids, "", out);
    ASSERT_TRUE(got.ok()) << got.status();
    const std::string& b = (*got)[0].bytes;
    for (int c : {1, 2}) {
      float f;
      if (out == DType::kFloat32) {
        std::memcpy(&f, b.data() + 4 * c, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, b.data() + 2 * c, 2);
        f = out == DType::kBFloat16 ? Bf16ToFloat(h) : Fp16ToFloat(h);
      }
      EXPECT_TRUE(std::isnan(f)) << "out " << static_cast<int>(out);
    }
  }
}

TEST(CaptureCpuTest, EveryOtherRowOfALargerBuffer) {
  // A [8, 24] buffer; the view is rows 1, 3, 5, 7 and columns 4..19.
  const int64_t big_rows = 8, big_cols = 24, rows = 4, cols = 16;
  std::vector<float> big = InterestingFloats(big_rows * big_cols, 3);
  TensorView v{
      big.data() + big_cols + 4, DType::kFloat32, rows, cols, 2 * big_cols, 1};
  const auto ids = Ids(rows);
  for (DType out : kAllDTypes) {
    auto got = CaptureCpu(v, ids, "p", out);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectRows(*got, rows, cols, out, "p", [&](int64_t r, int64_t c) {
      const float x = big[(2 * r + 1) * big_cols + 4 + c];
      return out == DType::kFloat32 ? Fp32Bytes(x) : Expected(x, out);
    });
  }
}

TEST(CaptureCpuTest, TransposedView) {
  // Memory holds a [cols, rows] matrix M; the view is M^T: (r, c) = M[c][r],
  // so row_stride = 1 and col_stride = rows.
  const int64_t rows = 5, cols = 12;
  const std::vector<float> src = InterestingFloats(rows * cols, 4);
  std::vector<uint16_t> m;
  for (float x : src) m.push_back(FloatToBf16(x));
  TensorView v{m.data(), DType::kBFloat16, rows, cols, 1, rows};
  const auto ids = Ids(rows);
  for (DType out : kAllDTypes) {
    auto got = CaptureCpu(v, ids, "p", out);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectRows(*got, rows, cols, out, "p", [&](int64_t r, int64_t c) {
      const uint16_t h = m[c * rows + r];
      return out == DType::kBFloat16 ? HalfBytes(h)
                                     : Expected(Bf16ToFloat(h), out);
    });
  }
}

TEST(CaptureCpuTest, StridedInBothDimensionsAndUnaligned) {
  // fp16 at an odd byte address: every other column of every third row.
  const int64_t rows = 3, cols = 7;
  std::vector<char> raw(2 * 100 + 1);
  std::vector<uint16_t> vals(100);
  for (size_t i = 0; i < vals.size(); ++i) {
    vals[i] = FloatToFp16(0.25f * static_cast<float>(i) - 7.0f);
  }
  std::memcpy(raw.data() + 1, vals.data(), 2 * vals.size());
  TensorView v{raw.data() + 1, DType::kFloat16, rows, cols, 30, 2};
  auto got = CaptureCpu(v, Ids(rows), "p", DType::kFloat32);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectRows(*got, rows, cols, DType::kFloat32, "p", [&](int64_t r, int64_t c) {
    return Fp32Bytes(Fp16ToFloat(vals[r * 30 + c * 2]));
  });
}

TEST(CaptureCpuTest, EmptyBatch) {
  TensorView v{nullptr, DType::kFloat32, 0, 16, 16, 1};
  auto got = CaptureCpu(v, {}, "p", DType::kFloat32);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->empty());
}

TEST(ValidateViewTest, ClearErrors) {
  std::vector<float> buf(64);
  const TensorView good{buf.data(), DType::kFloat32, 2, 8, 8, 1};
  EXPECT_TRUE(ValidateView(good, 8, 2).ok());

  auto expect_error = [](const absl::Status& s, const std::string& text) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(text));
  };
  expect_error(ValidateView(good, 4096, 2), "expected 4096 columns, got 8");
  expect_error(ValidateView(good, 8, 3), "2 rows, got 3 request ids");

  TensorView v = good;
  v.data = nullptr;
  expect_error(ValidateView(v, 8, 2), "data is null");
  v = good;
  v.row_stride = 0;
  expect_error(ValidateView(v, 8, 2),
               "strides must be positive, got row_stride 0 and col_stride 1");
  v = good;
  v.col_stride = -1;
  expect_error(ValidateView(v, 8, 2), "col_stride -1");
  v = good;
  v.dtype = static_cast<DType>(9);
  expect_error(ValidateView(v, 8, 2), "unknown dtype 9");
  v = good;
  v.device = static_cast<Device>(7);
  expect_error(ValidateView(v, 8, 2), "unknown device 7");
  v = good;
  v.device_index = -1;
  expect_error(ValidateView(v, 8, 2), "device index must be >= 0, got -1");
  v = good;
  v.rows = -1;
  expect_error(ValidateView(v, 8, 2), "negative shape [-1, 8]");
  v = good;
  v.row_stride = int64_t{1} << 62;
  expect_error(ValidateView(v, 8, 2), "overflow");
}

TEST(CaptureCpuTest, RejectsCudaViewsAndBadInput) {
  std::vector<float> buf(16);
  TensorView v{buf.data(), DType::kFloat32, 2, 8, 8, 1};
  v.device = Device::kCuda;
  auto got = CaptureCpu(v, Ids(2), "p", DType::kFloat32);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("CudaCapturer"));

  v.device = Device::kCpu;
  got = CaptureCpu(v, Ids(2), "p", static_cast<DType>(0));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(got.status().message()),
              HasSubstr("unknown output dtype 0"));

  got = CaptureCpu(v, Ids(1), "p", DType::kFloat32);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(got.status().message()),
              HasSubstr("2 rows, got 1 request ids"));
}

TEST(CudaCapturerTest, CreateWithoutTheCudaPathOrADevice) {
#ifdef LEAP_HAVE_CUDA
  if (CudaCaptureAvailable()) {
    // A GPU machine: the error path that needs no device state.
    auto c = CudaCapturer::Create(-1);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument)
        << c.status();
    EXPECT_THAT(std::string(c.status().message()), HasSubstr("out of range"));
  } else {
    auto c = CudaCapturer::Create(0);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition)
        << c.status();
    EXPECT_THAT(std::string(c.status().message()), HasSubstr("no CUDA device"));
  }
#else
  EXPECT_FALSE(CudaCaptureAvailable());
  auto c = CudaCapturer::Create(0);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnimplemented) << c.status();
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("CUDA capture is not built in"));
#endif
}

// ---- The staging plan of the CUDA path --------------------------------------

struct PlanCase {
  const char* name;
  int64_t rows, cols, row_stride, col_stride;
  size_t copies;  // expected number of copies
  int64_t staged_row_stride, staged_col_stride;
};

// Executes the plan as cudaMemcpy2D would, from `src` (the view's first
// element) into `slot`, checking every access stays inside the view's span
// and the slot.
void EmulateCopies(const internal::StagingPlan& plan, const char* src,
                   int64_t src_span, char* slot) {
  for (const internal::Copy2D& c : plan.copies) {
    ASSERT_GE(c.spitch, c.width);
    ASSERT_GE(c.dpitch, c.width);
    ASSERT_GE(c.height, 1);
    for (int64_t h = 0; h < c.height; ++h) {
      const int64_t s = c.src_offset + h * c.spitch;
      const int64_t d = c.dst_offset + h * c.dpitch;
      ASSERT_GE(s, 0);
      ASSERT_LE(s + c.width, src_span) << "reads past the view's last element";
      ASSERT_GE(d, 0);
      ASSERT_LE(d + c.width, plan.bytes) << "writes past the slot";
      std::memcpy(slot + d, src + s, static_cast<size_t>(c.width));
    }
  }
}

TEST(PlanStagingTest, StagedRowsMatchTheView) {
  const PlanCase cases[] = {
      // name, rows, cols, rs, cs, copies, staged rs, staged cs
      {"contiguous", 4, 16, 16, 1, 1, 16, 1},
      {"every other row", 4, 16, 40, 1, 1, 16, 1},
      {"single row", 1, 16, 999, 1, 1, 16, 1},
      {"single column", 6, 1, 9, 5, 1, 1, 1},
      {"transposed", 5, 12, 1, 5, 1, 1, 5},
      {"transposed, padded", 5, 12, 1, 8, 1, 1, 5},
      {"overlapping rows", 4, 16, 3, 1, 1, 3, 1},
      {"every other column", 4, 16, 32, 2, 1, 32, 2},
      {"sparse, wide", 3, 10, 400, 7, 3, 10, 1},
      {"sparse, tall", 10, 3, 7, 400, 3, 1, 10},
  };
  for (DType dtype : kAllDTypes) {
    const int64_t es = static_cast<int64_t>(DTypeSize(dtype));
    for (const PlanCase& pc : cases) {
      SCOPED_TRACE(::testing::Message()
                   << pc.name << " dtype " << static_cast<int>(dtype));
      const int64_t span_elems =
          (pc.rows - 1) * pc.row_stride + (pc.cols - 1) * pc.col_stride + 1;
      std::vector<char> device_mem(static_cast<size_t>(span_elems * es));
      std::mt19937 rng(7);
      for (char& b : device_mem) b = static_cast<char>(rng() & 0x3F);
      const TensorView view{device_mem.data(), dtype,         pc.rows,
                            pc.cols,           pc.row_stride, pc.col_stride,
                            Device::kCuda};
      ASSERT_TRUE(ValidateView(view, pc.cols, pc.rows).ok());
      const internal::StagingPlan plan = internal::PlanStaging(view);
      EXPECT_EQ(plan.copies.size(), pc.copies);
      EXPECT_EQ(plan.row_stride, pc.staged_row_stride);
      EXPECT_EQ(plan.col_stride, pc.staged_col_stride);

      std::vector<char> slot(static_cast<size_t>(plan.bytes));
      EmulateCopies(plan, device_mem.data(),
                    static_cast<int64_t>(device_mem.size()), slot.data());
      TensorView staged{slot.data(), dtype,           pc.rows,
                        pc.cols,     plan.row_stride, plan.col_stride};
      TensorView direct = view;
      direct.device = Device::kCpu;
      auto want = CaptureCpu(direct, Ids(pc.rows), "p", DType::kFloat32);
      auto got = CaptureCpu(staged, Ids(pc.rows), "p", DType::kFloat32);
      ASSERT_TRUE(want.ok()) << want.status();
      ASSERT_TRUE(got.ok()) << got.status();
      for (int64_t r = 0; r < pc.rows; ++r) {
        EXPECT_EQ((*got)[r].bytes, (*want)[r].bytes) << "row " << r;
      }
      // Packed layouts stage exactly the view's bytes.
      if (pc.staged_row_stride * pc.staged_col_stride == pc.cols ||
          pc.staged_row_stride * pc.staged_col_stride == pc.rows) {
        EXPECT_EQ(plan.bytes, pc.rows * pc.cols * es);
      }
    }
  }
}

// ---- The staging ring -------------------------------------------------------

TEST(StagingRingTest, WrapsAndRefusesWhenFull) {
  internal::StagingRing ring(1024, 256);
  EXPECT_EQ(ring.Allocate(100), 0u);            // [0, 256)
  EXPECT_EQ(ring.Allocate(300), 256u);          // [256, 768)
  EXPECT_EQ(ring.Allocate(512), std::nullopt);  // 256 left at the end
  EXPECT_EQ(ring.Allocate(256), 768u);          // [768, 1024): full
  EXPECT_EQ(ring.used(), 1024u);
  EXPECT_EQ(ring.Allocate(1), std::nullopt);
  ring.ReleaseOldest();               // frees [0, 256)
  EXPECT_EQ(ring.Allocate(256), 0u);  // wraps
  EXPECT_EQ(ring.Allocate(1), std::nullopt);
  ring.ReleaseOldest();  // frees [256, 768)
  EXPECT_EQ(ring.Allocate(512), 256u);
  ring.ReleaseNewest();                         // takes [256, 768) back
  EXPECT_EQ(ring.Allocate(600), std::nullopt);  // 512 free
  EXPECT_EQ(ring.Allocate(512), 256u);
  EXPECT_EQ(ring.live(), 3u);
  EXPECT_EQ(ring.Allocate(2048), std::nullopt);  // larger than the ring
}

TEST(StagingRingTest, SkippedTailIsHeldUntilTheWrappedRangeIsFreed) {
  internal::StagingRing ring(1000, 8);
  EXPECT_EQ(ring.Allocate(400), 0u);
  EXPECT_EQ(ring.Allocate(400), 400u);  // 200 left at the end
  ring.ReleaseOldest();                 // [0, 400) free
  EXPECT_EQ(ring.Allocate(304), 0u);    // does not fit the tail: wraps
  EXPECT_EQ(ring.used(), 400u + 200u + 304u);
  ring.ReleaseNewest();  // undoing the wrap gives the tail back
  EXPECT_EQ(ring.used(), 400u);
  EXPECT_EQ(ring.Allocate(200), 800u);
}

// Random allocations and releases against a model that marks held bytes:
// no two live ranges overlap, all lie inside the ring, and an empty ring
// always fits a request of its whole capacity.
TEST(StagingRingTest, RandomAgainstOccupancyModel) {
  constexpr size_t kCap = 4096, kAlign = 64;
  internal::StagingRing ring(kCap, kAlign);
  std::vector<int> owner(kCap, -1);
  std::deque<std::pair<size_t, size_t>> live;  // offset, aligned size
  std::mt19937 rng(11);
  int next_id = 0, refused = 0;
  for (int step = 0; step < 20000; ++step) {
    const unsigned op = rng() % 10;
    if (op < 6) {
      const size_t n = 1 + rng() % 1500;
      std::optional<size_t> off = ring.Allocate(n);
      if (!off.has_value()) {
        ++refused;
        continue;
      }
      const size_t size = (n + kAlign - 1) / kAlign * kAlign;
      ASSERT_EQ(*off % kAlign, 0u);
      ASSERT_LE(*off + size, kCap);
      for (size_t b = *off; b < *off + size; ++b) {
        ASSERT_EQ(owner[b], -1) << "byte " << b << " handed out twice";
        owner[b] = next_id;
      }
      ++next_id;
      live.emplace_back(*off, size);
    } else if (!live.empty()) {
      const bool newest = op == 9;
      const auto [off, size] = newest ? live.back() : live.front();
      if (newest) {
        ring.ReleaseNewest();
        live.pop_back();
      } else {
        ring.ReleaseOldest();
        live.pop_front();
      }
      for (size_t b = off; b < off + size; ++b) owner[b] = -1;
    }
    ASSERT_EQ(ring.live(), live.size());
    if (live.empty()) {
      ASSERT_EQ(ring.used(), 0u);
    }
  }
  EXPECT_GT(refused, 0);  // the ring did fill up
  while (!live.empty()) {
    ring.ReleaseOldest();
    live.pop_front();
  }
  EXPECT_EQ(ring.Allocate(kCap), 0u);
}

}  // namespace
}  // namespace leap::shim

// ViewOf over CPU tensors built on buffers the test owns (at::from_blob), so
// every expected element comes from the buffer by index arithmetic, not from
// torch; conversions are checked against common/half.h.
#include "engine_shim/torch_adapter.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/half.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace leap::shim {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kRows = 6, kCols = 10;

std::vector<std::string> Ids(int64_t n) {
  std::vector<std::string> ids;
  for (int64_t i = 0; i < n; ++i) ids.push_back("req-" + std::to_string(i));
  return ids;
}

std::vector<float> Values(int64_t n) {
  std::vector<float> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(0.5f * i - 3.25f);
  return v;
}

float Fp32At(const std::string& bytes, int64_t c) {
  float f;
  std::memcpy(&f, bytes.data() + 4 * c, 4);
  return f;
}
uint16_t HalfAt(const std::string& bytes, int64_t c) {
  uint16_t h;
  std::memcpy(&h, bytes.data() + 2 * c, 2);
  return h;
}

void ExpectError(const absl::Status& s, const std::string& text) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(text));
}

// Captures `t` to fp32 and checks element (r, c) == want(r, c).
template <typename Fn>
void ExpectCapturedFp32(const at::Tensor& t, Fn want) {
  auto view = ViewOf(t);
  ASSERT_TRUE(view.ok()) << view.status();
  auto rows = CaptureCpu(*view, Ids(view->rows), "p", DType::kFloat32);
  ASSERT_TRUE(rows.ok()) << rows.status();
  for (int64_t r = 0; r < view->rows; ++r) {
    for (int64_t c = 0; c < view->cols; ++c) {
      ASSERT_EQ(Fp32At((*rows)[r].bytes, c), want(r, c))
          << "row " << r << " col " << c;
    }
  }
}

TEST(ViewOfTest, Contiguous) {
  std::vector<float> buf = Values(kRows * kCols);
  at::Tensor t = at::from_blob(buf.data(), {kRows, kCols}, at::kFloat);
  auto v = ViewOf(t);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->data, buf.data());
  EXPECT_EQ(v->dtype, DType::kFloat32);
  EXPECT_EQ(v->rows, kRows);
  EXPECT_EQ(v->cols, kCols);
  EXPECT_EQ(v->row_stride, kCols);
  EXPECT_EQ(v->col_stride, 1);
  EXPECT_EQ(v->device, Device::kCpu);
  ExpectCapturedFp32(t,
                     [&](int64_t r, int64_t c) { return buf[r * kCols + c]; });
}

TEST(ViewOfTest, SlicedColumnsAndRows) {
  std::vector<float> buf = Values(kRows * kCols);
  at::Tensor t = at::from_blob(buf.data(), {kRows, kCols}, at::kFloat);
  at::Tensor every_other_col = t.slice(1, 0, kCols, 2);  // t[:, ::2]
  auto v = ViewOf(every_other_col);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->cols, kCols / 2);
  EXPECT_EQ(v->col_stride, 2);
  ExpectCapturedFp32(every_other_col, [&](int64_t r, int64_t c) {
    return buf[r * kCols + 2 * c];
  });

  at::Tensor odd_rows = t.slice(0, 1, kRows, 2).slice(1, 3, 8);  // t[1::2, 3:8]
  v = ViewOf(odd_rows);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->data, buf.data() + kCols + 3);  // storage offset applied
  EXPECT_EQ(v->row_stride, 2 * kCols);
  ExpectCapturedFp32(odd_rows, [&](int64_t r, int64_t c) {
    return buf[(2 * r + 1) * kCols + 3 + c];
  });
}

TEST(ViewOfTest, Transposed) {
  std::vector<float> buf = Values(kRows * kCols);
  at::Tensor t = at::from_blob(buf.data(), {kRows, kCols}, at::kFloat).t();
  auto v = ViewOf(t);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->rows, kCols);
  EXPECT_EQ(v->cols, kRows);
  EXPECT_EQ(v->row_stride, 1);
  EXPECT_EQ(v->col_stride, kCols);
  ExpectCapturedFp32(t,
                     [&](int64_t r, int64_t c) { return buf[c * kCols + r]; });
}

TEST(ViewOfTest, Bf16AndFp16) {
  const std::vector<float> vals = Values(kRows * kCols);
  for (auto [torch_type, dtype] : {std::pair{at::kBFloat16, DType::kBFloat16},
                                   std::pair{at::kHalf, DType::kFloat16}}) {
    std::vector<uint16_t> bits;
    for (float x : vals) {
      bits.push_back(dtype == DType::kBFloat16 ? FloatToBf16(x)
                                               : FloatToFp16(x));
    }
    at::Tensor t = at::from_blob(bits.data(), {kRows, kCols}, torch_type)
                       .slice(1, 1, kCols, 3);
    auto v = ViewOf(t);
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(v->dtype, dtype);
    // Same dtype out: the bits as stored.
    auto same = CaptureCpu(*v, Ids(kRows), "p", dtype);
    ASSERT_TRUE(same.ok()) << same.status();
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t c = 0; c < v->cols; ++c) {
        EXPECT_EQ(HalfAt((*same)[r].bytes, c), bits[r * kCols + 1 + 3 * c]);
      }
    }
    ExpectCapturedFp32(t, [&](int64_t r, int64_t c) {
      const uint16_t h = bits[r * kCols + 1 + 3 * c];
      return dtype == DType::kBFloat16 ? Bf16ToFloat(h) : Fp16ToFloat(h);
    });
  }
}

TEST(ViewOfTest, SizeOneAndEmptyDimensions) {
  std::vector<float> buf = Values(kCols);
  // [1, d] broadcast from [d]: the row stride is 0 but never used.
  at::Tensor one_row = at::from_blob(buf.data(), {kCols}, at::kFloat)
                           .unsqueeze(0)
                           .expand({1, kCols});
  auto v = ViewOf(one_row);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_TRUE(ValidateView(*v, kCols, 1).ok());
  ExpectCapturedFp32(one_row, [&](int64_t, int64_t c) { return buf[c]; });

  at::Tensor empty = at::empty({0, kCols}, at::kFloat);
  v = ViewOf(empty);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->rows, 0);
  EXPECT_TRUE(ValidateView(*v, kCols, 0).ok());
}

TEST(ViewOfTest, ClearErrors) {
  std::vector<float> buf = Values(2 * 3 * 4);
  ExpectError(ViewOf(at::Tensor()).status(), "undefined");
  ExpectError(ViewOf(at::from_blob(buf.data(), {24}, at::kFloat)).status(),
              "expected a 2-D [batch, d] tensor, got 1-D [24]");
  ExpectError(ViewOf(at::from_blob(buf.data(), {2, 3, 4}, at::kFloat)).status(),
              "expected a 2-D [batch, d] tensor, got 3-D [2, 3, 4]");
  ExpectError(ViewOf(at::zeros({2, 2}, at::kDouble)).status(),
              "expected a float32, bfloat16 or float16 tensor, got Double");
  ExpectError(ViewOf(at::zeros({2, 2}, at::kInt)).status(), "got Int");
  ExpectError(
      ViewOf(at::empty({2, 2}, at::TensorOptions().device(at::kMeta))).status(),
      "expected a CPU or CUDA tensor, got one on meta");
  // A broadcast batch: every row is the same memory.
  at::Tensor broadcast =
      at::from_blob(buf.data(), {1, 4}, at::kFloat).expand({3, 4});
  ExpectError(ViewOf(broadcast).status(), "call .contiguous() first");
}

TEST(CaptureIntoTest, ValidatesAgainstTheClientAndSubmits) {
  ClientOptions options;
  // Nothing listens there: submissions stay queued in the client.
  options.endpoint = "unix:///nonexistent-leap-test-dir/leapd.sock";
  options.dim = kCols / 2;
  options.dtype = DType::kBFloat16;
  options.connect_timeout = absl::Milliseconds(50);
  auto client = Client::Start(options);
  ASSERT_TRUE(client.ok()) << client.status();

  std::vector<float> buf = Values(kRows * kCols);
  at::Tensor t = at::from_blob(buf.data(), {kRows, kCols}, at::kFloat);
  const auto ids = Ids(kRows);
  absl::Status s =
      CaptureInto(**client, options.dim, options.dtype, t, ids, "p");
  ExpectError(s, "expected 5 columns, got 10");
  s = CaptureInto(**client, options.dim, options.dtype, t.slice(1, 0, kCols, 2),
                  std::span(ids).first(2), "p");
  ExpectError(s, "6 rows, got 2 request ids");
  EXPECT_EQ((*client)->stats().live, 0);

  s = CaptureInto(**client, options.dim, options.dtype, t.slice(1, 0, kCols, 2),
                  ids, "p");
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ((*client)->stats().live, kRows);
  EXPECT_EQ((*client)->stats().errors, 0);  // sizes matched the client's
}

}  // namespace
}  // namespace leap::shim

#include "common/npy.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/scoped_temp_dir.h"

namespace leap {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// A fresh directory per test, removed with everything in it afterwards.
class NpyTest : public ::testing::Test {
 public:
  NpyTest() : tmp_("npy_test"), dir_(tmp_.path()) {}

  std::string Path(const std::string& name) const {
    return absl::StrCat(dir_, "/", name);
  }

  // Writes `bytes` verbatim.
  std::string WriteRaw(const std::string& name, const std::string& bytes) {
    const std::string path = Path(name);
    std::ofstream out(path, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    EXPECT_TRUE(out.good());
    return path;
  }

  static std::string ReadRaw(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  // The folder's entries but the temp folder's own owner file.
  std::vector<std::string> ListDir() const {
    std::vector<std::string> names;
    DIR* d = ::opendir(dir_.c_str());
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != ".." &&
          name != leap::testing::ScopedTempDir::kOwnerFile) {
        names.push_back(name);
      }
    }
    ::closedir(d);
    return names;
  }

  leap::testing::ScopedTempDir tmp_;
  const std::string dir_;
};

// Builds a .npy file by hand: magic, version, little-endian header length
// (2 bytes for 1.x, 4 for 2.x/3.x), `dict` padded with spaces and a newline
// to a multiple of `align`, then `data`.
std::string HandMadeNpy(int major, int minor, const std::string& dict,
                        const std::string& data, size_t align = 64) {
  const size_t len_size = major == 1 ? 2 : 4;
  std::string header = dict;
  while ((6 + 2 + len_size + header.size() + 1) % align != 0) header += ' ';
  header += '\n';
  std::string out = "\x93NUMPY";
  out += static_cast<char>(major);
  out += static_cast<char>(minor);
  for (size_t i = 0; i < len_size; ++i) {
    out += static_cast<char>((header.size() >> (8 * i)) & 0xFF);
  }
  return out + header + data;
}

template <class T>
std::string Bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()),
                     v.size() * sizeof(T));
}

void ExpectInvalid(const absl::StatusOr<NpyArray>& r, const std::string& path,
                   const std::string& text) {
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
      << r.status();
  EXPECT_THAT(std::string(r.status().message()), StartsWith(path + ": "));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(text));
}

TEST(NpyDTypeTest, NamesAndSizes) {
  EXPECT_EQ(NpyDTypeName(NpyDType::kFloat16), "float16");
  EXPECT_EQ(NpyDTypeName(NpyDType::kFloat32), "float32");
  EXPECT_EQ(NpyDTypeName(NpyDType::kFloat64), "float64");
  EXPECT_EQ(NpyDTypeName(NpyDType::kInt32), "int32");
  EXPECT_EQ(NpyDTypeName(NpyDType::kInt64), "int64");
  EXPECT_EQ(NpyDTypeSize(NpyDType::kFloat16), 2u);
  EXPECT_EQ(NpyDTypeSize(NpyDType::kFloat32), 4u);
  EXPECT_EQ(NpyDTypeSize(NpyDType::kFloat64), 8u);
  EXPECT_EQ(NpyDTypeSize(NpyDType::kInt32), 4u);
  EXPECT_EQ(NpyDTypeSize(NpyDType::kInt64), 8u);
}

template <class T>
std::vector<T> Values(int64_t n) {
  std::vector<T> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, uint16_t>) {
      v[i] = FloatToFp16(0.25f * static_cast<float>(i) - 3.0f);
    } else {
      v[i] = static_cast<T>(i * 7 - 11) / static_cast<T>(2);
    }
  }
  return v;
}

template <class T>
void RoundTrip(NpyTest& t, NpyDType dtype, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const std::vector<T> values = Values<T>(n);
  const std::string path = t.Path(absl::StrCat(std::string(NpyDTypeName(dtype)),
                                               "_", shape.size(), "d.npy"));
  ASSERT_TRUE(WriteNpy(path, dtype, shape, values.data()).ok());
  absl::StatusOr<NpyArray> r = ReadNpy(path);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->dtype, dtype);
  EXPECT_EQ(r->shape, shape);
  EXPECT_EQ(r->num_elements(), n);
  ASSERT_EQ(r->data.size(), static_cast<size_t>(n) * sizeof(T));
  EXPECT_EQ(std::vector<T>(r->as<T>(), r->as<T>() + n), values);
  // The data starts on a 64-byte boundary, as numpy writes it.
  EXPECT_EQ((NpyTest::ReadRaw(path).size() - r->data.size()) % 64, 0u);
}

TEST_F(NpyTest, RoundTripEveryDTypeAndShape) {
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{
           {7}, {3, 5}, {0}, {4, 0}, {}, {2, 3, 4}}) {
    SCOPED_TRACE(::testing::PrintToString(shape));
    RoundTrip<uint16_t>(*this, NpyDType::kFloat16, shape);
    RoundTrip<float>(*this, NpyDType::kFloat32, shape);
    RoundTrip<double>(*this, NpyDType::kFloat64, shape);
    RoundTrip<int32_t>(*this, NpyDType::kInt32, shape);
    RoundTrip<int64_t>(*this, NpyDType::kInt64, shape);
  }
}

TEST_F(NpyTest, WritesNumpyLayout) {
  const std::vector<int64_t> v = {1, 2, 3};
  const std::vector<int64_t> shape = {3};
  const std::string path = Path("layout.npy");
  ASSERT_TRUE(WriteNpy(path, NpyDType::kInt64, shape, v.data()).ok());
  // What np.save(path, np.array([1, 2, 3], dtype='<i8')) writes.
  std::string dict =
      "{'descr': '<i8', 'fortran_order': False, 'shape': (3,), }";
  std::string expected = std::string("\x93NUMPY\x01\x00\x76\x00", 10) + dict +
                         std::string(128 - 10 - dict.size() - 1, ' ') + "\n" +
                         Bytes(v);
  EXPECT_EQ(ReadRaw(path), expected);
}

TEST_F(NpyTest, OverwritesAtomicallyAndLeavesNoTemporaryFile) {
  const std::string path = Path("a.npy");
  const std::vector<float> one = {1.0f}, two = {2.0f, 3.0f};
  const std::vector<int64_t> s1 = {1}, s2 = {2};
  ASSERT_TRUE(WriteNpy(path, NpyDType::kFloat32, s1, one.data()).ok());
  ASSERT_TRUE(WriteNpy(path, NpyDType::kFloat32, s2, two.data()).ok());
  absl::StatusOr<NpyArray> r = ReadNpy(path);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->shape, ElementsAre(2));
  EXPECT_EQ(r->as<float>()[1], 3.0f);
  EXPECT_THAT(ListDir(), ElementsAre("a.npy"));
}

TEST_F(NpyTest, LargeHeaderIsWrittenAsVersion2) {
  // 30000 dimensions of 1 need a header longer than 65535 bytes.
  const std::vector<int64_t> shape(30000, 1);
  const double x = 2.5;
  const std::string path = Path("big_header.npy");
  ASSERT_TRUE(WriteNpy(path, NpyDType::kFloat64, shape, &x).ok());
  const std::string raw = ReadRaw(path);
  ASSERT_GE(raw.size(), 8u);
  EXPECT_EQ(raw[6], 2);
  EXPECT_EQ(raw[7], 0);
  absl::StatusOr<NpyArray> r = ReadNpy(path);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->shape, shape);
  EXPECT_EQ(r->as<double>()[0], 2.5);
}

TEST_F(NpyTest, ReadsHandMadeVersion2File) {
  const std::vector<double> v = {1.5, -2.0, 3.25, 0.0, 1e300, -7.0};
  const std::string path = WriteRaw(
      "v2.npy",
      HandMadeNpy(2, 0,
                  "{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), }",
                  Bytes(v)));
  absl::StatusOr<NpyArray> r = ReadNpy(path);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->dtype, NpyDType::kFloat64);
  EXPECT_THAT(r->shape, ElementsAre(2, 3));
  EXPECT_EQ(std::vector<double>(r->as<double>(), r->as<double>() + 6), v);
}

TEST_F(NpyTest, ReadsHandMadeVersion3File) {
  const std::vector<int32_t> v = {-1, 2, 2147483647};
  const std::string path = WriteRaw(
      "v3.npy",
      HandMadeNpy(3, 0,
                  "{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }",
                  Bytes(v)));
  absl::StatusOr<NpyArray> r = ReadNpy(path);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->dtype, NpyDType::kInt32);
  EXPECT_THAT(std::vector<int32_t>(r->as<int32_t>(), r->as<int32_t>() + 3),
              ElementsAreArray(v));
}

// Header spellings other writers (old numpy, Python 2, hand-written files)
// produce, all equivalent to a (2, 2) little-endian array.
TEST_F(NpyTest, AcceptsHeaderVariants) {
  const std::vector<float> f = {1, 2, 3, 4};
  const std::vector<int32_t> i = {1, 2, 3, 4};
  struct Case {
    std::string dict;
    NpyDType dtype;
    size_t align;
  };
  const std::vector<Case> cases = {
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }",
       NpyDType::kFloat32, 16},
      {"{\"shape\": (2,2), \"descr\": \"<f4\", \"fortran_order\": False}",
       NpyDType::kFloat32, 64},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2L, 2L), }",
       NpyDType::kFloat32, 64},
      {"{ 'descr' : '=f4' ,\n 'fortran_order' : False , 'shape' : ( 2 , 2 ) }",
       NpyDType::kFloat32, 64},
      {"{'descr': '|i4', 'fortran_order': False, 'shape': (2, 2), }",
       NpyDType::kInt32, 64},
      {"{'descr': 'i4', 'fortran_order': False, 'shape': (2, 2), }",
       NpyDType::kInt32, 64},
  };
  int k = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.dict);
    const std::string data =
        c.dtype == NpyDType::kFloat32 ? Bytes(f) : Bytes(i);
    const std::string path = WriteRaw(absl::StrCat("variant", k++, ".npy"),
                                      HandMadeNpy(1, 0, c.dict, data, c.align));
    absl::StatusOr<NpyArray> r = ReadNpy(path);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->dtype, c.dtype);
    EXPECT_THAT(r->shape, ElementsAre(2, 2));
    EXPECT_EQ(r->data, std::vector<uint8_t>(data.begin(), data.end()));
  }
}

TEST_F(NpyTest, MissingFileIsNotFound) {
  const std::string path = Path("nope.npy");
  absl::StatusOr<NpyArray> r = ReadNpy(path);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(r.status().message()), StartsWith(path + ": "));
}

TEST_F(NpyTest, DirectoryIsNotARegularFile) {
  ExpectInvalid(ReadNpy(dir_), dir_, "not a regular file");
}

TEST_F(NpyTest, BadMagic) {
  std::string path = WriteRaw("text.npy", "hello world, not numpy");
  ExpectInvalid(ReadNpy(path), path,
                "bad magic, not a .npy file (expected the first 6 bytes to be "
                "\"\\x93NUMPY\", got \"hello \")");
  path = WriteRaw("empty.npy", "");
  ExpectInvalid(ReadNpy(path), path, "bad magic");
}

TEST_F(NpyTest, UnsupportedVersion) {
  const std::string dict =
      "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }";
  const std::string data(4, '\0');
  std::string path = WriteRaw("v4.npy", HandMadeNpy(4, 0, dict, data));
  ExpectInvalid(ReadNpy(path), path,
                "unsupported .npy format version 4.0 (supported: 1.0, 2.0, "
                "3.0)");
  path = WriteRaw("v1_1.npy", HandMadeNpy(1, 1, dict, data));
  ExpectInvalid(ReadNpy(path), path, "unsupported .npy format version 1.1");
}

TEST_F(NpyTest, TruncatedPreambleAndHeader) {
  std::string path = WriteRaw("pre.npy", std::string("\x93NUMPY\x01", 7));
  ExpectInvalid(ReadNpy(path), path,
                "truncated .npy preamble: file has only 7 bytes");
  const std::string full = HandMadeNpy(
      1, 0, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", "");
  path = WriteRaw("hdr.npy", full.substr(0, 40));
  ExpectInvalid(ReadNpy(path), path,
                "truncated .npy header: the preamble declares a 118-byte "
                "header but the file has only 40 bytes");
}

TEST_F(NpyTest, UnparseableHeaders) {
  struct Case {
    std::string dict;
    std::string error;
  };
  const std::vector<Case> cases = {
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1, }",
       "unparseable .npy header: unexpected character '}' at offset 54"},
      {"{'descr': '<f4', 'fortran_order': False 'shape': (1,)}",
       "unparseable .npy header: expected ',' or '}'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1,)} x",
       "unparseable .npy header: unexpected trailing characters"},
      {"{'descr': '<f4", "unparseable .npy header: unterminated string"},
      {"[1, 2]", "unparseable .npy header: header is not a dict literal"},
      {"{'descr': '<f4', 'shape': (1,)}",
       "unparseable .npy header: missing key 'fortran_order'"},
      {"{'descr': '<f4', 'fortran_order': False}",
       "unparseable .npy header: missing key 'shape'"},
      {"{'fortran_order': False, 'shape': (1,)}",
       "unparseable .npy header: missing key 'descr'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'x': 1}",
       "unparseable .npy header: unexpected key 'x'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'shape': (1,)}",
       "unparseable .npy header: duplicate key 'shape'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1)}",
       "unparseable .npy header: 'shape' is 1, not a tuple of ints"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, -1)}",
       "unparseable .npy header: 'shape' is (2, -1), not a tuple of "
       "non-negative ints"},
      {"{'descr': '<f4', 'fortran_order': 0, 'shape': (1,)}",
       "unparseable .npy header: 'fortran_order' is 0, not True or False"},
      {"{'descr': '<f4', 'fortran_order': False, "
       "'shape': (99999999999999999999,)}",
       "unparseable .npy header: integer too large"},
  };
  int k = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.dict);
    const std::string path =
        WriteRaw(absl::StrCat("bad", k++, ".npy"),
                 HandMadeNpy(1, 0, c.dict, std::string(4, '\0')));
    ExpectInvalid(ReadNpy(path), path, c.error);
  }
}

TEST_F(NpyTest, UnsupportedDType) {
  const std::string supported =
      "supported dtypes: '<f2' (float16), '<f4' (float32), '<f8' (float64), "
      "'<i4' (int32), '<i8' (int64)";
  std::string path = WriteRaw(
      "u2.npy",
      HandMadeNpy(1, 0,
                  "{'descr': '<u2', 'fortran_order': False, 'shape': (2,), }",
                  std::string(4, '\0')));
  ExpectInvalid(ReadNpy(path), path, "unsupported dtype '<u2'; " + supported);
  path = WriteRaw(
      "rec.npy",
      HandMadeNpy(1, 0,
                  "{'descr': [('a', '<f4'), ('b', '<i4')], 'fortran_order': "
                  "False, 'shape': (1,), }",
                  std::string(8, '\0')));
  ExpectInvalid(ReadNpy(path), path,
                "unsupported dtype [('a', '<f4'), ('b', '<i4')] (structured "
                "dtypes are not supported); " +
                    supported);
}

TEST_F(NpyTest, BigEndianUnsupported) {
  const std::string path = WriteRaw(
      "be.npy",
      HandMadeNpy(1, 0,
                  "{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }",
                  std::string(8, '\0')));
  ExpectInvalid(ReadNpy(path), path,
                "big-endian dtype '>f4' is unsupported; only little-endian "
                "data can be read");
}

TEST_F(NpyTest, FortranOrderUnsupported) {
  const std::string path = WriteRaw(
      "f.npy",
      HandMadeNpy(1, 0,
                  "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }",
                  std::string(16, '\0')));
  ExpectInvalid(ReadNpy(path), path,
                "fortran_order True is unsupported; only C-order arrays can "
                "be read");
}

TEST_F(NpyTest, DataSizeMismatch) {
  const std::string dict =
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  std::string path =
      WriteRaw("short.npy", HandMadeNpy(1, 0, dict, std::string(20, '\0')));
  ExpectInvalid(ReadNpy(path), path,
                "data size mismatch: expected 24 bytes of data for shape "
                "(2, 3), file has 20");
  path = WriteRaw("long.npy", HandMadeNpy(1, 0, dict, std::string(28, '\0')));
  ExpectInvalid(ReadNpy(path), path,
                "data size mismatch: expected 24 bytes of data for shape "
                "(2, 3), file has 28");
  path = WriteRaw(
      "1d.npy",
      HandMadeNpy(1, 0,
                  "{'descr': '<i8', 'fortran_order': False, 'shape': (5,), }",
                  std::string(8, '\0')));
  ExpectInvalid(ReadNpy(path), path,
                "data size mismatch: expected 40 bytes of data for shape "
                "(5,), file has 8");
  path =
      WriteRaw("huge.npy",
               HandMadeNpy(1, 0,
                           "{'descr': '<i8', 'fortran_order': False, 'shape': "
                           "(4611686018427387904, 4), }",
                           ""));
  ExpectInvalid(ReadNpy(path), path,
                "shape (4611686018427387904, 4) is too large");
}

TEST_F(NpyTest, WriteErrors) {
  const float x = 1.0f;
  const std::vector<int64_t> shape = {1};
  std::string path = Path("no_such_dir/a.npy");
  absl::Status s = WriteNpy(path, NpyDType::kFloat32, shape, &x);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(std::string(s.message()),
              StartsWith(path + ": cannot create temporary file "));

  path = Path("neg.npy");
  const std::vector<int64_t> negative = {2, -1};
  s = WriteNpy(path, NpyDType::kFloat32, negative, &x);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(), path +
                             ": cannot write shape (2, -1): negative "
                             "dimension");
  const std::vector<int64_t> two = {2};
  s = WriteNpy(path, NpyDType::kFloat32, two, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;

  // Renaming onto a directory fails; the temporary file is cleaned up.
  ASSERT_EQ(::mkdir(Path("occupied").c_str(), 0755), 0);
  path = Path("occupied");
  s = WriteNpy(path, NpyDType::kFloat32, shape, &x);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()),
              StartsWith(path + ": cannot rename temporary file "));
  EXPECT_THAT(ListDir(), ElementsAre("occupied"));
}

TEST(NpyArrayDeathTest, WrongElementTypeAborts) {
  NpyArray a;
  a.dtype = NpyDType::kInt32;
  a.shape = {1};
  a.data.resize(4);
  EXPECT_DEATH(a.as<float>(), "as<float>\\(\\) called on a int32 array");
}

}  // namespace
}  // namespace leap

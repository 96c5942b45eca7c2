#include "common/npy.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"

namespace leap {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;
// numpy aligns the start of the array data to this many bytes.
constexpr size_t kAlign = 64;
// Nesting limit for the header literal; real headers nest two levels.
constexpr int kMaxDepth = 32;
// How much of an unparseable header an error message quotes.
constexpr size_t kMaxQuotedHeader = 256;

struct DTypeInfo {
  NpyDType dtype;
  absl::string_view name;
  absl::string_view code;  // descr without the byte order character
  size_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {NpyDType::kFloat16, "float16", "f2", 2},
    {NpyDType::kFloat32, "float32", "f4", 4},
    {NpyDType::kFloat64, "float64", "f8", 8},
    {NpyDType::kInt32, "int32", "i4", 4},
    {NpyDType::kInt64, "int64", "i8", 8},
};

const DTypeInfo& Info(NpyDType dtype) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.dtype == dtype) return info;
  }
  std::fprintf(stderr, "leap::npy: invalid NpyDType %d\n",
               static_cast<int>(dtype));
  std::abort();
}

std::string SupportedDTypes() {
  std::string out;
  for (const DTypeInfo& info : kDTypes) {
    if (!out.empty()) out += ", ";
    absl::StrAppend(&out, "'<", info.code, "' (", info.name, ")");
  }
  return out;
}

// Python's repr of a tuple of ints: "()", "(5,)", "(3, 4)".
std::string FormatShape(std::span<const int64_t> shape) {
  if (shape.size() == 1) return absl::StrCat("(", shape[0], ",)");
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

// Bytes of an array of `shape` and `elem_size`, or -1 when a dimension is
// negative or the product overflows int64.
int64_t ByteSize(std::span<const int64_t> shape, size_t elem_size) {
  int64_t n = static_cast<int64_t>(elem_size);
  for (int64_t d : shape) {
    if (d < 0) return -1;
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) return -1;
    n *= d;
  }
  return n;
}

// ---- Header literal parsing -------------------------------------------------

// A Python literal as far as .npy headers use them.
struct PyEntry;
struct PyValue {
  enum class Kind { kString, kBool, kInt, kNone, kTuple, kList, kDict };
  Kind kind = Kind::kNone;
  std::string str;  // kString
  bool boolean = false;
  int64_t integer = 0;
  std::vector<PyValue> items;                            // kTuple, kList
  // kDict. A named struct, not std::pair: a pair of the incomplete PyValue is
  // ill-formed, and clang with libstdc++ rejects it.
  std::vector<PyEntry> entries;
};
struct PyEntry {
  std::string first;  // key
  PyValue second;     // value
};

// Recursive-descent parser for the subset of Python literal syntax numpy
// writes (what ast.literal_eval accepts for dicts of strings, bools, ints,
// None, tuples and lists). Errors are InvalidArgument with a bare detail; the
// caller adds the path.
class LiteralParser {
 public:
  explicit LiteralParser(absl::string_view text) : text_(text) {}

  // Parses the whole text as one value surrounded by optional whitespace.
  absl::StatusOr<PyValue> ParseAll() {
    ASSIGN_OR_RETURN(PyValue v, ParseValue(0));
    SkipSpace();
    if (pos_ != text_.size()) return Error("unexpected trailing characters");
    return v;
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(what, " at offset ", pos_));
  }

  void SkipSpace() {
    while (pos_ < text_.size() &&
           std::isspace(static_cast<unsigned char>(text_[pos_]))) {
      ++pos_;
    }
  }

  bool Consume(char c) {
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }

  bool ConsumeWord(absl::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    const size_t end = pos_ + word.size();
    if (end < text_.size() &&
        (std::isalnum(static_cast<unsigned char>(text_[end])) ||
         text_[end] == '_')) {
      return false;
    }
    pos_ = end;
    return true;
  }

  absl::StatusOr<PyValue> ParseValue(int depth) {
    if (depth > kMaxDepth) return Error("nesting too deep");
    SkipSpace();
    if (pos_ >= text_.size()) return Error("unexpected end of header");
    const char c = text_[pos_];
    PyValue v;
    if (c == '\'' || c == '"') {
      v.kind = PyValue::Kind::kString;
      ASSIGN_OR_RETURN(v.str, ParseString());
      return v;
    }
    if (c == '-' || c == '+' || std::isdigit(static_cast<unsigned char>(c))) {
      v.kind = PyValue::Kind::kInt;
      ASSIGN_OR_RETURN(v.integer, ParseInt());
      return v;
    }
    if (ConsumeWord("True")) {
      v.kind = PyValue::Kind::kBool;
      v.boolean = true;
      return v;
    }
    if (ConsumeWord("False")) {
      v.kind = PyValue::Kind::kBool;
      return v;
    }
    if (ConsumeWord("None")) return v;
    if (c == '(' || c == '[') {
      ++pos_;
      const char close = c == '(' ? ')' : ']';
      bool saw_comma = false;
      while (!Consume(close)) {
        if (!v.items.empty() && !saw_comma) {
          return Error(
              absl::StrCat("expected ',' or '", std::string(1, close), "'"));
        }
        ASSIGN_OR_RETURN(PyValue item, ParseValue(depth + 1));
        v.items.push_back(std::move(item));
        saw_comma = Consume(',');
      }
      if (c == '[') {
        v.kind = PyValue::Kind::kList;
        return v;
      }
      // "(x)" is x itself in Python; only "(x,)" is a 1-tuple.
      if (v.items.size() == 1 && !saw_comma) return std::move(v.items[0]);
      v.kind = PyValue::Kind::kTuple;
      return v;
    }
    if (c == '{') {
      ++pos_;
      v.kind = PyValue::Kind::kDict;
      bool saw_comma = false;
      while (!Consume('}')) {
        if (!v.entries.empty() && !saw_comma)
          return Error("expected ',' or '}'");
        ASSIGN_OR_RETURN(PyValue key, ParseValue(depth + 1));
        if (key.kind != PyValue::Kind::kString) {
          return Error("dict key is not a string");
        }
        if (!Consume(':')) return Error("expected ':'");
        ASSIGN_OR_RETURN(PyValue value, ParseValue(depth + 1));
        v.entries.push_back(PyEntry{std::move(key.str), std::move(value)});
        saw_comma = Consume(',');
      }
      return v;
    }
    return Error(absl::StrCat("unexpected character '",
                              absl::CHexEscape(text_.substr(pos_, 1)), "'"));
  }

  absl::StatusOr<std::string> ParseString() {
    const char quote = text_[pos_++];
    std::string out;
    while (pos_ < text_.size() && text_[pos_] != quote) {
      char ch = text_[pos_++];
      if (ch == '\n') break;  // as in Python, a string ends on its line
      if (ch == '\\') {
        if (pos_ >= text_.size()) break;
        const char esc = text_[pos_++];
        switch (esc) {
          case 'n':
            ch = '\n';
            break;
          case 't':
            ch = '\t';
            break;
          case 'r':
            ch = '\r';
            break;
          case '0':
            ch = '\0';
            break;
          case '\\':
          case '\'':
          case '"':
            ch = esc;
            break;
          default:
            out.push_back('\\');
            ch = esc;
            break;
        }
      }
      out.push_back(ch);
    }
    if (pos_ >= text_.size() || text_[pos_] != quote) {
      return Error("unterminated string");
    }
    ++pos_;  // closing quote
    return out;
  }

  absl::StatusOr<int64_t> ParseInt() {
    bool negative = false;
    if (text_[pos_] == '-' || text_[pos_] == '+') {
      negative = text_[pos_] == '-';
      ++pos_;
      SkipSpace();
    }
    if (pos_ >= text_.size() ||
        !std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
      return Error("expected digits");
    }
    // Accumulate the magnitude as uint64 so INT64_MIN parses too.
    uint64_t magnitude = 0;
    const uint64_t limit =
        negative ? uint64_t{1} << 63
                 : static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
    while (pos_ < text_.size() &&
           (std::isdigit(static_cast<unsigned char>(text_[pos_])) ||
            text_[pos_] == '_')) {
      if (text_[pos_] == '_') {
        ++pos_;
        continue;
      }
      const uint64_t digit = static_cast<uint64_t>(text_[pos_] - '0');
      if (magnitude > (limit - digit) / 10) return Error("integer too large");
      magnitude = magnitude * 10 + digit;
      ++pos_;
    }
    // Python 2 era writers emitted longs as "3L".
    if (pos_ < text_.size() && (text_[pos_] == 'L' || text_[pos_] == 'l')) {
      ++pos_;
    }
    if (negative) return static_cast<int64_t>(0 - magnitude);
    return static_cast<int64_t>(magnitude);
  }

  absl::string_view text_;
  size_t pos_ = 0;
};

// Python-like repr of a parsed value for error messages.
std::string Repr(const PyValue& v) {
  switch (v.kind) {
    case PyValue::Kind::kString:
      return absl::StrCat("'", absl::CHexEscape(v.str), "'");
    case PyValue::Kind::kBool:
      return v.boolean ? "True" : "False";
    case PyValue::Kind::kInt:
      return absl::StrCat(v.integer);
    case PyValue::Kind::kNone:
      return "None";
    case PyValue::Kind::kTuple:
    case PyValue::Kind::kList: {
      std::string out = v.kind == PyValue::Kind::kTuple ? "(" : "[";
      for (size_t i = 0; i < v.items.size(); ++i) {
        if (i > 0) out += ", ";
        out += Repr(v.items[i]);
      }
      if (v.kind == PyValue::Kind::kTuple && v.items.size() == 1) out += ",";
      out += v.kind == PyValue::Kind::kTuple ? ")" : "]";
      return out;
    }
    case PyValue::Kind::kDict: {
      std::string out = "{";
      for (size_t i = 0; i < v.entries.size(); ++i) {
        if (i > 0) out += ", ";
        absl::StrAppend(&out, "'", absl::CHexEscape(v.entries[i].first),
                        "': ", Repr(v.entries[i].second));
      }
      return out + "}";
    }
  }
  return "?";
}

// ---- File helpers
// -------------------------------------------------------------

// Closes a file descriptor when it goes out of scope.
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  // Closes now and returns close()'s errno (0 on success).
  int Close() {
    const int fd = std::exchange(fd_, -1);
    return ::close(fd) == 0 ? 0 : errno;
  }

 private:
  int fd_;
};

// Reads up to `n` bytes at `offset`; returns how many were read (fewer only
// at end of file).
absl::StatusOr<size_t> PreadFully(const std::string& path, int fd, void* buf,
                                  size_t n, int64_t offset) {
  auto* p = static_cast<uint8_t*>(buf);
  size_t done = 0;
  while (done < n) {
    const ssize_t r =
        ::pread(fd, p + done, n - done, static_cast<off_t>(offset + done));
    if (r < 0) {
      if (errno == EINTR) continue;
      return absl::ErrnoToStatus(errno, absl::StrCat(path, ": read failed"));
    }
    if (r == 0) break;
    done += static_cast<size_t>(r);
  }
  return done;
}

absl::Status WriteFully(const std::string& path, const std::string& tmp, int fd,
                        const void* buf, size_t n) {
  const auto* p = static_cast<const uint8_t*>(buf);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return absl::ErrnoToStatus(
          errno,
          absl::StrCat(path, ": write to temporary file ", tmp, " failed"));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status Invalid(const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

// `s` in double quotes, with '"', '\\' and non-printable bytes escaped.
std::string Quote(absl::string_view s) {
  std::string out = "\"";
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (u < 0x20 || u >= 0x7F) {
      absl::StrAppend(&out, "\\x", absl::Hex(u, absl::kZeroPad2));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// The header for an error message: padding dropped, long ones shortened.
std::string QuoteHeader(absl::string_view header) {
  while (!header.empty() &&
         std::isspace(static_cast<unsigned char>(header.back()))) {
    header.remove_suffix(1);
  }
  if (header.size() <= kMaxQuotedHeader) return Quote(header);
  return absl::StrCat(Quote(header.substr(0, kMaxQuotedHeader)), "...");
}

// Validates a parsed header dict and fills dtype and shape.
absl::Status InterpretHeader(const std::string& path, absl::string_view header,
                             const PyValue& dict, NpyArray& array) {
  auto unparseable = [&](absl::string_view what) {
    return Invalid(path, absl::StrCat("unparseable .npy header: ", what,
                                      " in header ", QuoteHeader(header)));
  };
  if (dict.kind != PyValue::Kind::kDict) {
    return unparseable("header is not a dict literal");
  }
  const PyValue* descr = nullptr;
  const PyValue* fortran = nullptr;
  const PyValue* shape = nullptr;
  for (const auto& [key, value] : dict.entries) {
    const PyValue** slot = key == "descr"           ? &descr
                           : key == "fortran_order" ? &fortran
                           : key == "shape"         ? &shape
                                                    : nullptr;
    if (slot == nullptr) {
      return unparseable(
          absl::StrCat("unexpected key '", absl::CHexEscape(key), "'"));
    }
    if (*slot != nullptr) {
      return unparseable(absl::StrCat("duplicate key '", key, "'"));
    }
    *slot = &value;
  }
  if (descr == nullptr) return unparseable("missing key 'descr'");
  if (fortran == nullptr) return unparseable("missing key 'fortran_order'");
  if (shape == nullptr) return unparseable("missing key 'shape'");

  if (fortran->kind != PyValue::Kind::kBool) {
    return unparseable(absl::StrCat("'fortran_order' is ", Repr(*fortran),
                                    ", not True or False"));
  }
  if (shape->kind != PyValue::Kind::kTuple) {
    return unparseable(
        absl::StrCat("'shape' is ", Repr(*shape), ", not a tuple of ints"));
  }
  array.shape.clear();
  for (const PyValue& d : shape->items) {
    if (d.kind != PyValue::Kind::kInt || d.integer < 0) {
      return unparseable(absl::StrCat("'shape' is ", Repr(*shape),
                                      ", not a tuple of non-negative ints"));
    }
    array.shape.push_back(d.integer);
  }

  if (descr->kind != PyValue::Kind::kString) {
    return Invalid(path, absl::StrCat("unsupported dtype ", Repr(*descr),
                                      " (structured dtypes are not "
                                      "supported); supported dtypes: ",
                                      SupportedDTypes()));
  }
  absl::string_view code = descr->str;
  char order = '=';
  if (!code.empty() && std::strchr("<>|=", code[0]) != nullptr) {
    order = code[0];
    code.remove_prefix(1);
  }
  const DTypeInfo* info = nullptr;
  for (const DTypeInfo& candidate : kDTypes) {
    if (candidate.code == code) info = &candidate;
  }
  if (info == nullptr) {
    return Invalid(path,
                   absl::StrCat("unsupported dtype ", Repr(*descr),
                                "; supported dtypes: ", SupportedDTypes()));
  }
  if (order == '>') {
    return Invalid(path, absl::StrCat("big-endian dtype ", Repr(*descr),
                                      " is unsupported; only little-endian "
                                      "data can be read (save it with "
                                      "arr.astype('<",
                                      info->code, "'))"));
  }
  if (fortran->boolean) {
    return Invalid(path,
                   "fortran_order True is unsupported; only C-order arrays "
                   "can be read (save np.ascontiguousarray(arr))");
  }
  array.dtype = info->dtype;
  return absl::OkStatus();
}

std::atomic<uint64_t> temp_counter{0};

}  // namespace

namespace npy_internal {
void DTypeMismatch(NpyDType actual, std::string_view requested) {
  std::fprintf(stderr, "leap::NpyArray::as<%.*s>() called on a %.*s array\n",
               static_cast<int>(requested.size()), requested.data(),
               static_cast<int>(NpyDTypeName(actual).size()),
               NpyDTypeName(actual).data());
  std::abort();
}
}  // namespace npy_internal

std::string_view NpyDTypeName(NpyDType dtype) {
  const absl::string_view name = Info(dtype).name;
  return std::string_view(name.data(), name.size());
}

size_t NpyDTypeSize(NpyDType dtype) { return Info(dtype).size; }

absl::StatusOr<NpyArray> ReadNpy(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot open"));
  }
  FdCloser closer(fd);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat(path, ": fstat failed"));
  }
  if (!S_ISREG(st.st_mode)) return Invalid(path, "not a regular file");
  const int64_t file_size = st.st_size;

  // Magic (6), version (2), header length (2 or 4).
  uint8_t pre[12];
  ASSIGN_OR_RETURN(size_t got, PreadFully(path, fd, pre, 8, 0));
  if (got < kMagicLen || std::memcmp(pre, kMagic, kMagicLen) != 0) {
    return Invalid(
        path,
        absl::StrCat("bad magic, not a .npy file (expected the first 6 "
                     "bytes to be \"\\x93NUMPY\", got ",
                     Quote(absl::string_view(reinterpret_cast<const char*>(pre),
                                             std::min(got, kMagicLen))),
                     ")"));
  }
  if (got < 8) {
    return Invalid(path, absl::StrCat("truncated .npy preamble: file has only ",
                                      file_size, " bytes"));
  }
  const int major = pre[6];
  const int minor = pre[7];
  if ((major != 1 && major != 2 && major != 3) || minor != 0) {
    return Invalid(path,
                   absl::StrCat("unsupported .npy format version ", major, ".",
                                minor, " (supported: 1.0, 2.0, 3.0)"));
  }
  const size_t len_size = major == 1 ? 2 : 4;
  ASSIGN_OR_RETURN(got, PreadFully(path, fd, pre + 8, len_size, 8));
  if (got < len_size) {
    return Invalid(path, absl::StrCat("truncated .npy preamble: file has only ",
                                      file_size, " bytes"));
  }
  uint64_t header_len = 0;
  for (size_t i = 0; i < len_size; ++i) {
    header_len |= static_cast<uint64_t>(pre[8 + i]) << (8 * i);
  }
  const int64_t data_offset = static_cast<int64_t>(8 + len_size + header_len);
  if (data_offset > file_size) {
    return Invalid(
        path, absl::StrCat("truncated .npy header: the preamble declares a ",
                           header_len, "-byte header but the file has only ",
                           file_size, " bytes"));
  }
  std::string header(header_len, '\0');
  ASSIGN_OR_RETURN(got, PreadFully(path, fd, header.data(), header_len,
                                   static_cast<int64_t>(8 + len_size)));
  if (got < header_len) {
    return Invalid(path, "file shrank while reading the .npy header");
  }

  absl::StatusOr<PyValue> dict = LiteralParser(header).ParseAll();
  if (!dict.ok()) {
    return Invalid(
        path, absl::StrCat("unparseable .npy header: ", dict.status().message(),
                           " in header ", QuoteHeader(header)));
  }
  NpyArray array;
  RETURN_IF_ERROR(InterpretHeader(path, header, *dict, array));

  const int64_t expected = ByteSize(array.shape, NpyDTypeSize(array.dtype));
  if (expected < 0) {
    return Invalid(path, absl::StrCat("shape ", FormatShape(array.shape),
                                      " is too large"));
  }
  const int64_t available = file_size - data_offset;
  if (available != expected) {
    return Invalid(
        path, absl::StrCat("data size mismatch: expected ", expected,
                           " bytes of data for shape ",
                           FormatShape(array.shape), ", file has ", available));
  }
  array.data.resize(static_cast<size_t>(expected));
  ASSIGN_OR_RETURN(got, PreadFully(path, fd, array.data.data(),
                                   array.data.size(), data_offset));
  if (got < array.data.size()) {
    return Invalid(path, absl::StrCat("data size mismatch: expected ", expected,
                                      " bytes of data for shape ",
                                      FormatShape(array.shape), ", file has ",
                                      got, " (it shrank while being read)"));
  }
  return array;
}

absl::Status WriteNpy(const std::string& path, NpyDType dtype,
                      std::span<const int64_t> shape, const void* data) {
  const DTypeInfo& info = Info(dtype);
  for (int64_t d : shape) {
    if (d < 0) {
      return Invalid(path,
                     absl::StrCat("cannot write shape ", FormatShape(shape),
                                  ": negative dimension"));
    }
  }
  const int64_t bytes = ByteSize(shape, info.size);
  if (bytes < 0) {
    return Invalid(path, absl::StrCat("cannot write shape ", FormatShape(shape),
                                      ": too many elements"));
  }
  if (bytes > 0 && data == nullptr) {
    return Invalid(path, absl::StrCat("cannot write shape ", FormatShape(shape),
                                      ": data is null"));
  }

  std::string dict = absl::StrCat(
      "{'descr': '<", info.code,
      "', 'fortran_order': False, 'shape': ", FormatShape(shape), ", }");
  // As numpy: pad with spaces and end with '\n' so the data starts on a
  // 64-byte boundary; use 2.0 only when the header length exceeds uint16.
  int major = 1;
  size_t prefix_len = kMagicLen + 2 + 2;
  if (dict.size() + 1 + kAlign > 0xFFFF) {
    major = 2;
    prefix_len = kMagicLen + 2 + 4;
  }
  const size_t pad = kAlign - (prefix_len + dict.size() + 1) % kAlign;
  const size_t header_len = dict.size() + pad + 1;
  std::string out(kMagic, kMagicLen);
  out.push_back(static_cast<char>(major));
  out.push_back(0);
  for (size_t i = 0; i < prefix_len - kMagicLen - 2; ++i) {
    out.push_back(static_cast<char>((header_len >> (8 * i)) & 0xFF));
  }
  out += dict;
  out.append(pad, ' ');
  out.push_back('\n');

  const std::string tmp =
      absl::StrCat(path, ".tmp.", ::getpid(), ".", temp_counter.fetch_add(1));
  const int fd =
      ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) {
    return absl::ErrnoToStatus(
        errno, absl::StrCat(path, ": cannot create temporary file ", tmp));
  }
  FdCloser closer(fd);
  absl::Status status = WriteFully(path, tmp, fd, out.data(), out.size());
  if (status.ok()) {
    status = WriteFully(path, tmp, fd, data, static_cast<size_t>(bytes));
  }
  if (status.ok() && ::fsync(fd) != 0) {
    status = absl::ErrnoToStatus(
        errno,
        absl::StrCat(path, ": fsync of temporary file ", tmp, " failed"));
  }
  if (const int err = closer.Close(); status.ok() && err != 0) {
    status = absl::ErrnoToStatus(
        err, absl::StrCat(path, ": close of temporary file ", tmp, " failed"));
  }
  if (status.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    status = absl::ErrnoToStatus(
        errno, absl::StrCat(path, ": cannot rename temporary file ", tmp,
                            " into place"));
  }
  if (!status.ok()) ::unlink(tmp.c_str());
  return status;
}

}  // namespace leap

#include "readout/artifact.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace leap::readout {
namespace {

constexpr char kMagic[8] = {'\x89', 'L', 'E', 'A', 'P', 'R', '\r', '\n'};
constexpr char kEndMagic[8] = {'L', 'E', 'A', 'P', 'R', 'E', 'N', 'D'};
constexpr size_t kTrailerBytes = 8 + 4 + 8;
constexpr size_t kAlign = 64;
// Upper bound on the JSON header, so a corrupted length cannot make us
// allocate gigabytes.
constexpr uint32_t kMaxHeaderBytes = 1 << 20;

template <typename T>
void Put(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}

template <typename T>
T Get(absl::string_view bytes, size_t off) {
  T v;
  std::memcpy(&v, bytes.data() + off, sizeof(T));
  return v;
}

void PadTo(std::string& out, size_t align) {
  out.append((align - out.size() % align) % align, '\0');
}

struct ArrayRef {
  std::string name;
  std::string dtype;  // "f64" or "f32"
  int64_t count;
  const void* data;
};

// `key` of `j` as the integer type T. nlohmann's get<T>() converts a float
// (1e300) with undefined behaviour and wraps an out-of-range integer: both
// are refused here as a header field error.
template <typename T>
T IntField(const nlohmann::json& j, const char* key) {
  const nlohmann::json& v = j.at(key);
  constexpr T lo = std::numeric_limits<T>::min();
  constexpr T hi = std::numeric_limits<T>::max();
  bool ok = false;
  if (v.is_number_unsigned()) {
    ok = v.get<uint64_t>() <= static_cast<uint64_t>(hi);
  } else if (v.is_number_integer()) {
    const int64_t x = v.get<int64_t>();
    ok = std::is_signed_v<T> ? x >= static_cast<int64_t>(lo) &&
                                   x <= static_cast<int64_t>(hi)
                             : x >= 0 && static_cast<uint64_t>(x) <=
                                             static_cast<uint64_t>(hi);
  }
  if (!ok) {
    throw nlohmann::json::type_error::create(
        302, absl::StrCat("'", key, "' must be an integer in [", lo, ", ", hi,
                          "], got ", v.dump()),
        &v);
  }
  return v.get<T>();
}
// The same, `dflt` when `key` is absent.
template <typename T>
T IntField(const nlohmann::json& j, const char* key, T dflt) {
  return j.contains(key) ? IntField<T>(j, key) : dflt;
}

absl::Status Err(absl::string_view source, absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(source, ": not a valid readout artifact: ", what));
}

}  // namespace

absl::Status ReadoutState::Validate() const {
  RETURN_IF_ERROR(spec.Validate());
  RETURN_IF_ERROR(standardizer.Validate());
  if (standardizer.dim() != spec.dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("standardizer has ", standardizer.dim(),
                     " features but spec.dim is ", spec.dim));
  }
  if (theta.size() != spec.dim + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "theta has ", theta.size(), " entries, expected dim + 1 = ",
        spec.dim + 1));
  }
  if (!theta.allFinite()) {
    return absl::InvalidArgumentError("theta has non-finite entries");
  }
  if (p.has_value() && p->n() != spec.dim + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "P is ", p->n(), " x ", p->n(), ", expected ", spec.dim + 1));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SerializeArtifact(const ReadoutState& s) {
  RETURN_IF_ERROR(s.Validate());
  const int64_t d = s.spec.dim;
  const int64_t n = d + 1;
  std::vector<float> packed_p;
  if (s.p.has_value()) {
    packed_p.resize(static_cast<size_t>(n * n));
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(packed_p.data() + i * n, s.p->row(i), n * sizeof(float));
    }
  }
  std::vector<ArrayRef> arrays = {
      {"mean", "f64", d, s.standardizer.mean.data()},
      {"scale", "f64", d, s.standardizer.scale.data()},
      {"theta", "f64", n, s.theta.data()},
  };
  if (s.p.has_value()) arrays.push_back({"p", "f32", n * n, packed_p.data()});

  // Array offsets depend on the header length, which depends on the offsets'
  // digits: lay out with a fixed-width guess, then iterate until stable.
  nlohmann::json header;
  header["format"] = "leap.readout";
  header["dim"] = d;
  header["layer"] = s.spec.layer;
  header["model_id"] = s.spec.model_id;
  header["max_tokens"] = s.spec.max_tokens;
  header["lambda"] = s.spec.lambda;
  header["version"] = s.version;
  header["completions_learned"] = s.completions_learned;
  header["train_rows"] = s.train_rows;
  header["note"] = s.note;
  header["created_unix_ms"] = s.created_unix_ms;
  header["target"] = "sqrt(min(output_tokens, max_tokens))";
  header["bias"] = "last";
  std::string header_text;
  size_t data_start = 0;
  for (int iter = 0; iter < 4; ++iter) {
    nlohmann::json table = nlohmann::json::array();
    size_t off = data_start;
    for (const ArrayRef& a : arrays) {
      const size_t bytes = a.count * (a.dtype == "f64" ? 8 : 4);
      table.push_back({{"name", a.name},
                       {"dtype", a.dtype},
                       {"count", a.count},
                       {"offset", off},
                       {"bytes", bytes},
                       {"crc32c", Crc32c(a.data, bytes)}});
      off = (off + bytes + kAlign - 1) / kAlign * kAlign;
    }
    header["arrays"] = table;
    header_text = header.dump();
    const size_t start =
        (16 + header_text.size() + 4 + kAlign - 1) / kAlign * kAlign;
    if (start == data_start) break;
    data_start = start;
  }

  std::string out;
  out.append(kMagic, 8);
  Put<uint32_t>(out, kArtifactFormatVersion);
  Put<uint32_t>(out, static_cast<uint32_t>(header_text.size()));
  out += header_text;
  Put<uint32_t>(out, Crc32c(header_text.data(), header_text.size()));
  PadTo(out, kAlign);
  if (out.size() != data_start) {
    return absl::InternalError("artifact layout did not converge");
  }
  for (const ArrayRef& a : arrays) {
    const size_t bytes = a.count * (a.dtype == "f64" ? 8 : 4);
    out.append(static_cast<const char*>(a.data), bytes);
    PadTo(out, kAlign);
  }
  const uint64_t total = out.size() + kTrailerBytes;
  Put<uint64_t>(out, total);
  Put<uint32_t>(out, Crc32c(out.data(), out.size()));
  out.append(kEndMagic, 8);
  return out;
}

absl::StatusOr<ReadoutState> ParseArtifact(absl::string_view b,
                                           absl::string_view src) {
  if (b.size() < 16 || std::memcmp(b.data(), kMagic, 8) != 0) {
    return Err(src, b.size() < 8 ? "file too short for the magic"
                                 : "bad magic (not a .leapr file)");
  }
  const uint32_t fmt = Get<uint32_t>(b, 8);
  if (fmt != kArtifactFormatVersion) {
    return Err(src, absl::StrCat("unsupported format version ", fmt,
                                 " (this build reads ",
                                 kArtifactFormatVersion, ")"));
  }
  const uint32_t hlen = Get<uint32_t>(b, 12);
  if (hlen > kMaxHeaderBytes) {
    return Err(src, absl::StrCat("header length ", hlen, " exceeds ",
                                 kMaxHeaderBytes, " (corrupted)"));
  }
  if (b.size() < 16 + size_t{hlen} + 4) {
    return Err(src, absl::StrCat("truncated: file has ", b.size(),
                                 " bytes, header alone needs ", 20 + hlen));
  }
  const absl::string_view htext = b.substr(16, hlen);
  if (Crc32c(htext.data(), htext.size()) != Get<uint32_t>(b, 16 + hlen)) {
    return Err(src, "header checksum mismatch (corrupted header)");
  }
  nlohmann::json h = nlohmann::json::parse(htext, nullptr, false);
  if (h.is_discarded() || !h.is_object()) {
    return Err(src, "header is not a JSON object");
  }
  // The trailer states the file size: check truncation before the arrays.
  if (b.size() < kTrailerBytes + 20 + hlen) {
    return Err(src, "truncated: no trailer");
  }
  ReadoutState s;
  try {
    s.spec.dim = IntField<int64_t>(h, "dim");
    s.spec.layer = IntField<int32_t>(h, "layer");
    s.spec.model_id = h.at("model_id").get<std::string>();
    s.spec.max_tokens = IntField<int64_t>(h, "max_tokens");
    s.spec.lambda = h.at("lambda").get<double>();
    s.version = IntField(h, "version", int64_t{0});
    s.completions_learned = IntField(h, "completions_learned", int64_t{0});
    s.train_rows = IntField(h, "train_rows", int64_t{0});
    s.note = h.value("note", std::string());
    s.created_unix_ms = IntField(h, "created_unix_ms", int64_t{0});
    RETURN_IF_ERROR(s.spec.Validate());
    const int64_t d = s.spec.dim;
    const int64_t n = d + 1;
    // Find the trailer by the declared size of the arrays.
    size_t end_of_arrays = 0;
    for (const auto& a : h.at("arrays")) {
      const uint64_t off = IntField<uint64_t>(a, "offset");
      const uint64_t bytes = IntField<uint64_t>(a, "bytes");
      if (off > b.size() || bytes > b.size() - off) {  // no overflow below
        return Err(src, absl::StrCat("array '", a.at("name").get<std::string>(),
                                     "' (offset ", off, ", ", bytes,
                                     " bytes) runs past the end of the ",
                                     b.size(), "-byte file (truncated or "
                                     "corrupted)"));
      }
      end_of_arrays = std::max<size_t>(
          end_of_arrays, (off + bytes + kAlign - 1) / kAlign * kAlign);
    }
    const uint64_t expected_total = end_of_arrays + kTrailerBytes;
    if (b.size() < expected_total) {
      return Err(src, absl::StrCat("truncated: expected ", expected_total,
                                   " bytes, file has ", b.size()));
    }
    if (b.size() > expected_total) {
      return Err(src, absl::StrCat("expected ", expected_total,
                                   " bytes, file has ", b.size(),
                                   " (trailing garbage)"));
    }
    const size_t t = end_of_arrays;
    if (Get<uint64_t>(b, t) != expected_total ||
        std::memcmp(b.data() + t + 12, kEndMagic, 8) != 0) {
      return Err(src, "bad trailer (corrupted or truncated)");
    }
    bool seen_mean = false, seen_scale = false, seen_theta = false;
    s.standardizer.mean.resize(d);
    s.standardizer.scale.resize(d);
    s.theta.resize(n);
    for (const auto& a : h.at("arrays")) {
      const std::string name = a.at("name").get<std::string>();
      const std::string dtype = a.at("dtype").get<std::string>();
      const int64_t count = IntField<int64_t>(a, "count");
      const size_t off = IntField<uint64_t>(a, "offset");
      const size_t bytes = IntField<uint64_t>(a, "bytes");
      const size_t esize = dtype == "f64" ? 8 : dtype == "f32" ? 4 : 0;
      if (esize == 0 || count < 0 || bytes != count * esize ||
          off + bytes > t || off < 20 + size_t{hlen}) {
        return Err(src, absl::StrCat("array '", name, "' has a bad entry"));
      }
      const void* p = b.data() + off;
      if (Crc32c(p, bytes) != IntField<uint32_t>(a, "crc32c")) {
        return Err(src, absl::StrCat("array '", name,
                                     "' failed its CRC-32C check (corrupted)"));
      }
      auto expect = [&](int64_t want, absl::string_view want_dtype)
          -> absl::Status {
        if (count != want || dtype != want_dtype) {
          return Err(src, absl::StrCat("array '", name, "' has ", count, " ",
                                       dtype, " values, expected ", want, " ",
                                       want_dtype));
        }
        return absl::OkStatus();
      };
      if (name == "mean") {
        RETURN_IF_ERROR(expect(d, "f64"));
        std::memcpy(s.standardizer.mean.data(), p, bytes);
        seen_mean = true;
      } else if (name == "scale") {
        RETURN_IF_ERROR(expect(d, "f64"));
        std::memcpy(s.standardizer.scale.data(), p, bytes);
        seen_scale = true;
      } else if (name == "theta") {
        RETURN_IF_ERROR(expect(n, "f64"));
        std::memcpy(s.theta.data(), p, bytes);
        seen_theta = true;
      } else if (name == "p") {
        RETURN_IF_ERROR(expect(n * n, "f32"));
        SymMatrix m(n);
        const float* src_p = static_cast<const float*>(p);
        for (int64_t i = 0; i < n; ++i) {
          std::memcpy(m.row(i), src_p + i * n, n * sizeof(float));
        }
        s.p = std::move(m);
      }  // Unknown arrays are ignored (forward compatibility).
    }
    if (!seen_mean || !seen_scale || !seen_theta) {
      return Err(src, "missing one of the arrays mean, scale, theta");
    }
    if (Crc32c(b.data(), t + 8) != Get<uint32_t>(b, t + 8)) {
      return Err(src, "file checksum mismatch (corrupted)");
    }
  } catch (const nlohmann::json::exception& e) {
    return Err(src, absl::StrCat("header field error: ", e.what()));
  }
  absl::Status v = s.Validate();
  if (!v.ok()) return Err(src, v.message());
  return s;
}

absl::Status WriteArtifact(const std::string& path, const ReadoutState& s) {
  ASSIGN_OR_RETURN(std::string bytes, SerializeArtifact(s));
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) {
    return absl::InternalError(
        absl::StrCat(path, ": cannot create: ", std::strerror(errno)));
  }
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return absl::InternalError(
          absl::StrCat(path, ": write failed: ", std::strerror(e)));
    }
    done += static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    return absl::InternalError(
        absl::StrCat(path, ": fsync/close failed: ", std::strerror(errno)));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    return absl::InternalError(
        absl::StrCat(path, ": rename failed: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<ReadoutState> ReadArtifact(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  const std::string bytes = ss.str();
  return ParseArtifact(bytes, path);
}

}  // namespace leap::readout

// Fuzz target: the readout artifact reader (ParseArtifact, .leapr files).
//
// The first input byte picks a mode:
//  - bit 0 clear: the rest is the file, parsed as is;
//  - bit 0 set: the rest is "JSON header text \0 array bytes", and the
//    target builds the file around it with every checksum right (header
//    CRC, each array's crc32c where its offset/bytes lie in the file, the
//    file CRC), so the fuzzer reaches the header fields and array table
//    instead of stopping at a checksum. Bit 1 set: the trailer goes where
//    the array table says the arrays end (a well-formed size); clear: right
//    after the array bytes.
// Checks: no crash or sanitizer report; an accepted state validates and
// survives SerializeArtifact -> ParseArtifact unchanged.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "common/crc32c.h"
#include "fuzz/fuzz_common.h"
#include "nlohmann/json.hpp"
#include "readout/artifact.h"

namespace {

constexpr char kMagic[8] = {'\x89', 'L', 'E', 'A', 'P', 'R', '\r', '\n'};
constexpr char kEndMagic[8] = {'L', 'E', 'A', 'P', 'R', 'E', 'N', 'D'};

template <typename T>
void Put(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}

size_t Align64(size_t n) { return (n + 63) / 64 * 64; }

// The file for `header` (JSON text) and `arrays` (placed at the first
// 64-byte boundary after the header CRC).
std::string Assemble(const std::string& header, absl::string_view arrays) {
  std::string out(kMagic, 8);
  Put<uint32_t>(out, leap::readout::kArtifactFormatVersion);
  Put<uint32_t>(out, static_cast<uint32_t>(header.size()));
  out += header;
  Put<uint32_t>(out, leap::Crc32c(header.data(), header.size()));
  out.resize(Align64(out.size()), '\0');
  out.append(arrays.data(), arrays.size());
  return out;
}

std::string BuildWithChecksums(absl::string_view body, bool trailer_at_table) {
  const size_t nul = body.find('\0');
  std::string header(body.substr(0, nul));
  const absl::string_view arrays =
      nul == absl::string_view::npos ? absl::string_view() : body.substr(nul + 1);
  nlohmann::json h = nlohmann::json::parse(header, nullptr, false);
  std::string file = Assemble(header, arrays);
  uint64_t table_end = 0;
  if (!h.is_discarded() && h.is_object() && h.contains("arrays") &&
      h["arrays"].is_array()) {
    // Checksums change the header's length and so where the arrays start:
    // iterate (as the writer does) until the text is stable.
    for (int iter = 0; iter < 4; ++iter) {
      table_end = 0;
      for (auto& a : h["arrays"]) {
        if (!a.is_object() || !a.contains("offset") || !a.contains("bytes") ||
            !a["offset"].is_number_unsigned() ||
            !a["bytes"].is_number_unsigned()) {
          continue;
        }
        const uint64_t off = a["offset"].get<uint64_t>();
        const uint64_t bytes = a["bytes"].get<uint64_t>();
        if (off <= file.size() && bytes <= file.size() - off) {
          a["crc32c"] = leap::Crc32c(file.data() + off, bytes);
          table_end = std::max<uint64_t>(table_end, Align64(off + bytes));
        }
      }
      std::string text = h.dump();
      const bool stable = text == header;
      header = std::move(text);
      file = Assemble(header, arrays);
      if (stable) break;
    }
  }
  if (trailer_at_table && table_end > 0 && table_end < (size_t{1} << 24)) {
    file.resize(table_end, '\0');
  }
  const uint64_t total = file.size() + 20;
  Put<uint64_t>(file, total);
  Put<uint32_t>(file, leap::Crc32c(file.data(), file.size()));
  file.append(kEndMagic, 8);
  return file;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const absl::string_view body(reinterpret_cast<const char*>(data) + 1,
                               size - 1);
  std::string built;
  absl::string_view file = body;
  if (data[0] & 1) {
    built = BuildWithChecksums(body, (data[0] & 2) != 0);
    file = built;
  }
  // An exact-size copy, so reading past the end is an ASan report.
  std::unique_ptr<char[]> copy(new char[file.size()]);
  std::memcpy(copy.get(), file.data(), file.size());
  auto state = leap::readout::ParseArtifact(
      absl::string_view(copy.get(), file.size()), "fuzz.leapr");
  if (!state.ok()) return 0;
  FUZZ_CHECK(state->Validate().ok());
  auto again = leap::readout::SerializeArtifact(*state);
  FUZZ_CHECK(again.ok());
  auto back = leap::readout::ParseArtifact(*again, "fuzz.leapr (rewritten)");
  FUZZ_CHECK(back.ok());
  FUZZ_CHECK(back->spec.dim == state->spec.dim);
  FUZZ_CHECK(back->theta == state->theta);
  FUZZ_CHECK(back->standardizer.mean == state->standardizer.mean);
  FUZZ_CHECK(back->standardizer.scale == state->standardizer.scale);
  FUZZ_CHECK(back->p.has_value() == state->p.has_value());
  return 0;
}

#include "replay/trace.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/civil_time.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "common/file.h"

namespace leap::replay {
namespace {

// Shortens a value quoted in an error message.
std::string Quote(absl::string_view s) {
  if (s.size() > 40) return absl::StrCat("'", s.substr(0, 40), "...'");
  return absl::StrCat("'", s, "'");
}

absl::Status LineError(absl::string_view source, int64_t line,
                       absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(source, ":", line, ": ", what));
}

// A non-negative integer token count (exactly digits, no sign or fraction).
absl::StatusOr<int64_t> ParseCount(absl::string_view field,
                                   absl::string_view column,
                                   absl::string_view source, int64_t line) {
  const absl::string_view s = absl::StripAsciiWhitespace(field);
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size() || v < 0) {
    return LineError(
        source, line,
        absl::StrCat(column, " must be a non-negative integer, got ",
                     Quote(s)));
  }
  return v;
}

// "YYYY-MM-DD HH:MM:SS[.fraction]" (or with 'T') as Unix seconds, or a plain
// number of seconds.
absl::StatusOr<double> ParseTimestamp(absl::string_view field,
                                      absl::string_view source, int64_t line) {
  const absl::string_view s = absl::StripAsciiWhitespace(field);
  double plain = 0;
  {
    const auto [end, ec] =
        std::from_chars(s.data(), s.data() + s.size(), plain);
    if (!s.empty() && ec == std::errc() && end == s.data() + s.size() &&
        std::isfinite(plain)) {
      return plain;
    }
  }
  const auto bad = [&] {
    return LineError(
        source, line,
        absl::StrCat("TIMESTAMP must be 'YYYY-MM-DD HH:MM:SS[.fraction]' or "
                     "seconds, got ",
                     Quote(s)));
  };
  // Fixed positions: 0123-56-89 12:45:78
  if (s.size() < 19 || s[4] != '-' || s[7] != '-' ||
      (s[10] != ' ' && s[10] != 'T') || s[13] != ':' || s[16] != ':') {
    return bad();
  }
  const auto num = [&](size_t pos, size_t len, int64_t* out) {
    const auto [end, ec] =
        std::from_chars(s.data() + pos, s.data() + pos + len, *out);
    return ec == std::errc() && end == s.data() + pos + len;
  };
  int64_t y, mo, d, h, mi, sec;
  if (!num(0, 4, &y) || !num(5, 2, &mo) || !num(8, 2, &d) || !num(11, 2, &h) ||
      !num(14, 2, &mi) || !num(17, 2, &sec) || mo < 1 || mo > 12 || d < 1 ||
      d > 31 || h > 23 || mi > 59 || sec > 60) {
    return bad();
  }
  double frac = 0;
  if (s.size() > 19) {
    if (s[19] != '.' || s.size() == 20) return bad();
    double scale = 0.1;
    for (size_t i = 20; i < s.size(); ++i) {
      if (!absl::ascii_isdigit(static_cast<unsigned char>(s[i]))) return bad();
      frac += (s[i] - '0') * scale;
      scale /= 10;
    }
  }
  const absl::CivilSecond cs(y, mo, d, h, mi, sec);
  if (cs.day() != d || cs.month() != mo) return bad();  // e.g. Feb 30
  return static_cast<double>(
             absl::ToUnixSeconds(absl::FromCivil(cs, absl::UTCTimeZone()))) +
         frac;
}

// The lines of a file with their 1-based numbers, '\r' stripped.
std::vector<std::pair<int64_t, absl::string_view>> Lines(
    absl::string_view text) {
  std::vector<std::pair<int64_t, absl::string_view>> out;
  int64_t n = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++n;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    out.emplace_back(n, line);
  }
  return out;
}

bool Blank(absl::string_view line) {
  return absl::StripAsciiWhitespace(line).empty();
}

absl::StatusOr<Trace> ParseCsv(absl::string_view text, TraceFormat format,
                               absl::string_view source, int64_t max_rows) {
  const auto lines = Lines(text);
  size_t i = 0;
  while (i < lines.size() && Blank(lines[i].second)) ++i;
  if (i == lines.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": empty file (expected a CSV header)"));
  }
  std::vector<std::string> header;
  for (absl::string_view h : absl::StrSplit(lines[i].second, ',')) {
    header.push_back(std::string(absl::StripAsciiWhitespace(h)));
  }
  const int64_t header_line = lines[i].first;
  ++i;
  const std::vector<std::string> want =
      format == TraceFormat::kAzure
          ? std::vector<std::string>{"TIMESTAMP", "ContextTokens",
                                     "GeneratedTokens"}
          : std::vector<std::string>{"num_prefill_tokens", "num_decode_tokens"};
  std::vector<size_t> col;
  for (const std::string& w : want) {
    auto it = std::find(header.begin(), header.end(), w);
    if (it == header.end()) {
      return LineError(
          source, header_line,
          absl::StrCat(TraceFormatName(format), " header must have columns ",
                       absl::StrJoin(want, ", "), "; missing ", w, " in '",
                       absl::StrJoin(header, ","), "'"));
    }
    col.push_back(static_cast<size_t>(it - header.begin()));
  }
  Trace t;
  t.format = format;
  t.source = std::string(source);
  t.has_timestamps = format == TraceFormat::kAzure;
  std::vector<double> stamps;
  for (; i < lines.size(); ++i) {
    const auto [line_no, line] = lines[i];
    if (Blank(line)) continue;
    if (max_rows > 0 && static_cast<int64_t>(t.rows.size()) >= max_rows) break;
    std::vector<absl::string_view> fields = absl::StrSplit(line, ',');
    if (fields.size() != header.size()) {
      return LineError(source, line_no,
                       absl::StrCat("expected ", header.size(),
                                    " comma-separated fields (as the header), "
                                    "got ",
                                    fields.size()));
    }
    TraceRow row;
    if (format == TraceFormat::kAzure) {
      absl::StatusOr<double> ts =
          ParseTimestamp(fields[col[0]], source, line_no);
      if (!ts.ok()) return ts.status();
      absl::StatusOr<int64_t> in =
          ParseCount(fields[col[1]], "ContextTokens", source, line_no);
      if (!in.ok()) return in.status();
      absl::StatusOr<int64_t> out =
          ParseCount(fields[col[2]], "GeneratedTokens", source, line_no);
      if (!out.ok()) return out.status();
      row.arrival_s = *ts;
      row.prompt_tokens = *in;
      row.output_tokens = *out;
    } else {
      absl::StatusOr<int64_t> in =
          ParseCount(fields[col[0]], "num_prefill_tokens", source, line_no);
      if (!in.ok()) return in.status();
      absl::StatusOr<int64_t> out =
          ParseCount(fields[col[1]], "num_decode_tokens", source, line_no);
      if (!out.ok()) return out.status();
      row.prompt_tokens = *in;
      row.output_tokens = *out;
    }
    t.rows.push_back(row);
  }
  if (t.rows.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": no data rows after the header"));
  }
  return t;
}

absl::StatusOr<Trace> ParseJsonl(absl::string_view text,
                                 absl::string_view source, int64_t max_rows) {
  Trace t;
  t.format = TraceFormat::kJsonl;
  t.source = std::string(source);
  t.has_timestamps = true;
  for (const auto& [line_no, line] : Lines(text)) {
    if (Blank(line)) continue;
    if (max_rows > 0 && static_cast<int64_t>(t.rows.size()) >= max_rows) break;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      return LineError(source, line_no, "not a JSON object");
    }
    TraceRow row;
    auto it = j.find("timestamp");
    if (it == j.end() || !it->is_number() ||
        !std::isfinite(it->get<double>())) {
      return LineError(source, line_no,
                       "missing or non-numeric \"timestamp\" (milliseconds)");
    }
    row.arrival_s = it->get<double>() / 1000.0;
    for (const char* key : {"input_length", "output_length"}) {
      auto v = j.find(key);
      if (v == j.end() ||
          !(v->is_number_integer() || v->is_number_unsigned()) ||
          (v->is_number_integer() && v->get<int64_t>() < 0)) {
        return LineError(source, line_no,
                         absl::StrCat("missing \"", key,
                                      "\" or not a non-negative integer"));
      }
      (key[0] == 'i' ? row.prompt_tokens : row.output_tokens) =
          v->get<int64_t>();
    }
    t.rows.push_back(row);
  }
  if (t.rows.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": no JSON lines"));
  }
  return t;
}

}  // namespace

absl::StatusOr<TraceFormat> ParseTraceFormat(absl::string_view name) {
  if (name == "auto") return TraceFormat::kAuto;
  if (name == "azure") return TraceFormat::kAzure;
  if (name == "lengths") return TraceFormat::kLengths;
  if (name == "jsonl") return TraceFormat::kJsonl;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown trace format '", name, "' (auto, azure, lengths, jsonl)"));
}

absl::string_view TraceFormatName(TraceFormat format) {
  switch (format) {
    case TraceFormat::kAuto:
      return "auto";
    case TraceFormat::kAzure:
      return "azure";
    case TraceFormat::kLengths:
      return "lengths";
    case TraceFormat::kJsonl:
      return "jsonl";
  }
  return "?";
}

absl::StatusOr<Trace> ParseTrace(absl::string_view text, TraceFormat format,
                                 absl::string_view source, int64_t max_rows) {
  if (format == TraceFormat::kAuto) {
    const absl::string_view body = absl::StripLeadingAsciiWhitespace(text);
    if (absl::EndsWith(source, ".jsonl") || absl::EndsWith(source, ".json") ||
        absl::StartsWith(body, "{")) {
      format = TraceFormat::kJsonl;
    } else {
      const absl::string_view first = body.substr(0, body.find('\n'));
      if (absl::StrContains(first, "TIMESTAMP")) {
        format = TraceFormat::kAzure;
      } else if (absl::StrContains(first, "num_decode_tokens")) {
        format = TraceFormat::kLengths;
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            source,
            ": cannot tell the trace format (no TIMESTAMP or "
            "num_decode_tokens column in the first line, not JSON lines); "
            "pass --format"));
      }
    }
  }
  absl::StatusOr<Trace> t = format == TraceFormat::kJsonl
                                ? ParseJsonl(text, source, max_rows)
                                : ParseCsv(text, format, source, max_rows);
  if (!t.ok() || !t->has_timestamps) return t;
  std::stable_sort(t->rows.begin(), t->rows.end(),
                   [](const TraceRow& a, const TraceRow& b) {
                     return a.arrival_s < b.arrival_s;
                   });
  const double t0 = t->rows.front().arrival_s;
  for (TraceRow& r : t->rows) r.arrival_s -= t0;
  return t;
}

absl::StatusOr<Trace> ReadTrace(const std::string& path, TraceFormat format,
                                int64_t max_rows) {
  absl::StatusOr<std::string> bytes = ReadFileBytes(path);
  if (!bytes.ok()) return bytes.status();
  return ParseTrace(*bytes, format, path, max_rows);
}

Trace SyntheticTrace(int64_t n, const readout::SynthDomain& before,
                     const readout::SynthDomain& after, int64_t shift_index,
                     int64_t max_tokens, uint64_t seed) {
  Trace t;
  t.source = "synthetic";
  t.rows.resize(static_cast<size_t>(n));
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> prompt(std::log(kSyntheticPromptMedian),
                                             kSyntheticPromptSigma);
  std::lognormal_distribution<double> len_before(std::log(before.median_tokens),
                                                 before.log_sigma);
  std::lognormal_distribution<double> len_after(std::log(after.median_tokens),
                                                after.log_sigma);
  for (int64_t i = 0; i < n; ++i) {
    TraceRow& r = t.rows[static_cast<size_t>(i)];
    const double l = i < shift_index ? len_before(rng) : len_after(rng);
    r.output_tokens = std::clamp<int64_t>(static_cast<int64_t>(std::llround(l)),
                                          1, max_tokens);
    r.prompt_tokens =
        std::clamp<int64_t>(static_cast<int64_t>(std::llround(prompt(rng))), 1,
                            kSyntheticPromptMax);
  }
  return t;
}

std::vector<double> PoissonArrivals(int64_t n, int64_t shift_index,
                                    double rate_before, double rate_after,
                                    uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::exponential_distribution<double> gap_before(rate_before);
  std::exponential_distribution<double> gap_after(rate_after);
  std::vector<double> out(static_cast<size_t>(n));
  double t = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i > 0) t += i < shift_index ? gap_before(rng) : gap_after(rng);
    out[static_cast<size_t>(i)] = t;
  }
  return out;
}

double TraceRate(const Trace& trace) {
  if (trace.rows.size() < 2) return 0;
  const double span =
      trace.rows.back().arrival_s - trace.rows.front().arrival_s;
  return span > 0 ? static_cast<double>(trace.rows.size() - 1) / span : 0;
}

}  // namespace leap::replay

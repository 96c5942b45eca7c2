// Fuzz target: the decoders of the shm frames other than kFeatures
// (common/shm_format.h): kPredictions and kRelease (leapd -> engine, read by
// the engine's ShmChannel) and kCancels (engine -> leapd, read by leapd's
// shm server). Either side may be buggy or hostile, so no payload may make a
// decoder read outside it.
//
// The first input byte picks the frame (byte % 3): 0 kPredictions,
// 1 kRelease, 2 kCancels; the rest is the payload, copied to a heap buffer
// of its exact size (an overread is an ASan report). Beyond "no crash":
//  - every view a decoder returns lies inside the payload;
//  - a kPredictions or kCancels payload accepted is re-encoded with the
//    writers and decodes to the same records (the round trip);
//  - kRelease passes exactly min(count, (bytes - head) / 4) slots, each the
//    uint32 at its place.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/shm_format.h"
#include "fuzz/fuzz_common.h"

namespace {

namespace shm = leap::shm;

bool Inside(absl::string_view v, const char* p, size_t n) {
  return v.empty() || (v.data() >= p && v.data() + v.size() <= p + n);
}

void Predictions(const char* p, size_t n) {
  uint64_t seq = 0;
  std::vector<shm::PredictionView> preds;
  std::vector<shm::ErrorView> errs;
  const absl::Status s = shm::DecodePredictions(p, n, &seq, &preds, &errs);
  size_t bytes = sizeof(shm::PredictionsHead);
  for (const shm::PredictionView& v : preds) {
    FUZZ_CHECK(Inside(v.request_id, p, n) && Inside(v.readout, p, n) &&
               Inside(v.arm, p, n));
    bytes += shm::PredictionRecordBytes(v.request_id.size(), v.readout.size(),
                                        v.arm.size());
  }
  for (const shm::ErrorView& e : errs) {
    FUZZ_CHECK(Inside(e.request_id, p, n) && Inside(e.message, p, n));
    bytes += shm::ErrorRecordBytes(e.request_id.size(), e.message.size());
  }
  if (!s.ok()) {
    FUZZ_CHECK(s.code() == absl::StatusCode::kDataLoss);
    return;
  }
  FUZZ_CHECK(bytes <= n);
  // Round trip through the writers.
  std::string out(bytes, '\0');
  const shm::PredictionsHead head{seq, static_cast<uint32_t>(preds.size()),
                                  static_cast<uint32_t>(errs.size())};
  std::memcpy(out.data(), &head, sizeof(head));
  size_t at = sizeof(head);
  for (const shm::PredictionView& v : preds) {
    at += shm::WritePredictionRecord(out.data() + at, v.slot, v.request_id,
                                     v.readout, v.arm, v.predicted_tokens,
                                     v.score, v.version);
  }
  for (const shm::ErrorView& e : errs) {
    at += shm::WriteErrorRecord(out.data() + at, e.slot, e.request_id, e.code,
                                e.message);
  }
  FUZZ_CHECK(at == bytes);
  uint64_t seq2 = 0;
  std::vector<shm::PredictionView> preds2;
  std::vector<shm::ErrorView> errs2;
  FUZZ_CHECK(shm::DecodePredictions(out.data(), out.size(), &seq2, &preds2, &errs2)
                 .ok());
  FUZZ_CHECK(seq2 == seq && preds2.size() == preds.size() &&
             errs2.size() == errs.size());
  for (size_t i = 0; i < preds.size(); ++i) {
    const shm::PredictionView &a = preds[i], &b = preds2[i];
    FUZZ_CHECK(a.slot == b.slot && a.request_id == b.request_id &&
               a.readout == b.readout && a.arm == b.arm && a.version == b.version);
    FUZZ_CHECK(std::memcmp(&a.predicted_tokens, &b.predicted_tokens, 8) == 0 &&
               std::memcmp(&a.score, &b.score, 8) == 0);
  }
  for (size_t i = 0; i < errs.size(); ++i) {
    FUZZ_CHECK(errs[i].slot == errs2[i].slot && errs[i].code == errs2[i].code &&
               errs[i].request_id == errs2[i].request_id &&
               errs[i].message == errs2[i].message);
  }
}

void Release(const char* p, size_t n) {
  std::vector<uint32_t> slots;
  const uint32_t count =
      shm::DecodeRelease(p, n, [&](uint32_t s) { slots.push_back(s); });
  FUZZ_CHECK(count == slots.size());
  uint64_t want = 0;
  if (n >= sizeof(shm::ReleaseHead)) {
    const auto h = shm::LoadUnaligned<shm::ReleaseHead>(p);
    want = std::min<uint64_t>(h.count, (n - sizeof(h)) / 4);
  }
  FUZZ_CHECK(count == want);
  for (size_t i = 0; i < slots.size(); ++i) {
    FUZZ_CHECK(slots[i] ==
               shm::LoadUnaligned<uint32_t>(p + sizeof(shm::ReleaseHead) + 4 * i));
  }
}

void Cancels(const char* p, size_t n) {
  uint64_t seq = 0;
  std::vector<absl::string_view> ids;
  const absl::Status s = shm::DecodeCancels(p, n, &seq, &ids);
  if (!s.ok()) {
    FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    FUZZ_CHECK(ids.empty());  // nothing cancelled
    return;
  }
  size_t bytes = sizeof(shm::CancelsHead);
  for (absl::string_view id : ids) {
    FUZZ_CHECK(Inside(id, p, n));
    bytes += 2 + id.size();
  }
  FUZZ_CHECK(bytes <= n);
  // Round trip: the layout ShmChannel::SendCancels writes.
  std::string out;
  const shm::CancelsHead head{seq, static_cast<uint32_t>(ids.size()), 0};
  out.append(reinterpret_cast<const char*>(&head), sizeof(head));
  for (absl::string_view id : ids) {
    const uint16_t len = static_cast<uint16_t>(id.size());
    out.append(reinterpret_cast<const char*>(&len), sizeof(len));
    out.append(id.data(), id.size());
  }
  uint64_t seq2 = 0;
  std::vector<absl::string_view> ids2;
  FUZZ_CHECK(shm::DecodeCancels(out.data(), out.size(), &seq2, &ids2).ok());
  FUZZ_CHECK(seq2 == seq && ids2 == ids);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t n = size - 1;
  std::unique_ptr<char[]> copy(new char[n == 0 ? 1 : n]);
  if (n > 0) std::memcpy(copy.get(), data + 1, n);
  switch (data[0] % 3) {
    case 0:
      Predictions(copy.get(), n);
      break;
    case 1:
      Release(copy.get(), n);
      break;
    default:
      Cancels(copy.get(), n);
      break;
  }
  return 0;
}

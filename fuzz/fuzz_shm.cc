// Fuzz target: the shared-memory wire (common/shm_format.h): segment header
// checks, ring indices and frame walking, and the kFeatures decoder. The
// other side of a segment may be buggy or hostile, so nothing it writes may
// make a reader touch memory outside the segment or outside a frame.
//
// The first input byte picks a mode (byte % 3):
//  0: the rest is a kFeatures payload, decoded record by record;
//  1: a layout from the next bytes, then a 4 KiB header (a fresh one with
//     bytes overwritten from the input, or the raw input) checked with
//     CheckHeader;
//  2: a ring (64 B to 64 KiB) driven by one producer and one consumer Ring
//     with operations read from the input: reserve/commit frames, publish,
//     consume and decode, release, and "hostile" writes of the tail, the
//     head or the ring bytes, as a misbehaving peer would. Until a hostile
//     write, every frame read must be exactly a frame written, in order.
// All memory is heap-allocated at its exact size, so an overread is an ASan
// report.
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "common/shm_format.h"
#include "fuzz/fuzz_common.h"

namespace {

namespace shm = leap::shm;

// Reads little pieces off the input; zeros once it is used up.
class Input {
 public:
  Input(const uint8_t* data, size_t size) : p_(data), n_(size) {}
  bool empty() const { return n_ == 0; }
  size_t left() const { return n_; }
  template <typename T>
  T Get() {
    T v{};
    const size_t k = std::min(sizeof(T), n_);
    std::memcpy(&v, p_, k);
    p_ += k;
    n_ -= k;
    return v;
  }
  std::string Bytes(size_t k) {
    k = std::min(k, n_);
    std::string s(reinterpret_cast<const char*>(p_), k);
    p_ += k;
    n_ -= k;
    return s;
  }

 private:
  const uint8_t* p_;
  size_t n_;
};

volatile uint64_t sink;

// Reads every byte of `s` (so ASan sees any view past its frame).
void Touch(absl::string_view s) {
  uint64_t sum = 0;
  for (const char c : s) sum += static_cast<uint8_t>(c);
  sink = sink + sum;
}

// Decodes a kFeatures payload of `bytes` at `p` (an exact-size copy).
void DecodeFeatures(const char* p, size_t bytes) {
  std::unique_ptr<char[]> copy(new char[bytes]);
  if (bytes > 0) std::memcpy(copy.get(), p, bytes);
  shm::FeaturesReader reader(copy.get(), bytes);
  uint64_t seq = 0;
  uint32_t count = 0;
  if (!reader.Init(&seq, &count).ok()) return;
  // Init promises count fixed-size record heads fit.
  FUZZ_CHECK(uint64_t{count} * sizeof(shm::FeatureRecordHead) <=
             bytes - sizeof(shm::FeaturesHead));
  for (uint32_t i = 0; i < count; ++i) {
    shm::FeatureRecordView r;
    if (!reader.Next(&r).ok()) return;
    FUZZ_CHECK(r.request_id.data() >= copy.get() &&
               r.product_line.data() + r.product_line.size() <=
                   copy.get() + bytes);
    Touch(r.request_id);
    Touch(r.product_line);
  }
}

void CheckHeaderMode(Input& in) {
  const auto dim = in.Get<int32_t>();
  const auto dtype = in.Get<uint8_t>();
  const auto slots = in.Get<uint32_t>() % (shm::kMaxSlots + 2);
  const uint32_t ring = uint32_t{1} << (in.Get<uint8_t>() % 32);
  const auto attach_id = in.Get<uint64_t>();
  const auto mapped = in.Get<uint32_t>();
  const auto how = in.Get<uint8_t>();
  auto layout = shm::ComputeLayout(dim, dtype, slots, ring);
  if (!layout.ok()) return;
  // ComputeLayout's promises: everything inside total_bytes, rings apart.
  FUZZ_CHECK(layout->to_sidecar_offset >= shm::kHeaderBytes);
  FUZZ_CHECK(layout->to_engine_offset >=
             layout->to_sidecar_offset + layout->ring_bytes);
  FUZZ_CHECK(layout->slots_offset >=
             layout->to_engine_offset + layout->ring_bytes);
  FUZZ_CHECK(layout->slot_bytes >= layout->dim * layout->dtype_size);
  FUZZ_CHECK(layout->total_bytes >=
             layout->slots_offset +
                 uint64_t{layout->slot_bytes} * layout->slot_count);
  auto* raw = static_cast<char*>(
      ::operator new(shm::kHeaderBytes, std::align_val_t{64}));
  std::memset(raw, 0, shm::kHeaderBytes);
  if (how & 1) {
    shm::InitHeader(raw, *layout, attach_id);
    // Overwrite a few bytes: (offset, value) pairs.
    while (!in.empty()) {
      const size_t at = in.Get<uint16_t>() % sizeof(shm::SegmentHeader);
      raw[at] = static_cast<char>(in.Get<uint8_t>());
    }
  } else {
    const std::string b = in.Bytes(shm::kHeaderBytes);
    std::memcpy(raw, b.data(), b.size());
  }
  const size_t mapped_bytes =
      (how & 2) ? layout->total_bytes + (mapped & 0xFFFF) : mapped;
  // CheckHeader reads the header only; the mapped size is just a number.
  const absl::Status s =
      shm::CheckHeader(raw, mapped_bytes, *layout, attach_id);
  if (s.ok()) {
    const auto* h = reinterpret_cast<const shm::SegmentHeader*>(raw);
    FUZZ_CHECK(h->magic == shm::kMagic);
    FUZZ_CHECK(h->ring_bytes == layout->ring_bytes);
    FUZZ_CHECK(h->total_bytes == layout->total_bytes);
    FUZZ_CHECK(h->slots_offset == layout->slots_offset);
  }
  ::operator delete(raw, std::align_val_t{64});
}

struct Expected {
  uint16_t kind;
  std::string payload;
};

void RingMode(Input& in) {
  const uint32_t bytes = uint32_t{1} << (6 + in.Get<uint8_t>() % 11);
  shm::RingControl control;
  control.tail.store(0);
  control.head.store(0);
  control.sleeping.store(0);
  control.space_wanted.store(0);
  control.wake.store(0);
  std::unique_ptr<char[]> data(new char[bytes]);
  std::memset(data.get(), 0, bytes);
  shm::Ring producer(&control, data.get(), bytes);
  shm::Ring consumer(&control, data.get(), bytes);

  bool hostile = false;  // a peer wrote indices or bytes of its own
  bool corrupt = false;  // the consumer declared the ring corrupt
  std::deque<Expected> committed;  // committed, not yet read
  size_t published = 0;            // of `committed`, how many are published
  uint64_t counter = 0;
  std::string error;
  for (int op = 0; op < 4000 && !in.empty(); ++op) {
    switch (in.Get<uint8_t>() % 8) {
      case 0: {  // produce one frame
        const size_t n = in.Get<uint16_t>() % (bytes / 2 + 1);
        const auto kind = static_cast<uint16_t>(in.Get<uint8_t>() % 7);
        const bool fits = producer.Fits(n);
        char* p = producer.Reserve(n, static_cast<shm::FrameKind>(kind));
        FUZZ_CHECK((p != nullptr) == fits);
        if (p == nullptr) break;
        FUZZ_CHECK(n <= producer.max_payload());
        FUZZ_CHECK(p >= data.get() && p + n <= data.get() + bytes);
        std::string payload = in.Bytes(n);
        while (payload.size() < n) {
          payload.push_back(static_cast<char>(counter++ * 131));
        }
        std::memcpy(p, payload.data(), n);
        producer.Commit();
        if (kind != static_cast<uint16_t>(shm::FrameKind::kPad)) {
          committed.push_back({kind, std::move(payload)});
        }
        break;
      }
      case 1:
        producer.Publish();
        published = committed.size();
        break;
      case 2: {  // consume one frame
        if (corrupt) break;
        shm::FrameHeader h;
        const char* p = nullptr;
        switch (consumer.Next(&h, &p, &error)) {
          case shm::Ring::Peek::kCorrupt:
            FUZZ_CHECK(hostile);
            corrupt = true;
            break;
          case shm::Ring::Peek::kEmpty:
            FUZZ_CHECK(hostile || published == 0);
            break;
          case shm::Ring::Peek::kFrame: {
            FUZZ_CHECK(p >= data.get() && p + h.bytes <= data.get() + bytes);
            FUZZ_CHECK(h.kind != static_cast<uint16_t>(shm::FrameKind::kPad));
            if (!hostile) {
              FUZZ_CHECK(published > 0);
              const Expected& want = committed.front();
              FUZZ_CHECK(h.kind == want.kind);
              FUZZ_CHECK(absl::string_view(p, h.bytes) == want.payload);
            }
            if (h.kind == static_cast<uint16_t>(shm::FrameKind::kFeatures)) {
              DecodeFeatures(p, h.bytes);
            } else {
              Touch(absl::string_view(p, h.bytes));
            }
            consumer.Pop();
            if (!committed.empty()) committed.pop_front();
            if (published > 0) --published;
            break;
          }
        }
        break;
      }
      case 3:
        consumer.ReleaseConsumed();
        break;
      case 4:  // a peer moves the tail
        control.tail.store(control.tail.load() + in.Get<uint64_t>() %
                                                     (uint64_t{bytes} * 4 + 1));
        hostile = true;
        break;
      case 5:  // a peer writes any tail or head
        if (in.Get<uint8_t>() & 1) {
          control.tail.store(in.Get<uint64_t>());
        } else {
          control.head.store(in.Get<uint64_t>());
        }
        hostile = true;
        break;
      case 6: {  // a peer scribbles over the ring
        const size_t at = in.Get<uint16_t>() % bytes;
        const std::string b = in.Bytes(std::min<size_t>(16, bytes - at));
        std::memcpy(data.get() + at, b.data(), b.size());
        hostile = true;
        break;
      }
      case 7: {
        const size_t n = in.Get<uint16_t>();
        if (producer.PrepareWaitForSpace(n)) control.space_wanted.store(0);
        if (consumer.PrepareSleep()) consumer.CancelSleep();
        sink = sink + consumer.Empty();
        break;
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  Input in(data + 1, size - 1);
  switch (data[0] % 3) {
    case 0: {
      const std::string b = in.Bytes(size - 1);
      DecodeFeatures(b.data(), b.size());
      break;
    }
    case 1:
      CheckHeaderMode(in);
      break;
    case 2:
      RingMode(in);
      break;
  }
  return 0;
}

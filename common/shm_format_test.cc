// The shared-memory ring and layout on their own: frames of random sizes
// through many wrap-arounds (one thread, then producer and consumer on two
// threads), the layout arithmetic, header checks, and corrupt indices and
// lengths reported instead of followed.
#include "common/shm_format.h"

#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace leap::shm {
namespace {

struct RingMemory {
  explicit RingMemory(uint32_t bytes) : data(bytes) {
    control.head.store(0);
    control.tail.store(0);
    control.sleeping.store(0);
    control.space_wanted.store(0);
    control.wake.store(0);
  }
  RingControl control;
  std::vector<char> data;
};

std::string Payload(uint64_t seq, size_t n) {
  std::string p(n, '\0');
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<char>(seq * 131 + i);
  return p;
}

TEST(ShmRing, FramesOfRandomSizesSurviveManyWrapArounds) {
  RingMemory m(1 << 16);
  Ring producer(&m.control, m.data.data(), 1 << 16);
  Ring consumer(&m.control, m.data.data(), 1 << 16);
  std::mt19937 rng(1);
  std::uniform_int_distribution<size_t> size(0, producer.max_payload());
  uint64_t sent = 0, got = 0;
  std::vector<size_t> sizes;
  std::string error;
  while (got < 20000) {
    // Produce until full, then consume a random number.
    for (;;) {
      const size_t n = size(rng) % 3000;
      char* p = producer.Reserve(n, FrameKind::kProto);
      if (p == nullptr) break;
      const std::string want = Payload(sent, n);
      std::memcpy(p, want.data(), n);
      producer.Commit();
      sizes.push_back(n);
      ++sent;
    }
    producer.Publish();
    const uint64_t take = 1 + rng() % (sent - got);
    for (uint64_t k = 0; k < take; ++k) {
      FrameHeader h;
      const char* p;
      ASSERT_EQ(consumer.Next(&h, &p, &error), Ring::Peek::kFrame) << error;
      ASSERT_EQ(h.bytes, sizes[got]);
      ASSERT_EQ(std::string(p, h.bytes), Payload(got, h.bytes)) << "frame " << got;
      consumer.Pop();
      ++got;
    }
    consumer.ReleaseConsumed();
  }
  EXPECT_GT(m.control.tail.load(), uint64_t{100} << 16);  // wrapped many times
}

TEST(ShmRing, ProducerAndConsumerOnTwoThreads) {
  RingMemory m(1 << 16);
  const uint64_t kFrames = 200000;
  std::thread producer_thread([&] {
    Ring producer(&m.control, m.data.data(), 1 << 16);
    std::mt19937 rng(2);
    for (uint64_t seq = 0; seq < kFrames;) {
      const size_t n = 8 + rng() % 200;
      char* p = producer.Reserve(n, FrameKind::kFeatures);
      if (p == nullptr) {
        producer.Publish();
        std::this_thread::yield();
        continue;
      }
      std::memcpy(p, &seq, 8);
      std::memset(p + 8, static_cast<int>(seq & 0x7f), n - 8);
      producer.Commit();
      if (++seq % 16 == 0) producer.Publish();
    }
    producer.Publish();
  });
  Ring consumer(&m.control, m.data.data(), 1 << 16);
  std::string error;
  for (uint64_t want = 0; want < kFrames;) {
    FrameHeader h;
    const char* p;
    const Ring::Peek r = consumer.Next(&h, &p, &error);
    ASSERT_NE(r, Ring::Peek::kCorrupt) << error;
    if (r == Ring::Peek::kEmpty) {
      std::this_thread::yield();
      continue;
    }
    uint64_t seq;
    std::memcpy(&seq, p, 8);
    ASSERT_EQ(seq, want);
    for (size_t i = 8; i < h.bytes; ++i) {
      ASSERT_EQ(p[i], static_cast<char>(seq & 0x7f));
    }
    consumer.Pop();
    consumer.ReleaseConsumed();
    ++want;
  }
  producer_thread.join();
}

TEST(ShmRing, CorruptIndicesAndLengthsAreReportedNotFollowed) {
  std::string error;
  FrameHeader h;
  const char* p;
  {
    // The producer's tail far past the head.
    RingMemory m(1 << 16);
    Ring consumer(&m.control, m.data.data(), 1 << 16);
    m.control.tail.store(uint64_t{1} << 40);
    EXPECT_EQ(consumer.Next(&h, &p, &error), Ring::Peek::kCorrupt);
    EXPECT_NE(error.find("out of range"), std::string::npos) << error;
  }
  {
    // A tail that is not frame-aligned.
    RingMemory m(1 << 16);
    Ring consumer(&m.control, m.data.data(), 1 << 16);
    m.control.tail.store(12);
    EXPECT_EQ(consumer.Next(&h, &p, &error), Ring::Peek::kCorrupt);
  }
  {
    // A frame length that runs past the published bytes and the ring end.
    RingMemory m(1 << 16);
    Ring consumer(&m.control, m.data.data(), 1 << 16);
    const FrameHeader bad{0x7fffffff, static_cast<uint16_t>(FrameKind::kProto), 0};
    std::memcpy(m.data.data(), &bad, sizeof(bad));
    m.control.tail.store(64);
    EXPECT_EQ(consumer.Next(&h, &p, &error), Ring::Peek::kCorrupt);
    EXPECT_NE(error.find("runs past"), std::string::npos) << error;
  }
  {
    // A consumer head behind the producer by more than the ring: the
    // producer sees no room, never overwrites.
    RingMemory m(1 << 16);
    Ring producer(&m.control, m.data.data(), 1 << 16);
    int frames = 0;
    while (producer.Reserve(1000, FrameKind::kProto) != nullptr) {
      producer.Commit();
      ++frames;
    }
    EXPECT_EQ(frames, 65);  // 1008-byte frames in 64 KiB
    m.control.head.store(uint64_t{1} << 40);
    EXPECT_EQ(producer.Reserve(16, FrameKind::kProto), nullptr);
  }
}

TEST(ShmRing, AWaitForSpaceIsSeenByTheConsumer) {
  RingMemory m(1 << 16);
  Ring producer(&m.control, m.data.data(), 1 << 16);
  Ring consumer(&m.control, m.data.data(), 1 << 16);
  while (producer.Reserve(4000, FrameKind::kProto) != nullptr) producer.Commit();
  producer.Publish();
  EXPECT_TRUE(producer.PrepareWaitForSpace(4000));  // full: may wait
  FrameHeader h;
  const char* p;
  std::string error;
  ASSERT_EQ(consumer.Next(&h, &p, &error), Ring::Peek::kFrame);
  consumer.Pop();
  EXPECT_TRUE(consumer.ReleaseConsumed());   // saw the waiter: must wake it
  EXPECT_FALSE(consumer.ReleaseConsumed());  // and only once
  EXPECT_FALSE(producer.PrepareWaitForSpace(4000));  // room now: no wait
}

TEST(ShmRing, SleepAnnouncementIsSeenByThePublisher) {
  RingMemory m(1 << 16);
  Ring producer(&m.control, m.data.data(), 1 << 16);
  Ring consumer(&m.control, m.data.data(), 1 << 16);
  EXPECT_TRUE(consumer.PrepareSleep());  // empty: may sleep
  ASSERT_NE(producer.Reserve(8, FrameKind::kProto), nullptr);
  producer.Commit();
  EXPECT_TRUE(producer.Publish());   // saw the sleeper: must wake it
  EXPECT_FALSE(producer.Publish());  // and only once
  EXPECT_FALSE(consumer.PrepareSleep());  // data waiting: no sleep
}

TEST(ShmLayout, SizesOffsetsAndHeaderChecks) {
  auto l = ComputeLayout(4096, 1, 192, 1 << 18);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->slot_bytes, 16384u);
  EXPECT_EQ(l->slots_offset % 4096, 0u);
  EXPECT_GE(l->total_bytes, l->slots_offset + 192u * 16384u);
  auto b = ComputeLayout(4095, 2, 3, 1 << 16);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->slot_bytes, 8192u);  // 8190 rounded up to 64
  EXPECT_TRUE(absl::IsInvalidArgument(ComputeLayout(0, 1, 1, 1 << 16).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ComputeLayout(16, 9, 1, 1 << 16).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ComputeLayout(16, 1, 0, 1 << 16).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ComputeLayout(16, 1, 1, 100000).status()));

  std::vector<char> seg(l->total_bytes);
  InitHeader(seg.data(), *l, 77);
  EXPECT_TRUE(CheckHeader(seg.data(), seg.size(), *l, 77).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(CheckHeader(seg.data(), seg.size(), *l, 78)));
  EXPECT_TRUE(absl::IsFailedPrecondition(CheckHeader(seg.data(), 100, *l, 77)));
  auto other = ComputeLayout(4096, 2, 192, 1 << 18);
  const absl::Status s = CheckHeader(seg.data(), seg.size(), *other, 77);
  EXPECT_TRUE(absl::IsFailedPrecondition(s));
  EXPECT_NE(s.message().find("dtype"), absl::string_view::npos) << s;
  reinterpret_cast<SegmentHeader*>(seg.data())->format_version = 99;
  EXPECT_NE(CheckHeader(seg.data(), seg.size(), *l, 77).message().find("format version"),
            absl::string_view::npos);
}

TEST(ShmCodec, FeatureRecordsRoundTripAndOverrunsAreErrors) {
  std::string frame(sizeof(FeaturesHead), '\0');
  const FeaturesHead head{42, 2, 0};
  std::memcpy(frame.data(), &head, sizeof(head));
  std::string rec(FeatureRecordBytes(3, 4), '\0');
  WriteFeatureRecord(rec.data(), 7, 99, "abc", "chat");
  frame += rec;
  rec.assign(FeatureRecordBytes(1, 0), '\0');
  WriteFeatureRecord(rec.data(), 8, 0, "z", "");
  frame += rec;
  FeaturesReader r(frame.data(), frame.size());
  uint64_t seq;
  uint32_t count;
  ASSERT_TRUE(r.Init(&seq, &count).ok());
  EXPECT_EQ(seq, 42u);
  ASSERT_EQ(count, 2u);
  FeatureRecordView v;
  ASSERT_TRUE(r.Next(&v).ok());
  EXPECT_EQ(v.slot, 7u);
  EXPECT_EQ(v.max_tokens, 99);
  EXPECT_EQ(v.request_id, "abc");
  EXPECT_EQ(v.product_line, "chat");
  ASSERT_TRUE(r.Next(&v).ok());
  EXPECT_EQ(v.request_id, "z");
  EXPECT_FALSE(r.Next(&v).ok());  // past the end
  // A record whose id length runs past the frame.
  std::string bad = frame.substr(0, sizeof(FeaturesHead) + sizeof(FeatureRecordHead));
  const FeaturesHead one{42, 1, 0};
  std::memcpy(bad.data(), &one, sizeof(one));
  FeatureRecordHead rh{1, 60000, 0, 0};
  std::memcpy(bad.data() + sizeof(FeaturesHead), &rh, sizeof(rh));
  FeaturesReader rb(bad.data(), bad.size());
  ASSERT_TRUE(rb.Init(&seq, &count).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(rb.Next(&v)));
}

}  // namespace
}  // namespace leap::shm

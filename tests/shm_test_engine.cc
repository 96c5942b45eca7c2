// shm_test_engine: a real engine process for leapd's crash tests. Attaches
// to leapd's shm socket, submits N requests whose features sit in slots,
// waits for their predictions, prints "live N <attach id>" and blocks until
// killed (the test kill -9s it and checks that leapd reclaims its requests).
//
//   shm_test_engine PATH DIM N
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine_shim/shm_channel.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: shm_test_engine PATH DIM N\n");
    return 2;
  }
  leap::shim::ShmChannelOptions o;
  o.path = argv[1];
  o.hello.set_engine_id("shm-test-engine");
  o.hello.set_dim(std::atoll(argv[2]));
  o.hello.set_dtype(leap::v1::FEATURE_DTYPE_FLOAT32);
  const int n = std::atoi(argv[3]);
  o.slots = static_cast<uint32_t>(n);
  o.timeout = absl::Seconds(30);
  leap::v1::SidecarMessage ack;
  auto ch = leap::shim::ShmChannel::Attach(o, &ack);
  if (!ch.ok()) {
    std::fprintf(stderr, "attach: %s\n", ch.status().ToString().c_str());
    return 1;
  }
  std::vector<std::string> ids;
  std::vector<leap::shim::ShmChannel::Record> records;
  for (int i = 0; i < n; ++i) ids.push_back(absl::StrCat("victim-", i));
  for (int i = 0; i < n; ++i) {
    const int64_t slot = (*ch)->AcquireSlot();
    float* x = reinterpret_cast<float*>((*ch)->slot(static_cast<uint32_t>(slot)));
    for (int64_t j = 0; j < o.hello.dim(); ++j) x[j] = std::sin(0.1f * (i + j));
    records.push_back({static_cast<uint32_t>(slot), ids[i], "", 0});
  }
  if (!(*ch)->SendFeatures(1, records).ok()) return 1;
  (*ch)->Flush();
  int predicted = 0;
  leap::shim::ShmIncoming in;
  while (predicted < n) {
    absl::Status s = (*ch)->Receive(&in, absl::Seconds(30));
    if (!s.ok()) {
      std::fprintf(stderr, "receive: %s\n", s.ToString().c_str());
      return 1;
    }
    if (in.kind == leap::shim::ShmIncoming::Kind::kPredictions) {
      predicted += static_cast<int>(in.predictions.size());
      if (!in.errors.empty()) {
        std::fprintf(stderr, "error: %s\n", std::string(in.errors[0].message).c_str());
        return 1;
      }
    }
  }
  std::printf("live %d %016llx\n", predicted,
              static_cast<unsigned long long>((*ch)->attach_id()));
  std::fflush(stdout);
  for (;;) pause();
}

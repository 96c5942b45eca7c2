// The clocks: monotonic nanoseconds for durations and deadlines inside a
// process, Unix milliseconds for timestamps.
#ifndef LEAP_COMMON_CLOCK_H_
#define LEAP_COMMON_CLOCK_H_

#include <chrono>
#include <cstdint>

namespace leap {

// Nanoseconds on the monotonic (steady) clock; only differences mean anything.
inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Milliseconds since the Unix epoch (wall clock): for timestamps people read
// and that survive a restart.
inline int64_t UnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace leap

#endif  // LEAP_COMMON_CLOCK_H_

// Naming the calling thread, so that per-thread CPU time (top -H, perf,
// /proc/PID/task/TID/comm) tells leapd's threads apart
// (docs/ARCHITECTURE.md, "Threads").
#ifndef LEAP_COMMON_THREAD_H_
#define LEAP_COMMON_THREAD_H_

#include <string_view>

namespace leap {

// Names the calling thread; at most 15 bytes of `name` are kept.
void NameThisThread(std::string_view name);

}  // namespace leap

#endif  // LEAP_COMMON_THREAD_H_

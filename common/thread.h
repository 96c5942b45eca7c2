// Naming leapd's threads, so that per-thread CPU time (top -H, perf,
// /proc/PID/task/TID/comm) tells them apart (docs/ARCHITECTURE.md,
// "Threads"). A thread is named by its creator right after it is built, so
// the name is in place before the creating call returns; a thread nobody
// names keeps the name of the thread that created it (Linux).
#ifndef LEAP_COMMON_THREAD_H_
#define LEAP_COMMON_THREAD_H_

#include <string_view>
#include <thread>

namespace leap {

// Names `t` (a running thread); at most 15 bytes of `name` are kept.
void NameThread(std::thread& t, std::string_view name);

}  // namespace leap

#endif  // LEAP_COMMON_THREAD_H_

// Progress lines of slow steps (leapctl prints them on stderr).
#ifndef LEAP_COMMON_PROGRESS_H_
#define LEAP_COMMON_PROGRESS_H_

#include <functional>
#include <string>

namespace leap {

using ProgressFn = std::function<void(const std::string&)>;

}  // namespace leap

#endif  // LEAP_COMMON_PROGRESS_H_

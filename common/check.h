// CHECK for broken invariants (never for bad input: that is a Status).
// Debian 12's Abseil predates absl/log, so this is the project's own.
//   LEAP_CHECK(n > 0) << "context " << n;
#ifndef LEAP_COMMON_CHECK_H_
#define LEAP_COMMON_CHECK_H_

#include <cstdlib>
#include <iostream>
#include <sstream>

namespace leap::internal {

class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* condition) {
    stream_ << file << ":" << line << ": CHECK failed: " << condition << " ";
  }
  [[noreturn]] ~CheckFailure() {
    std::cerr << stream_.str() << std::endl;
    std::abort();
  }
  std::ostream& stream() { return stream_; }

 private:
  std::ostringstream stream_;
};

}  // namespace leap::internal

#define LEAP_CHECK(cond) \
  while (!(cond)) ::leap::internal::CheckFailure(__FILE__, __LINE__, #cond).stream()
#define LEAP_CHECK_EQ(a, b) \
  LEAP_CHECK((a) == (b)) << #a " = " << (a) << ", " #b " = " << (b) << " "
#define LEAP_CHECK_GE(a, b) \
  LEAP_CHECK((a) >= (b)) << #a " = " << (a) << ", " #b " = " << (b) << " "

#endif  // LEAP_COMMON_CHECK_H_

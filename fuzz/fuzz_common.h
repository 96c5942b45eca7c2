// Helpers shared by the fuzz targets.
#ifndef LEAP_FUZZ_FUZZ_COMMON_H_
#define LEAP_FUZZ_FUZZ_COMMON_H_

#include <cstdio>
#include <cstdlib>

// Aborts (a crash for libFuzzer, a failed replay test) when `cond` is false:
// the property a target checks beyond "does not crash".
#define FUZZ_CHECK(cond)                                                  \
  do {                                                                    \
    if (!(cond)) {                                                        \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK failed: %s\n", __FILE__,    \
                   __LINE__, #cond);                                      \
      std::abort();                                                       \
    }                                                                     \
  } while (0)

#endif  // LEAP_FUZZ_FUZZ_COMMON_H_

// Whether this binary is built with a sanitizer (scripts/test's clang
// phases: ASan + UBSan, TSan). Tests that repeat the same code paths many
// times for statistical or crash coverage run fewer repetitions there: the
// sanitizer looks for memory errors and races in the same paths, and the
// full-length runs are phase 1's (GCC, Release).
#ifndef LEAP_TESTS_SUPPORT_SANITIZER_H_
#define LEAP_TESTS_SUPPORT_SANITIZER_H_

namespace leap::testing {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kUnderSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kUnderSanitizer = true;
#else
inline constexpr bool kUnderSanitizer = false;
#endif
#else
inline constexpr bool kUnderSanitizer = false;
#endif

}  // namespace leap::testing

#endif  // LEAP_TESTS_SUPPORT_SANITIZER_H_

// Makes ThreadSanitizer see absl::Mutex, CondVar and Notification (built only
// with LEAP_SANITIZE=thread).
//
// Debian's libabsl_synchronization.so is not built with -fsanitize=thread, so
// TSan sees neither its lock acquisitions nor its releases: every access to
// data guarded by an absl::Mutex would be reported as a race. Each binary of
// a TSan build links this file (whole archive, ahead of the shared absl), so
// the dynamic linker binds every call of the Mutex and CondVar functions below
// (ours, gRPC's, absl's own) to these definitions. Each one calls the real
// function, found with dlsym(RTLD_NEXT), between TSan's mutex annotations
// (sanitizer/tsan_interface.h) -- what absl's own TSan build does inside
// mutex.cc. Between a pre_* and its post_* annotation TSan ignores memory
// accesses and synchronisation, which covers the absl::Condition functions
// that the real Mutex evaluates while it takes or hands over the lock.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

#if !defined(__SANITIZE_THREAD__) && !(defined(__has_feature) && __has_feature(thread_sanitizer))
#error "tsan_absl_mutex.cc is only for -fsanitize=thread builds"
#endif

#define LEAP_STR2(x) #x
#define LEAP_STR(x) LEAP_STR2(x)

namespace {

// The real function named by its Itanium mangling after "absl::<inline ns>::"
// ("_ZNK" for const members).
void* RealFunction(const char* rest, const char* prefix = "_ZN") {
  const char* ns = LEAP_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  std::string name = std::string(prefix) + "4absl" +
                     std::to_string(std::strlen(ns)) + ns + rest;
  void* fn = dlsym(RTLD_NEXT, name.c_str());
  if (fn == nullptr) {
    std::fprintf(stderr, "tsan_absl_mutex: %s not found in the shared absl\n",
                 name.c_str());
    std::abort();
  }
  return fn;
}

template <typename Fn>
Fn Real(const char* rest, const char* prefix = "_ZN") {
  return reinterpret_cast<Fn>(RealFunction(rest, prefix));
}

using absl::Condition;
using absl::CondVar;
using absl::Duration;
using absl::Mutex;
using absl::Notification;
using absl::Time;

constexpr unsigned kRead = __tsan_mutex_read_lock;

// The lock is released and taken again inside the real call (Await, CondVar).
void ReleasedAndRetaken(void* mu, unsigned flags) {
  __tsan_mutex_post_unlock(mu, flags);
  __tsan_mutex_pre_lock(mu, flags);
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

// Lock order and the thread-safety analysis are not this file's business:
// these are the library's own definitions, interposed.
void Mutex::Lock() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  static auto real = Real<void (*)(Mutex*)>("5Mutex4LockEv");
  __tsan_mutex_pre_lock(this, 0);
  real(this);
  __tsan_mutex_post_lock(this, 0, 0);
}

void Mutex::Unlock() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  static auto real = Real<void (*)(Mutex*)>("5Mutex6UnlockEv");
  __tsan_mutex_pre_unlock(this, 0);
  real(this);
  __tsan_mutex_post_unlock(this, 0);
}

bool Mutex::TryLock() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  static auto real = Real<bool (*)(Mutex*)>("5Mutex7TryLockEv");
  __tsan_mutex_pre_lock(this, __tsan_mutex_try_lock);
  bool ok = real(this);
  __tsan_mutex_post_lock(
      this, __tsan_mutex_try_lock | (ok ? 0 : __tsan_mutex_try_lock_failed), 0);
  return ok;
}

void Mutex::ReaderLock() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  static auto real = Real<void (*)(Mutex*)>("5Mutex10ReaderLockEv");
  __tsan_mutex_pre_lock(this, kRead);
  real(this);
  __tsan_mutex_post_lock(this, kRead, 0);
}

void Mutex::ReaderUnlock() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  static auto real = Real<void (*)(Mutex*)>("5Mutex12ReaderUnlockEv");
  __tsan_mutex_pre_unlock(this, kRead);
  real(this);
  __tsan_mutex_post_unlock(this, kRead);
}

bool Mutex::ReaderTryLock() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  static auto real = Real<bool (*)(Mutex*)>("5Mutex13ReaderTryLockEv");
  __tsan_mutex_pre_lock(this, kRead | __tsan_mutex_try_lock);
  bool ok = real(this);
  __tsan_mutex_post_lock(
      this, kRead | __tsan_mutex_try_lock | (ok ? 0 : __tsan_mutex_try_lock_failed), 0);
  return ok;
}

void Mutex::LockWhen(const Condition& cond) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  static auto real = Real<void (*)(Mutex*, const Condition*)>(
      "5Mutex8LockWhenERKNS0_9ConditionE");
  __tsan_mutex_pre_lock(this, 0);
  real(this, &cond);
  __tsan_mutex_post_lock(this, 0, 0);
}

void Mutex::ReaderLockWhen(const Condition& cond) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  static auto real = Real<void (*)(Mutex*, const Condition*)>(
      "5Mutex14ReaderLockWhenERKNS0_9ConditionE");
  __tsan_mutex_pre_lock(this, kRead);
  real(this, &cond);
  __tsan_mutex_post_lock(this, kRead, 0);
}

// The *WithTimeout functions are implemented here with their *WithDeadline
// twins: the real ones call those through the PLT, which would bind to the
// interposed versions below and annotate the lock twice.
bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  return LockWhenWithDeadline(cond, absl::Now() + timeout);
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  static auto real = Real<bool (*)(Mutex*, const Condition*, Time)>(
      "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  __tsan_mutex_pre_lock(this, 0);
  bool ok = real(this, &cond, deadline);
  __tsan_mutex_post_lock(this, 0, 0);
  return ok;
}

void Mutex::Await(const Condition& cond) {
  static auto real = Real<void (*)(Mutex*, const Condition*)>(
      "5Mutex5AwaitERKNS0_9ConditionE");
  __tsan_mutex_pre_unlock(this, 0);
  real(this, &cond);
  ReleasedAndRetaken(this, 0);
  __tsan_mutex_post_lock(this, 0, 0);
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  return AwaitWithDeadline(cond, absl::Now() + timeout);
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  static auto real = Real<bool (*)(Mutex*, const Condition*, Time)>(
      "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  __tsan_mutex_pre_unlock(this, 0);
  bool ok = real(this, &cond, deadline);
  ReleasedAndRetaken(this, 0);
  __tsan_mutex_post_lock(this, 0, 0);
  return ok;
}

void CondVar::Wait(Mutex* mu) {
  static auto real = Real<void (*)(CondVar*, Mutex*)>("7CondVar4WaitEPNS0_5MutexE");
  __tsan_mutex_pre_unlock(mu, 0);
  real(this, mu);
  ReleasedAndRetaken(mu, 0);
  __tsan_mutex_post_lock(mu, 0, 0);
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  return WaitWithDeadline(mu, absl::Now() + timeout);
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  static auto real = Real<bool (*)(CondVar*, Mutex*, Time)>(
      "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  __tsan_mutex_pre_unlock(mu, 0);
  bool timed_out = real(this, mu, deadline);
  ReleasedAndRetaken(mu, 0);
  __tsan_mutex_post_lock(mu, 0, 0);
  return timed_out;
}

// Notification: Notify releases, a wait that returns acquires (its fast path
// is an atomic load inside the library that TSan does not see). The inline
// HasBeenNotified() is not covered: our code does not use it.
void Notification::Notify() {
  static auto real = Real<void (*)(Notification*)>("12Notification6NotifyEv");
  __tsan_release(this);
  real(this);
}

void Notification::WaitForNotification() const {
  static auto real = Real<void (*)(const Notification*)>(
      "12Notification19WaitForNotificationEv", "_ZNK");
  real(this);
  __tsan_acquire(const_cast<Notification*>(this));
}

bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  static auto real = Real<bool (*)(const Notification*, Duration)>(
      "12Notification30WaitForNotificationWithTimeoutENS0_8DurationE", "_ZNK");
  bool notified = real(this, timeout);
  __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}

bool Notification::WaitForNotificationWithDeadline(Time deadline) const {
  static auto real = Real<bool (*)(const Notification*, Time)>(
      "12Notification31WaitForNotificationWithDeadlineENS0_4TimeE", "_ZNK");
  bool notified = real(this, deadline);
  __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}

ABSL_NAMESPACE_END
}  // namespace absl

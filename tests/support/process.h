// Child processes for end-to-end tests: the launcher is client/process.h
// (shared with the replay simulator); this adds what only tests need.
#ifndef LEAP_TESTS_SUPPORT_PROCESS_H_
#define LEAP_TESTS_SUPPORT_PROCESS_H_

#include <string>

#include "absl/status/statusor.h"
#include "client/process.h"

namespace leap::testing {

using ::leap::client::Process;
using ::leap::client::ProcessOptions;
using ::leap::client::ProcessResult;
using ::leap::client::RunProcess;
using ::leap::client::StartLeapd;

// GET http://host:port/path over a plain socket (loopback test servers);
// returns the body.
absl::StatusOr<std::string> HttpGet(const std::string& host_port,
                                    const std::string& path);

}  // namespace leap::testing

#endif  // LEAP_TESTS_SUPPORT_PROCESS_H_

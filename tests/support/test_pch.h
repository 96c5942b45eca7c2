// The precompiled header of every gtest binary when LEAP_TEST_PCH is on
// (scripts/test's clang builds; see CMakeLists.txt for the measurement): the
// third-party and generated headers that most tests include and that take
// a large part of a test's compile time (gtest and gmock, Eigen, gRPC with
// the generated services, JSON, absl). It is compiled once per build folder
// and reused by every test target, whose own #includes of these headers then
// cost nothing. Nothing here may depend on a macro a test
// defines: tests stay correct with or without it (LEAP_TEST_PCH=OFF), and
// every test still includes what it uses.
#ifndef LEAP_TESTS_SUPPORT_TEST_PCH_H_
#define LEAP_TESTS_SUPPORT_TEST_PCH_H_

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "Eigen/Cholesky"
#include "Eigen/Core"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "leap/v1/admin.grpc.pb.h"
#include "leap/v1/predictor.grpc.pb.h"
#include "nlohmann/json.hpp"

#endif  // LEAP_TESTS_SUPPORT_TEST_PCH_H_

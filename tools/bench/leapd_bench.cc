// leapd_bench: load generator for leapd's Connect stream, kept as a program
// for scripts that call it by name. Exactly `leapctl bench` (same library
// code and flags; see 'leapd_bench --help'):
//
//   leapd_bench --server 127.0.0.1:7070 [--dim 4096] [--batch 64]
//               [--streams 2] [--seconds 10] [--latency-requests 2000]
//               [--dtype float32|bfloat16] [--json]
#include <iostream>
#include <string>
#include <vector>

#include "tools/leapctl/cli.h"

int main(int argc, char** argv) {
  std::ios::sync_with_stdio(false);
  std::vector<std::string> args = {"bench"};
  args.insert(args.end(), argv + 1, argv + argc);
  return leap::leapctl::RunLeapctl(args, std::cout, std::cerr);
}

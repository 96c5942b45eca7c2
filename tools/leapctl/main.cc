// leapctl: the operator's command-line tool for LEAP readouts. A thin main
// over RunLeapctl (tools/leapctl/cli.h); see 'leapctl --help'.
#include <iostream>
#include <string>
#include <vector>

#include "tools/leapctl/cli.h"

int main(int argc, char** argv) {
  std::ios::sync_with_stdio(false);
  const std::vector<std::string> args(argv + 1, argv + argc);
  return leap::leapctl::RunLeapctl(args, std::cout, std::cerr);
}

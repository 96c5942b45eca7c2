// Measures this core's limits, so benchmarks can state their figures as a
// fraction of what the machine allows (this project's machines are noisy and
// differ: compare ratios measured in one run). Benchmark-only.
#ifndef LEAP_READOUT_INTERNAL_MACHINE_PROBE_H_
#define LEAP_READOUT_INTERNAL_MACHINE_PROBE_H_

#include <string>

namespace leap::readout::internal {

// Peak FP32 fused multiply-adds per second of one core (independent FMA
// chains on the widest vector unit the kernels use).
double MeasureFmaPeak();
// Single-core streaming read bandwidth (bytes/s) over a 256 MiB buffer.
double MeasureReadBandwidth();
// "model name" from /proc/cpuinfo and the vector extensions used.
std::string CpuDescription();

}  // namespace leap::readout::internal

#endif  // LEAP_READOUT_INTERNAL_MACHINE_PROBE_H_

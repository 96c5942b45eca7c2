// Measures this core's limits, so benchmarks can state their figures as a
// fraction of what the machine allows (this project's machines are noisy and
// differ: compare ratios measured in one run). Benchmark-only.
#ifndef LEAP_READOUT_INTERNAL_MACHINE_PROBE_H_
#define LEAP_READOUT_INTERNAL_MACHINE_PROBE_H_

#include <cstdint>
#include <string>

namespace leap::readout::internal {

// Peak FP32 fused multiply-adds per second of one core: independent FMA
// chains on the widest vector unit the CPU has (AVX-512 where present,
// else AVX2+FMA; 0 without either). Best of three.
double MeasureFmaPeak();
// The instruction set MeasureFmaPeak used ("avx512", "avx2" or "none").
const char* FmaPeakIsa();
// Single-core streaming read bandwidth (bytes/s) over a 256 MiB buffer,
// with the widest loads the CPU has. Best of three.
double MeasureReadBandwidth();
// A plain n-float dot product (widest FMA, four accumulators, both vectors
// 64-byte aligned; x cycling through 16 vectors, as the prediction
// benchmark's features do): dot products per second, best of three.
double MeasurePlainDot(int64_t n);
// The plain dot product MeasurePlainDot times (w and x 64-byte aligned).
float PlainDot(const float* w, const float* x, int64_t n);
// "model name" from /proc/cpuinfo and the kernel set in use.
std::string CpuDescription();

}  // namespace leap::readout::internal

#endif  // LEAP_READOUT_INTERNAL_MACHINE_PROBE_H_

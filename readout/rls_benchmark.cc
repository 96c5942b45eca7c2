// RLS throughput at d = 4096 against this machine's own limits, measured in
// the same run (issue 13's acceptance ratios):
//   - batches of 8 on one core vs the tighter of the FMA bound (exact RLS
//     needs about 1.5 (d+1)^2 multiply-adds per completion, at the widest
//     FMA the CPU has) and the read-bandwidth bound (a batch streams the
//     4 (d+1)^2 bytes of P at least once);
//   - a backlog (batches of 256, as leapd's adaptive worker applies them)
//     on one core vs the FMA bound;
//   - the backlog on all cores vs one core.
// One-core figures and the limits are timed in this thread's CPU time (the
// machines are shared); the all-core figure in wall time, so it is only
// meaningful on an otherwise idle machine (the load average is printed).
// The limits and the runs are interleaved in rounds (default 3), each ratio
// taken against its own round's limits; medians are printed.
// Batches wider than 8 run on OpenBLAS when its kernels for this CPU are
// AVX-512 (RlsOptions::large_batches); the hand kernels' figure is printed
// beside it. OpenBLAS 0.3.21 (Debian 12) picks AVX2 kernels on AMD Zen 5:
// on a CPU with AVX-512 and OPENBLAS_CORETYPE unset, the benchmark re-runs
// itself with OPENBLAS_CORETYPE=SkylakeX (as a deployment would set it).
//   rls_benchmark [--completions=N] [--rounds=N]
//   (default 2048 completions per measurement, 3 rounds)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "Eigen/Core"
#include "readout/internal/blas.h"
#include "readout/internal/machine_probe.h"
#include "readout/internal/openblas.h"
#include "readout/rls.h"

namespace leap::readout {
namespace {

constexpr int64_t kDim = 4096;
constexpr int64_t kN = kDim + 1;

double WallNow() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One thread: its CPU time (the cores are shared with other work, and time
// spent preempted is not the kernel's). Several: wall time.
double Now(int threads) {
  if (threads > 1) return WallNow();
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

std::vector<float> MakeRows(int64_t rows, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n01;
  std::vector<float> u(rows * kN);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < kDim; ++i) u[r * kN + i] = n01(rng);
    u[r * kN + kDim] = 1.0f;
  }
  return u;
}

struct RateResult {
  double rate = 0;        // completions/s
  double seconds = 0;     // measured time (CPU time on one thread, else wall)
  RlsPhaseSeconds phases;  // seconds per phase over the measurement
  const char* kernels = "";
  std::string large;  // what computed batches wider than 8
};

// Completions per second applying `total` rows in batches of `batch` with
// `threads` threads (after one warm-up fold cycle).
RateResult Rate(const std::vector<float>& u, int64_t total, int batch,
                int threads, const char* large_batches = "") {
  RlsOptions opt;
  opt.threads = threads;
  opt.large_batches = large_batches;
  // P0 = I / lambda (cold start) is as costly to update as any SPD P.
  RlsState rls(Eigen::VectorXd::Zero(kN),
               SymMatrix::ScaledIdentity(kN, 1.0f / 4096), opt);
  const int64_t rows = static_cast<int64_t>(u.size()) / kN;
  std::vector<double> y(batch, 20.0);
  auto run = [&](int64_t count, int64_t first) {
    for (int64_t done = 0; done < count; done += batch) {
      const int64_t r = (first + done) % (rows - batch + 1);
      if (!rls.Update(u.data() + r * kN, kN, y).ok()) {
        std::fprintf(stderr, "update failed\n");
        std::exit(1);
      }
    }
  };
  run(256, 0);  // warm-up: one fold cycle, page faults
  rls.Flush();
  const RlsPhaseSeconds before = rls.phase_seconds();
  const double t0 = Now(threads);
  run(total, 256);
  rls.Flush();  // every fold the work owes is inside the measurement
  RateResult r;
  r.seconds = Now(threads) - t0;
  r.rate = static_cast<double>(total) / r.seconds;
  const RlsPhaseSeconds& after = rls.phase_seconds();
  r.phases.sweep = after.sweep - before.sweep;
  r.phases.product = after.product - before.product;
  r.phases.pending = after.pending - before.pending;
  r.phases.solve = after.solve - before.solve;
  r.phases.w = after.w - before.w;
  r.phases.fold = after.fold - before.fold;
  r.phases.mirror = after.mirror - before.mirror;
  r.kernels = rls.kernel_name();
  r.large = rls.large_batch_variant();
  return r;
}

// Where the time went: each phase in microseconds per completion and as a
// share of the phases' total; the product with P also as a fraction of the
// limit that bounds it (FMA peak for wide batches, bandwidth for narrow),
// the fold as a fraction of the FMA peak.
void PrintPhases(const char* label, const RateResult& r, int64_t total,
                 int batch, int threads, double peak, double bw) {
  const RlsPhaseSeconds& p = r.phases;
  const double us = 1e6 / static_cast<double>(total);
  const double n2 = double(kN) * double(kN);
  std::printf("    phases (%s, %s, %d thread%s; us/completion): sweep %.0f, "
              "product %.0f, pending %.0f, solve %.0f, W %.0f, fold %.0f, "
              "mirror %.0f (sum %.0f of %.0f measured)\n",
              label, batch > 8 ? r.large.c_str() : r.kernels, threads,
              threads > 1 ? "s" : "", p.sweep * us,
              p.product * us,
              p.pending * us, p.solve * us, p.w * us, p.fold * us,
              p.mirror * us, p.total() * us, r.seconds * us);
  const double cores = threads;
  if (batch > 8) {
    std::printf("      product U P: %.2f x the FMA peak; fold (SYRK): %.2f x "
                "the FMA peak\n",
                total * n2 / p.product / (peak * cores),
                total * 0.5 * n2 / p.fold / (peak * cores));
  } else {
    // The sweep reads and writes P's upper triangle once per batch: half
    // of P's bytes each way, P's bytes in all.
    std::printf("      sweep (pending fold + U P, upper triangle read and "
                "written once): %.2f x the read bandwidth, %.2f x the FMA "
                "peak (3k multiply-adds per upper entry)\n",
                (total / batch) * 4.0 * n2 / p.sweep / (bw * cores),
                total * 1.5 * n2 / p.sweep / (peak * cores));
  }
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 == 1 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return a + " " + b + " " + c;
}

}  // namespace
}  // namespace leap::readout

int main(int argc, char** argv) {
  using namespace leap::readout;
  using namespace leap::readout::internal;
  int64_t total = 2048;
  int rounds = 3;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--completions=", 14) == 0) {
      total = std::max<int64_t>(256, std::atoll(argv[i] + 14) / 256 * 256);
    } else if (std::strncmp(argv[i], "--rounds=", 9) == 0) {
      rounds = std::max(1, std::atoi(argv[i] + 9));
    } else {
      std::fprintf(stderr, "usage: rls_benchmark [--completions=N] [--rounds=N]\n");
      return 1;
    }
  }
  ReexecForOpenBlasAvx512(argv);
  openblas_set_num_threads(1);
  const int cores = AvailableCores();
  std::printf("cpu: %s\n", CpuDescription().c_str());
  std::printf("load average at start: %s (cores available: %d)\n",
              LoadAverage().c_str(), cores);
  // Rounds interleave the limits and the RLS runs (the cores are shared:
  // a limit measured minutes before a run says little about it); every
  // ratio is taken against the limits of its own round, and the medians
  // are printed.
  const double fma_per_completion = 1.5 * double(kN) * double(kN);
  const double p_bytes = 4.0 * double(kN) * double(kN);
  std::vector<float> u = MakeRows(1024, 3);
  std::vector<double> q8, qbig, qbigk, qall, q8all, peaks, bws;
  RateResult r8, rbig1, rbigk, rbigall, r8all;
  const char* env_core = std::getenv("OPENBLAS_CORETYPE");
  std::printf("OpenBLAS: %s kernels (OPENBLAS_CORETYPE %s)\n",
              OpenBlasCore().c_str(), env_core != nullptr ? env_core : "unset");
  double peak = 0, bw = 0;
  for (int round = 0; round < rounds; ++round) {
    peak = MeasureFmaPeak();
    bw = MeasureReadBandwidth();
    const double fma_bound = peak / fma_per_completion;
    const double bw_bound8 = bw / p_bytes * 8;
    const double tighter8 = std::min(fma_bound, bw_bound8);
    r8 = Rate(u, total, 8, 1);
    rbig1 = Rate(u, total, 256, 1);
    const bool blas = rbig1.large.rfind("openblas", 0) == 0;
    rbigk = blas ? Rate(u, total, 256, 1, "kernels") : rbig1;
    rbigall = cores > 1 ? Rate(u, total, 256, cores) : rbig1;
    r8all = cores > 1 ? Rate(u, total, 8, cores) : r8;
    peaks.push_back(peak);
    bws.push_back(bw);
    q8.push_back(r8.rate / tighter8);
    qbig.push_back(rbig1.rate / fma_bound);
    qbigk.push_back(rbigk.rate / fma_bound);
    qall.push_back(rbigall.rate / rbig1.rate);
    q8all.push_back(r8all.rate / r8.rate);
    std::printf("round %d: FMA peak (%s) %.1f GFMA/s, read %.1f GB/s; batches of 8: "
                "%.0f/s = %.2f x the %s bound; batches of 256 (%s): %.0f/s = %.2f x "
                "the FMA bound (%s: %.2f); %d cores: %.2f x one core (256), %.2f (8)\n",
                round + 1, FmaPeakIsa(), peak / 1e9, bw / 1e9, r8.rate, q8.back(),
                fma_bound < bw_bound8 ? "FMA" : "bandwidth", rbig1.large.c_str(),
                rbig1.rate, qbig.back(), rbigk.large.c_str(), qbigk.back(), cores,
                qall.back(), q8all.back());
  }
  const double mpeak = Median(peaks), mbw = Median(bws);
  const double fma_bound = mpeak / fma_per_completion;
  const double bw_bound8 = mbw / p_bytes * 8;
  std::printf("limits (one core, medians of %d rounds):\n", rounds);
  std::printf("  FMA peak (%s):        %8.1f GFMA/s fp32 -> exact-RLS bound %7.0f completions/s\n",
              FmaPeakIsa(), mpeak / 1e9, fma_bound);
  std::printf("  read bandwidth:          %8.1f GB/s -> batches of 8 bound %7.0f completions/s\n",
              mbw / 1e9, bw_bound8);
  std::printf("  plain 4096-float dot:    %8.2f M/s\n", MeasurePlainDot(4096) / 1e6);
  std::printf("RLS at d = 4096 (%lld completions each; ratios: medians over %d rounds, each to its own round's limits):\n",
              static_cast<long long>(total), rounds);
  std::printf("  batches of 8,  1 core:   %.2f x the tighter limit (%s)  [target >= 0.6]\n",
              Median(q8), fma_bound < bw_bound8 ? "FMA" : "bandwidth");
  std::printf("  batches of 256, 1 core:  %.2f x the FMA bound (1.5 (d+1)^2 multiply-adds per completion; %s)  [target >= 0.7]\n",
              Median(qbig), rbig1.large.c_str());
  if (rbigk.large != rbig1.large) {
    std::printf("  batches of 256, 1 core, hand kernels (%s): %.2f x the FMA bound\n",
                rbigk.large.c_str(), Median(qbigk));
  }
  std::printf("  batches of 256, %d cores: %.2f x one core  [target >= 1.6]\n",
              cores, Median(qall));
  std::printf("  batches of 8,  %d cores:  %.2f x one core\n", cores, Median(q8all));
  std::printf("  where the time goes (last round):\n");
  PrintPhases("batches of 8", r8, total, 8, 1, peak, bw);
  PrintPhases("batches of 256", rbig1, total, 256, 1, peak, bw);
  if (rbigk.large != rbig1.large) {
    PrintPhases("batches of 256", rbigk, total, 256, 1, peak, bw);
  }
  if (cores > 1) PrintPhases("batches of 256", rbigall, total, 256, cores, peak, bw);
  std::printf("load average at end: %s\n", LoadAverage().c_str());
  return 0;
}

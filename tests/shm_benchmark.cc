// shm_benchmark: the shared-memory data plane at d = 4096 beside the gRPC
// Connect stream, measured in one run on this machine.
//
// Starts leapd (all its threads pinned to one core) with a d = 4096 readout
// and runs the engine side in this process (pinned to another core):
//   1. shm, slots filled ahead of time (as when the GPU's DMA fills them):
//      sustained predictions/s, each request cancelled once predicted (so
//      the live set and the slots turn over), leapd and engine CPU use;
//   2. shm, the engine writes every feature vector itself (fp32, bf16);
//   3. shm single-request round trips at moderate rates (p50/p99/max);
//   4. gRPC Connect on a unix socket (leapctl bench: batched throughput and
//      single-request latency) against the same leapd.
// Usage: shm_benchmark [--seconds S] [--slots N] [--batch B] [--spin-us U]
//                      [--ring-kib K] [--leapd-spin-us U] [--json]
#include <sched.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/half.h"
#include "engine_shim/shm_channel.h"
#include "tests/support/engine_client.h"
#include "tests/support/process.h"
#include "tests/support/scoped_temp_dir.h"
#include "client/bench.h"

namespace {

namespace pb = ::leap::v1;
using leap::shim::ShmChannel;
using leap::shim::ShmIncoming;

constexpr int64_t kDim = 4096;

double Now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// utime + stime of a process, seconds.
double ProcessCpu(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/stat"));
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t close = s.rfind(')');
  std::istringstream in(s.substr(close + 2));
  std::string tok;
  double ticks = 0;
  for (int field = 3; in >> tok; ++field) {
    if (field == 14 || field == 15) ticks += std::stod(tok);
    if (field == 15) break;
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

double SelfCpu() {
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_utime.tv_usec * 1e-6 + u.ru_stime.tv_sec +
         u.ru_stime.tv_usec * 1e-6;
}

void PinProcess(pid_t pid, int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  for (const auto& e : std::filesystem::directory_iterator(
           absl::StrCat("/proc/", pid, "/task"))) {
    sched_setaffinity(std::stoi(e.path().filename().string()), sizeof(set), &set);
  }
}

struct Throughput {
  double per_s = 0;
  int64_t predictions = 0, errors = 0;
  double leapd_cores = 0, engine_cores = 0;
};

// Sustained prediction loop over one attachment. `sources` (null: slots are
// filled once, ahead of time) are copied into each slot before submission.
Throughput RunThroughput(ShmChannel& ch, pid_t leapd, double seconds, int batch,
                         const std::vector<std::string>* sources) {
  const uint32_t n = ch.slot_count();
  std::vector<std::string> ids(n);
  for (uint32_t s = 0; s < n; ++s) ids[s] = absl::StrCat("s", s);
  std::vector<ShmChannel::Record> records;
  ShmIncoming in;
  pb::EngineMessage cancels;
  std::vector<absl::string_view> cancel_ids;
  std::vector<uint32_t> free_slots;
  Throughput t;
  uint64_t seq = 1;
  size_t next_source = 0;
  const double c0 = ProcessCpu(leapd), e0 = SelfCpu(), t0 = Now();
  while (Now() - t0 < seconds) {
    // Submit everything free, in frames of `batch` records.
    for (;;) {
      records.clear();
      free_slots.clear();
      ch.AcquireSlots(batch, &free_slots);
      for (uint32_t s : free_slots) {
        if (sources != nullptr) {
          const std::string& x = (*sources)[next_source++ % sources->size()];
          std::memcpy(ch.slot(s), x.data(), x.size());
        }
        records.push_back({s, ids[s], "", 0});
      }
      if (records.empty()) break;
      if (!ch.SendFeatures(seq++, records).ok()) return t;
      if (static_cast<int>(records.size()) < batch) break;
    }
    ch.Flush();
    // Drain answers; cancel what was predicted (frees slots via releases).
    for (int frames = 0; frames < 64; ++frames) {
      absl::Status s = ch.Receive(&in, frames == 0 ? absl::Milliseconds(50)
                                                   : absl::ZeroDuration());
      if (!s.ok()) break;
      if (in.kind != ShmIncoming::Kind::kPredictions) continue;
      cancel_ids.clear();
      for (const auto& p : in.predictions) cancel_ids.push_back(p.request_id);
      t.predictions += static_cast<int64_t>(in.predictions.size());
      t.errors += static_cast<int64_t>(in.errors.size());
      if (!cancel_ids.empty() && !ch.SendCancels(seq++, cancel_ids).ok()) return t;
    }
    ch.Flush();
  }
  const double wall = Now() - t0;
  t.per_s = t.predictions / wall;
  t.leapd_cores = (ProcessCpu(leapd) - c0) / wall;
  t.engine_cores = (SelfCpu() - e0) / wall;
  // Let the tail finish so the next phase starts clean.
  const double drain_until = Now() + 5;
  while (ch.free_slots() < n && Now() < drain_until) {
    absl::Status s = ch.Receive(&in, absl::Milliseconds(10));
    if (s.ok() && in.kind == ShmIncoming::Kind::kPredictions && !in.predictions.empty()) {
      cancels.Clear();
      cancels.set_seq(seq++);
      for (const auto& p : in.predictions) {
        cancels.mutable_cancels()->add_request_ids(std::string(p.request_id));
      }
      ch.SendProto(cancels).IgnoreError();
      ch.Flush();
    }
  }
  return t;
}

struct Latency {
  double rate = 0;
  int64_t samples = 0;
  double p50 = 0, p99 = 0, max = 0;
};

// One request at a time, paced at `rate` per second: submit, spin until its
// prediction, cancel it.
Latency RunLatency(ShmChannel& ch, double rate, int samples) {
  Latency l;
  l.rate = rate;
  std::vector<double> rtt;
  ShmIncoming in;
  uint64_t seq = 1'000'000;
  const double gap = 1.0 / rate;
  double next = Now();
  for (int i = 0; i < samples + 100; ++i) {
    while (Now() < next) {
    }
    next += gap;
    int64_t slot = ch.AcquireSlot();
    while (slot < 0) {
      ch.Receive(&in, absl::Milliseconds(1)).IgnoreError();
      slot = ch.AcquireSlot();
    }
    const std::string id = absl::StrCat("l", slot);
    ShmChannel::Record r{static_cast<uint32_t>(slot), id, "", 0};
    const uint64_t my = seq++;
    const double t0 = Now();
    if (!ch.SendFeatures(my, {&r, 1}).ok()) break;
    ch.Flush();
    for (;;) {
      absl::Status s = ch.Receive(&in, absl::Seconds(1));
      if (!s.ok() && !absl::IsDeadlineExceeded(s)) return l;
      if (s.ok() && in.kind == ShmIncoming::Kind::kPredictions && in.seq == my) break;
    }
    const double dt = Now() - t0;
    if (i >= 100) rtt.push_back(dt * 1e6);  // after warm-up
    const absl::string_view one = id;
    ch.SendCancels(seq++, {&one, 1}).IgnoreError();
    ch.Flush();
  }
  std::sort(rtt.begin(), rtt.end());
  l.samples = static_cast<int64_t>(rtt.size());
  if (!rtt.empty()) {
    l.p50 = rtt[rtt.size() / 2];
    l.p99 = rtt[std::min(rtt.size() - 1, rtt.size() * 99 / 100)];
    l.max = rtt.back();
  }
  return l;
}

std::vector<std::string> Sources(int n, bool bf16) {
  std::mt19937 rng(7);
  std::normal_distribution<float> g;
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) {
    std::vector<float> x(kDim);
    for (auto& v : x) v = g(rng);
    if (!bf16) {
      out.emplace_back(reinterpret_cast<const char*>(x.data()), x.size() * 4);
    } else {
      std::vector<uint16_t> h(kDim);
      for (int64_t j = 0; j < kDim; ++j) h[j] = leap::FloatToBf16(x[j]);
      out.emplace_back(reinterpret_cast<const char*>(h.data()), h.size() * 2);
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 5;
  // Defaults: what measured best on the 2-core development VM (8 MiB L3):
  // 192 slots = 3 MiB fp32 arena, rings of 256 KiB; leapd's --shm_spin as
  // shipped (50 us).
  int slots = 192, batch = 32, spin_us = 200, ring_kib = 256, leapd_spin_us = 50;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--seconds" && i + 1 < argc) {
      seconds = std::stod(argv[++i]);
    } else if (a == "--slots" && i + 1 < argc) {
      slots = std::stoi(argv[++i]);
    } else if (a == "--batch" && i + 1 < argc) {
      batch = std::stoi(argv[++i]);
    } else if (a == "--spin-us" && i + 1 < argc) {
      spin_us = std::stoi(argv[++i]);
    } else if (a == "--ring-kib" && i + 1 < argc) {
      ring_kib = std::stoi(argv[++i]);
    } else if (a == "--leapd-spin-us" && i + 1 < argc) {
      leapd_spin_us = std::stoi(argv[++i]);
    } else if (a == "--json") {
      json = true;
    } else {
      std::fprintf(stderr,
                   "usage: shm_benchmark [--seconds S] [--slots N] [--batch B] [--spin-us U] "
                   "[--ring-kib K] [--leapd-spin-us U] [--json]\n");
      return 2;
    }
  }
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  const leap::testing::ScopedTempDir tmp("shm-bench");
  const std::string& dir = tmp.path();
  const std::string sock = "unix://" + dir + "/leapd.sock";
  const std::string shm_path = dir + "/leap.shm";
  std::string addr;
  auto leapd = leap::testing::StartLeapd(
      LEAPD_PATH,
      {"--listen=" + sock, "--shm=" + shm_path,
       absl::StrCat("--shm_spin=", leapd_spin_us, "us")},
      &addr);
  if (!leapd.ok()) {
    std::fprintf(stderr, "cannot start leapd: %s\n", leapd.status().ToString().c_str());
    return 1;
  }
  const pid_t pid = (*leapd)->pid();
  {
    auto admin = pb::Admin::NewStub(leap::testing::MakeChannel(sock));
    grpc::ClientContext ctx;
    pb::CreateReadoutRequest req;
    req.set_name("bench");
    req.mutable_cold_start()->set_dim(kDim);
    req.mutable_cold_start()->set_lambda(1.0);
    pb::ReadoutInfo info;
    grpc::Status s = admin->CreateReadout(&ctx, req, &info);
    grpc::ClientContext rctx;
    pb::SetRouteRequest route;
    route.mutable_route()->add_arms()->set_readout("bench");
    route.mutable_route()->mutable_arms(0)->set_percent(100);
    pb::Route out;
    grpc::Status r = admin->SetRoute(&rctx, route, &out);
    if (!s.ok() || !r.ok()) {
      std::fprintf(stderr, "cannot create the readout: %s %s\n",
                   s.error_message().c_str(), r.error_message().c_str());
      return 1;
    }
  }
  const int leapd_cpu = cores > 1 ? 1 : 0;
  PinProcess(pid, leapd_cpu);
  PinProcess(getpid(), 0);

  auto attach = [&](pb::FeatureDType dtype) {
    leap::shim::ShmChannelOptions o;
    o.path = shm_path;
    o.hello.set_engine_id("shm-benchmark");
    o.hello.set_dim(kDim);
    o.hello.set_dtype(dtype);
    o.slots = static_cast<uint32_t>(slots);
    o.ring_bytes = static_cast<uint32_t>(ring_kib) << 10;
    o.spin = absl::Microseconds(spin_us);
    pb::SidecarMessage ack;
    auto ch = ShmChannel::Attach(o, &ack);
    if (!ch.ok()) {
      std::fprintf(stderr, "attach: %s\n", ch.status().ToString().c_str());
      std::exit(1);
    }
    PinProcess(pid, leapd_cpu);  // leapd threads born since
    return *std::move(ch);
  };

  std::printf("shm_benchmark: %s, %d cores; leapd pinned to cpu %d, engine to cpu 0\n",
              leap::client::CpuModel().c_str(), cores, leapd_cpu);
  std::printf("d = %ld, %d slots per engine, %d records per frame, rings %d KiB, "
              "engine spin %d us, leapd --shm_spin %d us, %.0f s per phase\n",
              static_cast<long>(kDim), slots, batch, ring_kib, spin_us, leapd_spin_us,
              seconds);

  auto f32 = attach(pb::FEATURE_DTYPE_FLOAT32);
  const std::vector<std::string> src32 = Sources(64, false);
  for (uint32_t s = 0; s < f32->slot_count(); ++s) {
    std::memcpy(f32->slot(s), src32[s % src32.size()].data(), src32[0].size());
  }
  std::printf("arena: %zu KiB fp32 (%s this machine's L3)\n", f32->arena_bytes() >> 10,
              f32->arena_bytes() <= (size_t{8} << 20) ? "fits" : "exceeds");
  std::fflush(stdout);

  const Throughput pre = RunThroughput(*f32, pid, seconds, batch, nullptr);
  std::printf("shm fp32, slots filled ahead:    %10.0f predictions/s  leapd %.2f cores, engine %.2f cores (%ld errors)\n",
              pre.per_s, pre.leapd_cores, pre.engine_cores, static_cast<long>(pre.errors));
  std::fflush(stdout);
  const Throughput w32 = RunThroughput(*f32, pid, seconds, batch, &src32);
  std::printf("shm fp32, engine writes features: %10.0f predictions/s  leapd %.2f cores, engine %.2f cores\n",
              w32.per_s, w32.leapd_cores, w32.engine_cores);
  std::fflush(stdout);
  std::vector<Latency> lat;
  for (double rate : {10'000.0, 50'000.0}) {
    lat.push_back(RunLatency(*f32, rate, 20'000));
    std::printf("shm round trip at %6.0f/s:       p50 %.1f us  p99 %.1f us  max %.1f us (%ld samples)\n",
                rate, lat.back().p50, lat.back().p99, lat.back().max,
                static_cast<long>(lat.back().samples));
    std::fflush(stdout);
  }
  f32.reset();

  auto b16 = attach(pb::FEATURE_DTYPE_BFLOAT16);
  const std::vector<std::string> src16 = Sources(64, true);
  const Throughput wb16 = RunThroughput(*b16, pid, seconds, batch, &src16);
  std::printf("shm bf16, engine writes features: %10.0f predictions/s  leapd %.2f cores, engine %.2f cores\n",
              wb16.per_s, wb16.leapd_cores, wb16.engine_cores);
  for (uint32_t s = 0; s < b16->slot_count(); ++s) {
    std::memcpy(b16->slot(s), src16[s % src16.size()].data(), src16[0].size());
  }
  const Throughput preb = RunThroughput(*b16, pid, seconds, batch, nullptr);
  std::printf("shm bf16, slots filled ahead:    %10.0f predictions/s  leapd %.2f cores, engine %.2f cores\n",
              preb.per_s, preb.leapd_cores, preb.engine_cores);
  std::fflush(stdout);
  b16.reset();

  // gRPC Connect against the same (pinned) leapd.
  leap::client::BenchOptions bo;
  bo.server.address = sock;
  bo.dim = kDim;
  bo.seconds = seconds;
  bo.readout = "bench";
  bo.product_line = "";
  auto grpc_report = leap::client::RunBench(bo, [](const std::string&) {});
  if (grpc_report.ok()) {
    std::printf("grpc Connect fp32 (unix socket, batch %ld, %ld streams): %10.0f predictions/s; "
                "single request p50 %.1f us  p99 %.1f us\n",
                static_cast<long>(bo.batch), static_cast<long>(bo.streams),
                grpc_report->predictions_per_s, grpc_report->latency_p50_us,
                grpc_report->latency_p99_us);
    std::printf("shm / grpc throughput (slots filled ahead): %.1fx\n",
                pre.per_s / grpc_report->predictions_per_s);
  } else {
    std::printf("grpc bench failed: %s\n", grpc_report.status().ToString().c_str());
  }
  if (json) {
    std::printf(
        "{\"cpu\": \"%s\", \"cores\": %d, \"dim\": %ld, \"slots\": %d, \"batch\": %d, "
        "\"shm_prefilled_fp32_per_s\": %.0f, \"shm_prefilled_fp32_leapd_cores\": %.2f, "
        "\"shm_write_fp32_per_s\": %.0f, \"shm_write_bf16_per_s\": %.0f, "
        "\"shm_prefilled_bf16_per_s\": %.0f, \"shm_p99_us_10k\": %.1f, \"shm_p99_us_50k\": %.1f, "
        "\"grpc_per_s\": %.0f}\n",
        leap::client::CpuModel().c_str(), cores, static_cast<long>(kDim), slots, batch, pre.per_s,
        pre.leapd_cores, w32.per_s, wb16.per_s, preb.per_s, lat[0].p99, lat[1].p99,
        grpc_report.ok() ? grpc_report->predictions_per_s : 0.0);
  }
  (*leapd)->Signal(SIGTERM);
  (*leapd)->Wait();
  return 0;
}

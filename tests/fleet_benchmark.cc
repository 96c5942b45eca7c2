// Fleet mode benchmark (issue 12): a NATS JetStream cluster on loopback
// (3 nodes, R3 streams by default), --members leapd members (m0 trains:
// the others run --fleet_trainer=never), one cold readout of width
// d = 4096, clients in this process sending Predict + Complete to the
// members in turn.
//   1. this machine's exact-RLS bound: its FP32 FMA peak over the FMAs of
//      an exact update, for one core and all cores; and RlsState::Update in
//      this process, batches of 64, on one thread and on all cores;
//   2. sustained fleet throughput: closed-loop clients for --seconds; the
//      acknowledged completions/s and the learned completions/s (from
//      acknowledgement of the first to a version including the last, on
//      every member), the trainer's rate as a ratio of the bound for the
//      cores it may use (--trainer_cpus);
//   3. staleness at each steady rate of --rates completions/s fleet-wide:
//      for each completion, from its acknowledgement
//      (CompleteResponse.fleet_seq) to the first moment every member's
//      WatchReadout has shown a version with fleet_seq >= it; p50, p99,
//      max; split into ack -> the trainer published such a version
//      (ReadoutVersion.published_unix_ms) and that publish -> served by all.
// After each phase: where the trainer's worker spent its time
// (leap_fleet_trainer_seconds_total by stage, scraped from m0), its RLS
// batches (mean size) and apply time per completion; the CPU each process
// used per wall second (this process = the clients, the nats-servers, each
// member, and m0's trainer worker and checkpoint threads by name), so the
// share of the cores each took is measured in the same run; with the
// trainer on one core, its completions per CPU-second of the worker thread
// as a ratio of the one-core bound (its efficiency in the CPU it got,
// whatever else ran). Before anything is sent, every member must have
// applied readout r and its route from CONFIG (CreateReadout and SetRoute
// on m0 return before the other members have them); then a warm-up (not
// measured) lets the trainer load the readout's creation state. Clients'
// failures are printed with their gRPC status, and a member that never
// served a version is reported with its watch's state and what it serves.
// Prints the CPU model, kernel set, core count and `uptime` (other load
// changes figures).
//   fleet_benchmark [--dim=4096] [--seconds=10] [--rates=100,200,500]
//                   [--clients=6] [--nats_nodes=3] [--members=3]
//                   [--trainer_cpus=N (m0 pinned to CPUs 0..N-1: its RLS uses
//                   N threads; 0 = all)] [--version_interval_ms=200]
//                   [--nats_gomaxprocs=N (GOMAXPROCS of the nats-servers;
//                   0 = Go's default, the machine's cores)]
//                   [--sustained=1] [--leapd=PATH (default: the one built
//                   beside it)] [--trainer_args=--flag=v,--flag=v (more
//                   flags for m0, e.g. --fleet_checkpoint_every_s=3600)]
// Each phase also prints the most threads each member had while it ran
// (sampled from /proc every 20 ms): a call that holds a thread while it
// waits for JetStream shows there.
// A benchmark program, not a ctest test. Release build.
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "Eigen/Core"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/match.h"
#include "absl/strings/ascii.h"
#include "readout/internal/machine_probe.h"
#include "readout/rls.h"
#include "tests/support/bench_load.h"
#include "tests/support/engine_client.h"
#include "tests/support/nats_cluster.h"
#include "tests/support/process.h"
#include "tests/support/scoped_temp_dir.h"

namespace pb = ::leap::v1;
using Clock = std::chrono::steady_clock;

namespace {

using leap::testing::IntFlag;
using leap::testing::Ms;
using leap::testing::NowUnixMs;
using leap::testing::Pct;
using leap::testing::Sh;
using leap::testing::StrFlag;
using Seen = leap::testing::SeenVersion;
using Watcher = leap::testing::VersionWatcher;
using Acked = leap::testing::AckedCompletion;

// leap_fleet_trainer_seconds_total by stage from a /metrics page, and the
// trainer's completions applied and RLS batches (keys "#applied",
// "#batches").
std::map<std::string, double> StageSeconds(const std::string& metrics) {
  std::map<std::string, double> out;
  for (absl::string_view line : absl::StrSplit(metrics, '\n')) {
    for (const auto& [metric, key] :
         {std::pair<const char*, const char*>{
              "leap_fleet_trainer_completions_applied_total{", "#applied"},
          {"leap_fleet_trainer_batches_total{", "#batches"},
          {"leap_fleet_trainer_lease_lost_total", "#lease_lost"},
          {"leap_fleet_trainer_terms_total", "#terms"}}) {
      double v = 0;
      if (absl::StartsWith(line, metric) &&
          absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v)) {
        out[key] += v;
      }
    }
    if (absl::StartsWith(line, "leap_fleet_trainer_checkpoints_total{")) {
      double v = 0;
      if (absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v)) {
        out[line.find("where=\"local\"") != absl::string_view::npos ? "#ckpt_local"
                                                                     : "#ckpt_fleet"] += v;
      }
      continue;
    }
    if (!absl::StartsWith(line, "leap_fleet_trainer_seconds_total{")) continue;
    const size_t at = line.find("stage=\"");
    if (at == absl::string_view::npos) continue;
    const size_t end = line.find('"', at + 7);
    double v = 0;
    if (!absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v)) continue;
    out[std::string(line.substr(at + 7, end - at - 7))] += v;
  }
  return out;
}

std::string StageReport(const std::map<std::string, double>& before,
                        const std::map<std::string, double>& after, double wall_s) {
  std::string out;
  auto delta = [&](const std::string& key) {
    auto a = after.find(key);
    auto b = before.find(key);
    return (a == after.end() ? 0 : a->second) - (b == before.end() ? 0 : b->second);
  };
  for (const auto& [stage, v] : after) {
    if (stage[0] == '#') continue;
    const double d = delta(stage);
    absl::StrAppend(&out, out.empty() ? "" : ", ", stage, " ",
                    absl::StrFormat("%.2f s (%.0f%%)", d, 100 * d / wall_s));
  }
  const double applied = delta("#applied"), batches = delta("#batches");
  if (batches > 0) {
    absl::StrAppend(&out, absl::StrFormat("; %.0f completions in %.0f RLS batches "
                                          "(mean %.1f), apply %.0f us/completion",
                                          applied, batches, applied / batches,
                                          1e6 * delta("apply") / applied));
  }
  absl::StrAppend(&out, absl::StrFormat("; checkpoints written: %.0f local, %.0f fleet",
                                        delta("#ckpt_local"), delta("#ckpt_fleet")));
  // A new term (the lease lost under load and won again) restarts the
  // worker thread: its CPU figures for this phase are then not comparable.
  if (delta("#lease_lost") > 0 || delta("#terms") > 0) {
    absl::StrAppend(&out, absl::StrFormat("; LEASE LOST %.0f time(s), %.0f new term(s)",
                                          delta("#lease_lost"), delta("#terms")));
  }
  return out;
}

// The most threads each process had while this object lived (sampled from
// /proc/PID/status every 20 ms on its own thread).
class ThreadPeak {
 public:
  explicit ThreadPeak(std::vector<pid_t> pids)
      : pids_(std::move(pids)), peak_(pids_.size(), 0) {
    thread_ = std::thread([this] {
      while (!stop_.load()) {
        for (size_t i = 0; i < pids_.size(); ++i) {
          std::ifstream f(absl::StrCat("/proc/", pids_[i], "/status"));
          std::string line;
          while (std::getline(f, line)) {
            int64_t n = 0;
            if (absl::StartsWith(line, "Threads:") &&
                absl::SimpleAtoi(absl::StripAsciiWhitespace(line.substr(8)), &n)) {
              peak_[i] = std::max(peak_[i], n);
            }
          }
        }
        // Benchmark bookkeeping, not a test: a sampling period.
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    });
  }
  ~ThreadPeak() { Stop(); }
  // Stops sampling; "m0 N, m1 N, ...".
  std::string Stop() {
    if (!stop_.exchange(true)) thread_.join();
    std::string out;
    for (size_t i = 0; i < peak_.size(); ++i) {
      absl::StrAppend(&out, i == 0 ? "" : ", ", "m", i, " ", peak_[i]);
    }
    return out;
  }

 private:
  const std::vector<pid_t> pids_;
  std::vector<int64_t> peak_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// CPU seconds (user + system) from a /proc/.../stat line; 0 when unreadable.
double StatCpuSeconds(const std::string& path, std::string* comm = nullptr,
                      long* ppid = nullptr) {
  std::ifstream f(path);
  std::string line;
  if (!std::getline(f, line)) return 0;
  const size_t open = line.find('('), close = line.rfind(')');
  if (open == std::string::npos || close == std::string::npos) return 0;
  if (comm != nullptr) *comm = line.substr(open + 1, close - open - 1);
  std::vector<std::string> f3 = absl::StrSplit(line.substr(close + 2), ' ');
  // After "pid (comm) ": state ppid ... utime (14th field) stime (15th).
  if (f3.size() < 13) return 0;
  if (ppid != nullptr && !absl::SimpleAtoi(f3[1], ppid)) *ppid = 0;
  double ut = 0, st = 0;
  if (!absl::SimpleAtod(f3[11], &ut) || !absl::SimpleAtod(f3[12], &st)) return 0;
  return (ut + st) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// CPU seconds so far of: this process (the clients and the version
// watchers), the nats-server children, each member, and m0's trainer
// threads by name (its worker "leap-trainer", its checkpoint thread
// "leap-trainer-ck").
std::map<std::string, double> CpuSample(const std::vector<pid_t>& members) {
  std::map<std::string, double> out;
  out["clients"] = StatCpuSeconds("/proc/self/stat");
  const long self = static_cast<long>(getpid());
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.empty() || !absl::ascii_isdigit(name[0])) continue;
    std::string comm;
    long ppid = 0;
    const double secs = StatCpuSeconds(e.path().string() + "/stat", &comm, &ppid);
    if (ppid == self && comm == "nats-server") out["nats"] += secs;
  }
  for (size_t i = 0; i < members.size(); ++i) {
    out[absl::StrCat("m", i)] = StatCpuSeconds(absl::StrCat("/proc/", members[i], "/stat"));
  }
  if (!members.empty()) {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(
             absl::StrCat("/proc/", members[0], "/task"), ec)) {
      std::string comm;
      const double secs = StatCpuSeconds(e.path().string() + "/stat", &comm);
      if (comm == "leap-trainer") out["m0 trainer worker"] += secs;
      if (comm == "leap-trainer-ck") out["m0 trainer checkpoint"] += secs;
    }
  }
  return out;
}

// "name X.XX, ..." CPU seconds per wall second between two samples (1.00 =
// one core busy), and the total of the processes.
std::string CpuReport(const std::map<std::string, double>& before,
                      const std::map<std::string, double>& after, double wall_s,
                      long cores) {
  std::string out;
  double total = 0;
  for (const auto& [name, v] : after) {
    auto b = before.find(name);
    const double d = (v - (b == before.end() ? 0 : b->second)) / wall_s;
    if (name.find(' ') == std::string::npos) total += d;
    absl::StrAppend(&out, out.empty() ? "" : ", ", name, absl::StrFormat(" %.2f", d));
  }
  absl::StrAppend(&out, absl::StrFormat("; total %.2f of %ld cores", total, cores));
  return out;
}

// CPU milliseconds per acknowledged completion by kind of process between
// two samples: clients, the nats-servers together, the members' serving
// work together (m0 without its trainer threads, and the others), m0's
// trainer worker and its checkpoint thread. Much less sensitive to other
// load on the machine than the rates.
std::string CpuPerCompletion(const std::map<std::string, double>& before,
                             const std::map<std::string, double>& after,
                             size_t completions) {
  if (completions == 0) return "no completions";
  auto d = [&](const std::string& k) {
    auto a = after.find(k);
    auto b = before.find(k);
    return (a == after.end() ? 0 : a->second) - (b == before.end() ? 0 : b->second);
  };
  double members = 0, all = 0;
  for (const auto& [name, v] : after) {
    if (name.find(' ') != std::string::npos) continue;
    all += d(name);
    if (name[0] == 'm') members += d(name);
  }
  const double worker = d("m0 trainer worker"), ck = d("m0 trainer checkpoint");
  members -= worker + ck;
  const double per = 1000.0 / static_cast<double>(completions);
  return absl::StrFormat("clients %.2f, nats %.2f, members' serving %.2f, trainer worker "
                         "%.2f, trainer checkpoint %.2f; all %.2f",
                         d("clients") * per, d("nats") * per, members * per, worker * per,
                         ck * per, all * per);
}

// The trainer's exact-RLS efficiency in the CPU it got: completions
// applied per CPU-second of its worker thread, as a ratio of the one-core
// bound. Meaningful with RLS on one thread (helper threads of a
// multi-threaded update are not the worker's).
std::string TrainerEfficiency(const std::map<std::string, double>& stages_before,
                              const std::map<std::string, double>& stages_after,
                              const std::map<std::string, double>& cpu_before,
                              const std::map<std::string, double>& cpu_after,
                              double bound1) {
  auto delta = [](const std::map<std::string, double>& b,
                  const std::map<std::string, double>& a, const std::string& k) {
    auto ia = a.find(k);
    auto ib = b.find(k);
    return (ia == a.end() ? 0 : ia->second) - (ib == b.end() ? 0 : ib->second);
  };
  const double applied = delta(stages_before, stages_after, "#applied");
  const double cpu = delta(cpu_before, cpu_after, "m0 trainer worker");
  if (applied <= 0 || cpu <= 0) return "no completions applied";
  return absl::StrFormat("%.0f completions per CPU-second of the worker thread = %.2g of "
                         "the one-core exact-RLS bound",
                         applied / cpu, applied / cpu / bound1);
}

// Waits until the leapd at `address` has readout `name` and a default
// route (polling its Admin API); false with *why after `timeout`.
bool MemberServesReadout(const std::string& address, const std::string& name,
                         std::chrono::seconds timeout, std::string* why) {
  auto admin = pb::Admin::NewStub(leap::testing::MakeChannel(address));
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    grpc::ClientContext rctx;
    pb::GetReadoutRequest rq;
    rq.set_name(name);
    pb::ReadoutInfo info;
    grpc::Status st = admin->GetReadout(&rctx, rq, &info);
    if (st.ok()) {
      grpc::ClientContext lctx;
      pb::ListRoutesResponse routes;
      st = admin->ListRoutes(&lctx, pb::ListRoutesRequest(), &routes);
      if (st.ok()) {
        for (const pb::Route& r : routes.routes()) {
          if (r.product_line().empty()) return true;
        }
        st = grpc::Status(grpc::StatusCode::NOT_FOUND, "no default route yet");
      }
    }
    *why = leap::testing::StatusText(st);
    if (Clock::now() >= deadline) return false;
    // Benchmark bookkeeping, not a test: a short poll of another process.
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// "version V, fleet_seq S" of what the leapd at `address` serves now (the
// first message of a new WatchReadout), or why it cannot say.
std::string ServingNow(const std::string& address, const std::string& name) {
  auto stub = pb::Predictor::NewStub(leap::testing::MakeChannel(address));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  pb::WatchReadoutRequest req;
  req.set_readout(name);
  auto w = stub->WatchReadout(&ctx, req);
  pb::ReadoutVersion v;
  if (w->Read(&v)) {
    ctx.TryCancel();
    w->Finish().IgnoreError();
    return absl::StrCat("version ", v.version(), ", fleet_seq ", v.fleet_seq());
  }
  return leap::testing::StatusText(w->Finish());
}

}  // namespace

int main(int argc, char** argv) {
  // As leapd does at its start: OpenBLAS on one thread, so the in-process
  // RlsState figure below is the one the trainer gets.
  leap::readout::PrepareOpenBlasForRls();
  const int64_t dim = IntFlag(argc, argv, "dim", 4096);
  const int64_t seconds = IntFlag(argc, argv, "seconds", 10);
  const std::string rates_flag = StrFlag(argc, argv, "rates", "100,200,500");
  const int64_t clients = IntFlag(argc, argv, "clients", 6);
  const int nats_nodes = static_cast<int>(IntFlag(argc, argv, "nats_nodes", 3));
  const int n_members = static_cast<int>(IntFlag(argc, argv, "members", 3));
  const int64_t trainer_cpus = IntFlag(argc, argv, "trainer_cpus", 0);
  const int64_t interval_ms = IntFlag(argc, argv, "version_interval_ms", 200);
  const bool sustained = IntFlag(argc, argv, "sustained", 1) != 0;
  const std::string leapd_path = StrFlag(argc, argv, "leapd", LEAPD_PATH);
  const int64_t nats_procs = IntFlag(argc, argv, "nats_gomaxprocs", 0);
  const std::vector<std::string> trainer_args = absl::StrSplit(
      StrFlag(argc, argv, "trainer_args", ""), ',', absl::SkipEmpty());
  std::vector<int64_t> rates;
  for (absl::string_view r : absl::StrSplit(rates_flag, ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (absl::SimpleAtoi(r, &v) && v > 0) rates.push_back(v);
  }
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  const long trainer_cores = trainer_cpus > 0 ? std::min<long>(trainer_cpus, cores) : cores;
  std::printf("cpu: %s; %ld cores; kernel %s\nuptime: %s\n",
              leap::readout::internal::CpuDescription().c_str(), cores,
              Sh("uname -r").c_str(), Sh("uptime").c_str());
  std::printf("d = %lld, NATS %d node(s) R%d on loopback (GOMAXPROCS %s), %d members (m0 "
              "trains, on %ld of %ld cores), %lld client threads, version interval %lld ms\n",
              static_cast<long long>(dim), nats_nodes, nats_nodes,
              nats_procs > 0 ? absl::StrCat(nats_procs).c_str() : "default", n_members,
              trainer_cores, cores, static_cast<long long>(clients),
              static_cast<long long>(interval_ms));

  // 1. The exact-RLS bound of this machine: its FP32 FMA peak over the
  // 1.5 (d+1)^2 FMAs an exact rank-1 update costs (readout/rls_benchmark's
  // definition), for one core and for the trainer's cores; and what
  // RlsState::Update does here with batches of 64 on one thread and on the
  // trainer's cores.
  const double fma_peak = leap::readout::internal::MeasureFmaPeak();
  const double bound1 = fma_peak / (1.5 * double(dim + 1) * double(dim + 1));
  const double bound_t = bound1 * trainer_cores;
  std::printf("exact-RLS bound at d = %lld: %.0f completions/s on one core "
              "(FMA peak %.1f GFMA/s, %s), %.0f on %ld cores\n",
              static_cast<long long>(dim), bound1, fma_peak / 1e9,
              leap::readout::internal::FmaPeakIsa(), bound_t, trainer_cores);
  std::vector<int> thread_counts = {1};
  if (trainer_cores > 1) thread_counts.push_back(static_cast<int>(trainer_cores));
  for (int threads : thread_counts) {
    const int64_t n = dim + 1, k = 64;
    leap::readout::RlsOptions ro;
    ro.threads = threads;
    leap::readout::RlsState rls(Eigen::VectorXd::Zero(n),
                                leap::readout::SymMatrix::ScaledIdentity(n, 1.0f), ro);
    std::mt19937_64 rng(1);
    std::normal_distribution<float> n01;
    std::vector<float> u(n * k);
    for (float& v : u) v = n01(rng);
    for (int64_t j = 0; j < k; ++j) u[j * n + dim] = 1.0f;
    std::vector<double> y(k, 15.0);
    int64_t done = 0;
    const auto t0 = Clock::now();
    while (Clock::now() - t0 < std::chrono::seconds(3)) {
      if (!rls.Update(u.data(), n, y).ok()) break;
      done += k;
    }
    const double r = done / (Ms(Clock::now() - t0) / 1000);
    std::printf("RlsState::Update here (%s kernels), %d thread(s), batches of %lld: "
                "%.0f completions/s (%.2f of the %d-core bound)\n",
                rls.kernel_name(), threads, static_cast<long long>(k), r,
                r / (bound1 * threads), threads);
  }

  // Before the NATS cluster and the members: removed after they stop.
  const leap::testing::ScopedTempDir tmp("leap-fleet-bench");
  const std::string& dir = tmp.path();
  // The nats-servers inherit it (Go's GOMAXPROCS: the threads running Go
  // code at once; default the machine's cores).
  if (nats_procs > 0) setenv("GOMAXPROCS", absl::StrCat(nats_procs).c_str(), 1);
  leap::testing::NatsClusterOptions no;
  no.nodes = nats_nodes;
  no.dir = dir + "/nats";
  auto nats = leap::testing::NatsCluster::Start(no);
  if (!nats.ok()) {
    std::fprintf(stderr, "%s\n", std::string(nats.status().message()).c_str());
    return 1;
  }
  std::vector<std::unique_ptr<leap::testing::Process>> members;
  std::vector<std::string> addrs;
  std::string trainer_metrics;
  cpu_set_t all_cpus;
  sched_getaffinity(0, sizeof(all_cpus), &all_cpus);
  for (int i = 0; i < n_members; ++i) {
    if (i == 0 && trainer_cpus > 0) {
      // m0 inherits this affinity: its RLS threads (0 = the cores it may
      // run on) and everything else of it run on CPUs 0..N-1.
      cpu_set_t set;
      CPU_ZERO(&set);
      for (int64_t c = 0; c < trainer_cores; ++c) CPU_SET(c, &set);
      sched_setaffinity(0, sizeof(set), &set);
    }
    std::string addr;
    std::vector<std::string> args = {
        absl::StrCat("--data_dir=", dir, "/m", i), "--fleet=" + (*nats)->urls(),
        "--fleet_name=bench", absl::StrCat("--fleet_member=m", i),
        absl::StrCat("--fleet_replicas=", nats_nodes),
        absl::StrCat("--fleet_trainer=", i == 0 ? "auto" : "never"),
        absl::StrCat("--fleet_version_interval_ms=", interval_ms)};
    if (i == 0) args.insert(args.end(), trainer_args.begin(), trainer_args.end());
    auto p = leap::testing::StartLeapd(leapd_path, args, &addr);
    if (i == 0) sched_setaffinity(0, sizeof(all_cpus), &all_cpus);
    if (!p.ok()) {
      std::fprintf(stderr, "member %d: %s\n", i, std::string(p.status().message()).c_str());
      return 1;
    }
    if (i == 0) {
      for (const std::string& l : (*p)->lines()) {
        const std::string prefix = "metrics on http://";
        if (l.rfind(prefix, 0) == 0) {
          trainer_metrics = l.substr(prefix.size());
          trainer_metrics = trainer_metrics.substr(0, trainer_metrics.find('/'));
        }
      }
    }
    members.push_back(std::move(*p));
    addrs.push_back(addr);
  }
  auto stages = [&] {
    if (trainer_metrics.empty()) return std::map<std::string, double>();
    auto body = leap::testing::HttpGet(trainer_metrics, "/metrics");
    return body.ok() ? StageSeconds(*body) : std::map<std::string, double>();
  };
  {
    grpc::Status st = leap::testing::CreateDefaultReadout(addrs[0], "r", dim);
    if (!st.ok()) {
      std::fprintf(stderr, "create: %s\n", st.error_message().c_str());
      return 1;
    }
  }
  // CreateReadout and SetRoute return once m0 has written them to CONFIG;
  // the other members apply them when their CONFIG watcher reads them.
  // Until then a Predict there fails (NOT_FOUND "no route ...") and a
  // WatchReadout ends at once (NOT_FOUND "unknown readout"): a watcher
  // started then would see no version at all. So nothing starts before
  // every member has both.
  for (size_t i = 0; i < addrs.size(); ++i) {
    std::string why;
    if (!MemberServesReadout(addrs[i], "r", std::chrono::seconds(60), &why)) {
      std::fprintf(stderr, "m%zu never applied readout r and its route: %s\n", i,
                   why.c_str());
      return 1;
    }
  }
  std::vector<pid_t> member_pids;
  for (const auto& m : members) member_pids.push_back(m->pid());
  std::vector<std::unique_ptr<Watcher>> watchers;
  for (const std::string& a : addrs) watchers.push_back(std::make_unique<Watcher>(a));

  // Clients: thread c sends to member c % members; paced at per_thread_rate
  // when > 0 (request i due at start + i / rate), closed loop otherwise.
  std::atomic<int64_t> next_id{0};
  auto run_clients = [&](double per_thread_rate, std::vector<Acked>* acked,
                         int64_t* failures) {
    leap::testing::PacedClientsOptions o;
    o.addresses = addrs;
    o.clients = clients;
    o.per_client_rate = per_thread_rate;
    o.seconds = static_cast<double>(seconds);
    o.dim = dim;
    o.require_fleet_seq = true;
    return leap::testing::RunPacedClients(o, &next_id, acked, failures);
  };
  // Waits until every member served fleet_seq >= seq; the time it happened.
  auto wait_all = [&](uint64_t seq) {
    const auto deadline = Clock::now() + std::chrono::seconds(300);
    while (Clock::now() < deadline) {
      bool all = true;
      for (auto& w : watchers) {
        if (w->last_seq() >= seq) continue;
        all = false;
        if (w->state() != "watching") return false;  // it will see nothing more
      }
      if (all) return true;
      // Benchmark bookkeeping, not a test: a short poll of in-process state.
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  };
  // Why wait_all(seq) failed: per member, the newest fleet_seq its watcher
  // saw, how its watch stands, and what it serves now (a new WatchReadout's
  // first message).
  auto report_members = [&](uint64_t seq) {
    for (size_t i = 0; i < watchers.size(); ++i) {
      std::fprintf(stderr,
                   "  m%zu: watcher saw fleet_seq %llu (needed %llu), WatchReadout %s; "
                   "serving now: %s\n",
                   i, static_cast<unsigned long long>(watchers[i]->last_seq()),
                   static_cast<unsigned long long>(seq), watchers[i]->state().c_str(),
                   ServingNow(addrs[i], "r").c_str());
    }
  };
  // The first version with fleet_seq >= seq in a member's log.
  auto first_with = [](const std::vector<Seen>& log, uint64_t seq) {
    return std::find_if(log.begin(), log.end(),
                        [&](const Seen& s) { return s.fleet_seq >= seq; });
  };
  // First time every member has shown fleet_seq >= seq, from their logs.
  auto served_at = [&](const std::vector<std::vector<Seen>>& logs, uint64_t seq) {
    Clock::time_point worst = Clock::time_point::min();
    for (const auto& log : logs) {
      auto it = first_with(log, seq);
      if (it == log.end()) return Clock::time_point::max();
      worst = std::max(worst, it->t);
    }
    return worst;
  };

  // Warm-up, not measured: the trainer reads the creation state (32 MiB of
  // P) from STATE when it starts on the readout; the phases start once
  // every member served a version including every completion acknowledged.
  {
    std::vector<Acked> acked;
    int64_t failures = 0;
    leap::testing::PacedClientsOptions o;
    o.addresses = addrs;
    o.clients = static_cast<int64_t>(addrs.size());
    o.per_client_rate = 5;
    o.seconds = 1;
    o.dim = dim;
    o.require_fleet_seq = true;
    const auto t0 = Clock::now();
    std::vector<std::string> why;
    leap::testing::RunPacedClients(o, &next_id, &acked, &failures, &why);
    for (const std::string& w : why) std::printf("warm-up: failed: %s\n", w.c_str());
    uint64_t max_seq = 0;
    for (const Acked& a : acked) max_seq = std::max(max_seq, a.fleet_seq);
    if (acked.empty() || !wait_all(max_seq)) {
      std::fprintf(stderr, "warm-up: %zu acknowledged, %lld failed, not served\n",
                   acked.size(), static_cast<long long>(failures));
      report_members(max_seq);
      return 1;
    }
    std::printf("warm-up: %zu completions (%lld failed) served by every member %.2f s "
                "after start\n",
                acked.size(), static_cast<long long>(failures),
                Ms(Clock::now() - t0) / 1000);
  }

  // 2. Sustained throughput (closed loop).
  if (sustained) {
    std::vector<Acked> acked;
    int64_t failures = 0;
    const auto before = stages();
    const auto cpu_before = CpuSample(member_pids);
    const auto start = Clock::now();
    ThreadPeak peak(member_pids);
    const double secs = run_clients(0, &acked, &failures);
    const std::string threads = peak.Stop();
    uint64_t max_seq = 0;
    for (const Acked& a : acked) max_seq = std::max(max_seq, a.fleet_seq);
    if (!wait_all(max_seq)) {
      std::fprintf(stderr, "members never served fleet_seq %llu\n",
                   static_cast<unsigned long long>(max_seq));
      report_members(max_seq);
      return 1;
    }
    std::vector<std::vector<Seen>> logs;
    for (auto& w : watchers) logs.push_back(w->seen());
    const double learn_secs = Ms(served_at(logs, max_seq) - start) / 1000;
    const double ack_rate = acked.size() / secs;
    const double learn_rate = acked.size() / learn_secs;
    std::printf("sustained (closed loop, %lld clients, %.1f s): %zu acknowledged "
                "(%.0f/s, %lld failed), learned and served fleet-wide %.0f/s "
                "(last served %.2f s after start); trainer at %.2f of the one-core "
                "exact-RLS bound, %.2f of the %ld-core bound\n",
                static_cast<long long>(clients), secs, acked.size(), ack_rate,
                static_cast<long long>(failures), learn_rate, learn_secs,
                learn_rate / bound1, learn_rate / bound_t, trainer_cores);
    std::printf("  trainer worker time: %s\n",
                StageReport(before, stages(), learn_secs).c_str());
    const auto cpu_after = CpuSample(member_pids);
    std::printf("  CPU per wall second until served (1.00 = one core): %s\n",
                CpuReport(cpu_before, cpu_after, learn_secs, cores).c_str());
    std::printf("  CPU ms per acknowledged completion: %s\n",
                CpuPerCompletion(cpu_before, cpu_after, acked.size()).c_str());
    if (trainer_cores == 1) {
      std::printf("  trainer: %s\n",
                  TrainerEfficiency(before, stages(), cpu_before, cpu_after, bound1).c_str());
    }
    std::printf("  most threads per member: %s\n", threads.c_str());
  }

  // 3. Staleness at steady rates.
  for (int64_t rate : rates) {
    std::vector<Acked> acked;
    int64_t failures = 0;
    const auto before = stages();
    const auto cpu_before = CpuSample(member_pids);
    const auto start = Clock::now();
    ThreadPeak peak(member_pids);
    const double secs = run_clients(static_cast<double>(rate) / clients, &acked, &failures);
    const std::string threads = peak.Stop();
    uint64_t max_seq = 0;
    for (const Acked& a : acked) max_seq = std::max(max_seq, a.fleet_seq);
    if (!wait_all(max_seq)) {
      std::fprintf(stderr, "members never served fleet_seq %llu\n",
                   static_cast<unsigned long long>(max_seq));
      report_members(max_seq);
      return 1;
    }
    std::vector<std::vector<Seen>> logs;
    for (auto& w : watchers) logs.push_back(w->seen());
    std::vector<double> stale, to_publish, to_served;
    for (const Acked& a : acked) {
      const Clock::time_point all = served_at(logs, a.fleet_seq);
      stale.push_back(Ms(all - a.t));
      auto first = first_with(logs[0], a.fleet_seq);
      if (first != logs[0].end()) {
        const double pub = static_cast<double>(first->published_unix_ms - a.unix_ms);
        to_publish.push_back(pub);
        to_served.push_back(Ms(all - a.t) - pub);
      }
    }
    std::printf("steady %lld/s target: %zu acknowledged in %.1f s (%.0f/s, %lld failed); "
                "staleness ack -> served by all %d members: p50 %.0f ms, p99 %.0f ms, "
                "max %.0f ms (ack -> trainer published it: p50 %.0f, p99 %.0f; publish "
                "-> served by all: p50 %.0f, p99 %.0f)\n",
                static_cast<long long>(rate), acked.size(), secs, acked.size() / secs,
                static_cast<long long>(failures), n_members, Pct(stale, 0.5),
                Pct(stale, 0.99), Pct(stale, 1.0), Pct(to_publish, 0.5),
                Pct(to_publish, 0.99), Pct(to_served, 0.5), Pct(to_served, 0.99));
    const double phase_s = Ms(Clock::now() - start) / 1000;
    std::printf("  trainer worker time (of %.1f s until served): %s\n", phase_s,
                StageReport(before, stages(), phase_s).c_str());
    const auto cpu_after = CpuSample(member_pids);
    std::printf("  CPU per wall second (1.00 = one core): %s\n",
                CpuReport(cpu_before, cpu_after, phase_s, cores).c_str());
    std::printf("  CPU ms per acknowledged completion: %s\n",
                CpuPerCompletion(cpu_before, cpu_after, acked.size()).c_str());
    if (trainer_cores == 1) {
      std::printf("  trainer: %s\n",
                  TrainerEfficiency(before, stages(), cpu_before, cpu_after, bound1).c_str());
    }
    std::printf("  most threads per member: %s\n", threads.c_str());
    std::printf("  uptime: %s\n", Sh("uptime").c_str());
  }
  std::printf("uptime after: %s\n", Sh("uptime").c_str());
  watchers.clear();
  members.clear();
  return 0;
}

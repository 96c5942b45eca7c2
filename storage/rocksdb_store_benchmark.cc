// What a data folder costs on disk and what a checkpoint write costs, at a
// real width: a fresh store (one readout at d = 4096, so its first
// checkpoint, 64 MiB of P, is written, and a few feedback records), its size
// on disk (allocated blocks, what `du` counts: preallocated WAL space
// included) while it is open, then the latency of --writes checkpoint writes
// (each 64 MiB of P, flushed to an SST before it returns).
//
//   rocksdb_store_benchmark [--dim 4096] [--writes 8] [--records 64]
//                           [--compare fallocate|compaction|appends]
//
// --compare runs two stores side by side, in folders of their own, that
// differ in one store option: "fallocate" (RocksStoreOptions::preallocate_wal
// on, as before, vs off, the default) or "compaction"
// (compact_pruned_checkpoints off, as before, vs on, the default). Their
// checkpoint writes alternate (A B B A A B ...), so both see the same load;
// each store's latencies and disk use are printed, with the folder's size
// after every write. "appends" measures the feedback log instead: --writes
// messages of --records completions (d-wide float16 features of random
// bytes each, as a shim sends them), each appended one record at a time
// (AppendLog per completion, as a Connect stream's completions message is
// served) and as one call (one WriteBatch), with sync_log off and on, and
// one record at a time unsynced then one SyncLog (what leapd --sync_log
// does), five stores taking the messages in turn; the per-message latency is
// what a stream's next message waits behind. It writes the log records
// only: leapd's append of a completion also carries its dataset record in
// the same write, plus a quality write and one or two dedup reads, so these
// are lower bounds of what a message costs there. Prints one line per figure. Not a test (no
// assertions); the footprint's bound is asserted by rocksdb_store_test at a
// small width.
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/bench.h"
#include "readout/readout.h"
#include "readout/rls.h"
#include "storage/rocksdb_store.h"
#include "tests/support/scoped_temp_dir.h"

namespace {

using namespace leap;  // NOLINT(build/namespaces): a benchmark's main

// Bytes allocated on disk for everything under `dir` (st_blocks, as du).
int64_t DiskBytes(const std::string& dir) {
  int64_t total = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    struct stat st;
    if (::lstat(e.path().c_str(), &st) == 0) total += int64_t{st.st_blocks} * 512;
  }
  return total;
}

int64_t Flag(int argc, char** argv, const char* name, int64_t def) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atoll(argv[i + 1]);
  }
  return def;
}

std::string StrFlag(int argc, char** argv, const char* name) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  }
  return "";
}

double Mib(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

// Opens a store in `dir` with `o` and creates the benchmark's readout at
// width `dim` from *ck (θ = 0.25, P = 0.1 I: its first checkpoint);
// *create_ms is how long CreateReadout took.
bool OpenWithReadout(const std::string& dir, const storage::RocksStoreOptions& o,
                     int64_t dim, std::unique_ptr<storage::StateStore>* store,
                     storage::ReadoutMeta* meta, storage::ReadoutCheckpoint* ck,
                     double* create_ms) {
  auto opened = storage::OpenRocksStore(dir, o);
  if (!opened.ok()) {
    std::fprintf(stderr, "%s\n", opened.status().ToString().c_str());
    return false;
  }
  *store = std::move(*opened);
  meta->name = "bench";
  meta->spec.dim = dim;
  meta->standardizer = readout::Standardizer::Identity(dim);
  ck->theta = Eigen::VectorXd::Constant(dim + 1, 0.25);
  ck->p = readout::SymMatrix::ScaledIdentity(dim + 1, 0.1f);
  const auto t0 = std::chrono::steady_clock::now();
  if (auto s = (*store)->CreateReadout(meta, *ck); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return false;
  }
  *create_ms = std::chrono::duration<double, std::milli>(
                   std::chrono::steady_clock::now() - t0)
                   .count();
  return true;
}

// One store under test: a readout at width dim with its first checkpoint and
// `records` feedback records, then checkpoint writes on demand.
struct Bench {
  std::string name, dir;
  std::unique_ptr<storage::StateStore> store;
  storage::ReadoutMeta meta;
  storage::ReadoutCheckpoint ck;
  int64_t records = 0;
  std::vector<double> ms;
  double create_ms = 0;

  bool Open(const storage::RocksStoreOptions& o, int64_t dim) {
    if (!OpenWithReadout(dir, o, dim, &store, &meta, &ck, &create_ms)) return false;
    for (int64_t i = 1; i <= records; ++i) {
      storage::LogRecord r;
      r.seq = static_cast<uint64_t>(i);
      r.request_id = "req-" + std::to_string(i);
      r.dtype = readout::DType::kFloat16;
      r.features.assign(static_cast<size_t>(dim) * 2, '\x11');
      r.target = 10;
      r.dedup_keys = {"key-" + std::to_string(i)};
      if (auto s = store->AppendLog(meta, {&r, 1}); !s.ok()) {
        std::fprintf(stderr, "%s\n", s.ToString().c_str());
        return false;
      }
    }
    return true;
  }
  // Checkpoint write number i (0-based): its latency is recorded.
  bool Write(int64_t i) {
    ck.version = i + 2;
    ck.last_seq = static_cast<uint64_t>(records);
    ck.p->data()[0] = static_cast<float>(i);
    const auto t0 = std::chrono::steady_clock::now();
    if (auto s = store->WriteCheckpoint(meta, ck); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return false;
    }
    ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    return true;
  }
  void PrintLatency() const {
    std::vector<double> v = ms;
    std::sort(v.begin(), v.end());
    std::printf("%scheckpoint write x%zu: min %.1f ms, median %.1f ms, max %.1f ms\n",
                name.empty() ? "" : (name + ": ").c_str(), v.size(), v.front(),
                v[v.size() / 2], v.back());
  }
};

// One configuration of --compare appends: a store (sync_log on or off) whose
// messages of completions are appended one AppendLog per record or one per
// message. Only the appends are timed (records are built before).
struct AppendBench {
  std::string label;
  bool one_call = false;
  bool sync_after = false;  // one SyncLog after the message's appends
  std::unique_ptr<storage::StateStore> store;
  storage::ReadoutMeta meta;
  uint64_t seq = 0;
  std::vector<double> ms;

  bool Open(const std::string& dir, const storage::RocksStoreOptions& o,
            int64_t dim) {
    storage::ReadoutCheckpoint ck;
    double create_ms = 0;
    return OpenWithReadout(dir, o, dim, &store, &meta, &ck, &create_ms);
  }
  // Appends one message's records (`batch`, renumbered here) and records the
  // latency.
  bool Message(std::vector<storage::LogRecord>& batch) {
    for (storage::LogRecord& r : batch) {
      r.seq = ++seq;
      r.request_id = "req-" + std::to_string(seq);
      r.dedup_keys = {"key-" + std::to_string(seq)};
    }
    const auto t0 = std::chrono::steady_clock::now();
    if (one_call) {
      if (auto s = store->AppendLog(meta, batch); !s.ok()) {
        std::fprintf(stderr, "%s\n", s.ToString().c_str());
        return false;
      }
    } else {
      for (const storage::LogRecord& r : batch) {
        if (auto s = store->AppendLog(meta, {&r, 1}); !s.ok()) {
          std::fprintf(stderr, "%s\n", s.ToString().c_str());
          return false;
        }
      }
    }
    if (sync_after) {
      if (auto s = store->SyncLog(); !s.ok()) {
        std::fprintf(stderr, "%s\n", s.ToString().c_str());
        return false;
      }
    }
    ms.push_back(std::chrono::duration<double, std::milli>(
                     std::chrono::steady_clock::now() - t0)
                     .count());
    return true;
  }
  void Print(int64_t per_message) const {
    std::vector<double> v = ms;
    std::sort(v.begin(), v.end());
    double total_ms = 0;
    for (double x : v) total_ms += x;
    std::printf(
        "%s: message of %lld records x%zu: min %.2f ms, median %.2f ms, mean "
        "%.2f ms, p99 %.2f ms, max %.2f ms; %.0f records/s while appending\n",
        label.c_str(), static_cast<long long>(per_message), v.size(), v.front(),
        v[v.size() / 2], total_ms / static_cast<double>(v.size()),
        v[std::min(v.size() - 1, v.size() * 99 / 100)], v.back(),
        static_cast<double>(per_message) * static_cast<double>(v.size()) /
            (total_ms / 1000));
  }
};

}  // namespace

int main(int argc, char** argv) {
  const int64_t dim = Flag(argc, argv, "--dim", 4096);
  const int64_t writes = Flag(argc, argv, "--writes", 8);
  const int64_t records = Flag(argc, argv, "--records", 64);
  const std::string compare = StrFlag(argc, argv, "--compare");
  if (dim < 1 || writes < 1 || records < 0 ||
      (!compare.empty() && compare != "fallocate" && compare != "compaction" &&
       compare != "appends")) {
    std::fprintf(stderr,
                 "usage: %s [--dim N>=1] [--writes N>=1] [--records N>=0] "
                 "[--compare fallocate|compaction|appends]\n",
                 argv[0]);
    return 2;
  }
  leap::testing::ScopedTempDir tmp("rocksdb_store_benchmark");
  if (compare == "appends") {
    // --writes messages of --records records each, to five stores (sync_log
    // off/on x one AppendLog per record/per message, and per record then one
    // SyncLog) in turn: message i goes to the stores in a rotated order, so
    // each sees the same load.
    const int64_t per_message = std::max<int64_t>(records, 1);
    std::printf("machine: %s, %u cores; d=%lld float16 features per record "
                "(random bytes); the feedback log's records only\n",
                client::CpuModel().c_str(), std::thread::hardware_concurrency(),
                static_cast<long long>(dim));
    // [4]: what leapd --sync_log does (the store's sync_log off, one
    // SyncLog after the message's appends).
    constexpr int kStores = 5;
    AppendBench b[kStores];
    for (int k = 0; k < kStores; ++k) {
      storage::RocksStoreOptions o;
      o.sync_log = k == 2 || k == 3;
      b[k].one_call = k == 1 || k == 3;
      b[k].sync_after = k == 4;
      b[k].label = std::string("sync_log=") + (o.sync_log ? "on" : "off") +
                   (b[k].one_call ? ", one AppendLog per message"
                                  : ", one AppendLog per record") +
                   (b[k].sync_after ? " then one SyncLog (leapd --sync_log)" : "");
      if (!b[k].Open(tmp.File("appends" + std::to_string(k)), o, dim)) return 1;
    }
    std::mt19937_64 rng(1);
    std::vector<storage::LogRecord> batch(static_cast<size_t>(per_message));
    for (int64_t i = 0; i < writes; ++i) {
      for (storage::LogRecord& r : batch) {
        r.dtype = readout::DType::kFloat16;
        r.target = 10;
        r.features.resize(static_cast<size_t>(dim) * 2);
        for (size_t j = 0; j + 8 <= r.features.size(); j += 8) {
          const uint64_t w = rng();
          std::memcpy(r.features.data() + j, &w, 8);
        }
      }
      for (int j = 0; j < kStores; ++j) {
        if (!b[(i + j) % kStores].Message(batch)) return 1;
      }
    }
    for (const AppendBench& x : b) x.Print(per_message);
    return 0;
  }
  if (compare.empty()) {
    Bench b;
    b.dir = tmp.File("db");
    b.records = records;
    if (!b.Open({}, dim)) return 1;
    std::printf("d=%lld P=%.1f MiB create_readout_ms=%.1f\n", static_cast<long long>(dim),
                static_cast<double>(b.ck.p->payload_bytes()) / (1 << 20), b.create_ms);
    std::printf("open store, 1 readout + %lld log records: %.1f MiB on disk\n",
                static_cast<long long>(records), Mib(DiskBytes(b.dir)));
    for (int64_t i = 0; i < writes; ++i) {
      if (!b.Write(i)) return 1;
    }
    b.PrintLatency();
    std::printf("after the checkpoints: %.1f MiB on disk\n", Mib(DiskBytes(b.dir)));
    b.store.reset();
    std::printf("closed: %.1f MiB on disk\n", Mib(DiskBytes(b.dir)));
    return 0;
  }
  // Two stores: [0] as before, [1] as now.
  Bench b[2];
  storage::RocksStoreOptions o[2];
  if (compare == "fallocate") {
    b[0].name = "preallocate_wal=on";
    b[1].name = "preallocate_wal=off";
    o[0].preallocate_wal = true;
  } else {
    b[0].name = "compact_pruned_checkpoints=off";
    b[1].name = "compact_pruned_checkpoints=on";
    o[0].compact_pruned_checkpoints = false;
  }
  for (int k = 0; k < 2; ++k) {
    b[k].dir = tmp.File(k == 0 ? "before" : "after");
    b[k].records = records;
    if (!b[k].Open(o[k], dim)) return 1;
    std::printf("%s: d=%lld P=%.1f MiB create_readout_ms=%.1f; open store, 1 readout + "
                "%lld log records: %.1f MiB on disk\n",
                b[k].name.c_str(), static_cast<long long>(dim),
                static_cast<double>(b[k].ck.p->payload_bytes()) / (1 << 20), b[k].create_ms,
                static_cast<long long>(records), Mib(DiskBytes(b[k].dir)));
  }
  const double p_mib = static_cast<double>(b[0].ck.p->payload_bytes()) / (1 << 20);
  for (int64_t i = 0; i < writes; ++i) {
    // A B, then B A: each store goes first as often as the other.
    const int first = static_cast<int>((i / 2 + i) % 2);
    const int order[2] = {first, 1 - first};
    for (int k : order) {
      if (!b[k].Write(i)) return 1;
    }
    std::printf("after %lld checkpoint writes: %s %.1f MiB (%.2f P), %s %.1f MiB (%.2f P) "
                "on disk; this write %.1f ms vs %.1f ms\n",
                static_cast<long long>(i + 1), b[0].name.c_str(), Mib(DiskBytes(b[0].dir)),
                Mib(DiskBytes(b[0].dir)) / p_mib, b[1].name.c_str(), Mib(DiskBytes(b[1].dir)),
                Mib(DiskBytes(b[1].dir)) / p_mib, b[0].ms.back(), b[1].ms.back());
  }
  for (int k = 0; k < 2; ++k) b[k].PrintLatency();
  for (int k = 0; k < 2; ++k) {
    b[k].store.reset();
    std::printf("%s: closed: %.1f MiB on disk\n", b[k].name.c_str(), Mib(DiskBytes(b[k].dir)));
  }
  return 0;
}

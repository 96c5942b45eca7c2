// What a data folder costs on disk and what a checkpoint write costs, at a
// real width: a fresh store (one readout at d = 4096, so its first
// checkpoint, 64 MiB of P, is written, and a few feedback records), its size
// on disk (allocated blocks, what `du` counts: preallocated WAL space
// included) while it is open, then the latency of --writes checkpoint writes
// (each 64 MiB of P, flushed to an SST before it returns).
//
//   rocksdb_store_benchmark [--dim 4096] [--writes 8] [--records 64]
//
// Prints one line per figure. Not a test (no assertions); the footprint's
// bound is asserted by rocksdb_store_test at a small width.
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

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

}  // namespace

int main(int argc, char** argv) {
  const int64_t dim = Flag(argc, argv, "--dim", 4096);
  const int64_t writes = Flag(argc, argv, "--writes", 8);
  const int64_t records = Flag(argc, argv, "--records", 64);
  if (dim < 1 || writes < 1 || records < 0) {
    std::fprintf(stderr, "usage: %s [--dim N>=1] [--writes N>=1] [--records N>=0]\n", argv[0]);
    return 2;
  }
  leap::testing::ScopedTempDir tmp("rocksdb_store_benchmark");
  const std::string dir = tmp.File("db");
  auto opened = storage::OpenRocksStore(dir);
  if (!opened.ok()) {
    std::fprintf(stderr, "%s\n", opened.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<storage::StateStore> store = std::move(*opened);
  storage::ReadoutMeta meta;
  meta.name = "bench";
  meta.spec.dim = dim;
  meta.standardizer = readout::Standardizer::Identity(dim);
  storage::ReadoutCheckpoint ck;
  ck.theta = Eigen::VectorXd::Constant(dim + 1, 0.25);
  ck.p = readout::SymMatrix::ScaledIdentity(dim + 1, 0.1f);
  auto t0 = std::chrono::steady_clock::now();
  if (auto s = store->CreateReadout(&meta, ck); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  const double create_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::vector<storage::LogRecord> log;
  for (int64_t i = 1; i <= records; ++i) {
    storage::LogRecord r;
    r.seq = static_cast<uint64_t>(i);
    r.request_id = "req-" + std::to_string(i);
    r.dtype = readout::DType::kFloat16;
    r.features.assign(static_cast<size_t>(dim) * 2, '\x11');
    r.target = 10;
    r.dedup_keys = {"key-" + std::to_string(i)};
    log.push_back(std::move(r));
  }
  for (const auto& r : log) {
    if (auto s = store->AppendLog(meta, {&r, 1}); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
  }
  std::printf("d=%lld P=%.1f MiB create_readout_ms=%.1f\n", static_cast<long long>(dim),
              static_cast<double>(ck.p->payload_bytes()) / (1 << 20), create_ms);
  std::printf("open store, 1 readout + %lld log records: %.1f MiB on disk\n",
              static_cast<long long>(records),
              static_cast<double>(DiskBytes(dir)) / (1 << 20));
  std::vector<double> ms;
  for (int64_t i = 0; i < writes; ++i) {
    ck.version = i + 2;
    ck.last_seq = static_cast<uint64_t>(records);
    ck.p->data()[0] = static_cast<float>(i);
    t0 = std::chrono::steady_clock::now();
    if (auto s = store->WriteCheckpoint(meta, ck); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
    ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  std::printf("checkpoint write x%lld: min %.1f ms, median %.1f ms, max %.1f ms\n",
              static_cast<long long>(writes), ms.front(), ms[ms.size() / 2], ms.back());
  std::printf("after the checkpoints: %.1f MiB on disk\n",
              static_cast<double>(DiskBytes(dir)) / (1 << 20));
  store.reset();
  std::printf("closed: %.1f MiB on disk\n", static_cast<double>(DiskBytes(dir)) / (1 << 20));
  return 0;
}

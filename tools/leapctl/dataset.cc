// `leapctl dataset export`: the training data leapd kept from the engine's
// own traffic (Admin.ExportDataset) as .npy files `leapctl train` reads.
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/admin_client.h"
#include "common/npy.h"
#include "tools/leapctl/flags.h"
#include "tools/leapctl/internal/command.h"
#include "tools/leapctl/server.h"

namespace leap::leapctl::internal {
namespace {

namespace pb = ::leap::v1;

constexpr char kDatasetHelp[] =
    "Usage: leapctl dataset <subcommand> [flags]\n"
    "\n"
    "The training data leapd keeps from its own traffic (with --data_dir):\n"
    "the features and true output lengths of finished requests, per readout\n"
    "(docs/STORAGE.md, \"Dataset\").\n"
    "\n"
    "Subcommands:\n"
    "  export --readout NAME --out DIR   Write DIR/features.npy (float32\n"
    "                [n, d]) and DIR/lengths.npy (int64 [n]) for "
    "'leapctl train'.\n";

// DIR exists (made if missing) and a file can be created in it.
absl::Status CheckWritableDir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, ": cannot create the directory: ", ec.message()));
  }
  const std::string probe = absl::StrCat(dir, "/.leapctl-write-probe-", ::getpid());
  std::FILE* f = std::fopen(probe.c_str(), "wb");
  if (f == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, ": not writable: ", std::strerror(errno)));
  }
  std::fclose(f);
  std::remove(probe.c_str());
  return absl::OkStatus();
}

int Export(const std::vector<std::string>& args, std::ostream& out,
           std::ostream& err) {
  Command cmd("dataset export", out, err);
  ServerOptions server;
  std::string readout, dir;
  int64_t limit = 0;
  FlagSet flags(
      "dataset export",
      "leapctl dataset export --readout NAME --out DIR [--limit N]",
      "Streams the dataset leapd kept for a readout (the features and true\n"
      "output lengths of its finished requests, oldest first) and writes\n"
      "DIR/features.npy (float32 [n, d]; float16/bfloat16 features are\n"
      "widened exactly) and DIR/lengths.npy (int64 [n], output tokens, not\n"
      "clipped), each atomically. Train on them with\n"
      "  leapctl train --features DIR/features.npy --lengths DIR/lengths.npy "
      "--out R.leapr\n"
      "DIR is created if missing and checked writable before leapd is "
      "asked.\n"
      "Progress goes to stderr; the summary to stdout.");
  AddServerFlags(flags, &server);
  flags.String("readout", &readout, "NAME", "The readout whose traffic was kept.",
               true);
  flags.String("out", &dir, "DIR", "Directory to write the two files into.",
               true);
  flags.Int64("limit", &limit, "N", "Only the newest N records (0 = all).");
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (int rc = CheckServerFlags(cmd, server); rc >= 0) return rc;
  if (limit < 0) {
    return cmd.UsageError(absl::InvalidArgumentError(
        absl::StrCat("--limit must be >= 0, got ", limit)));
  }
  if (absl::Status s = CheckWritableDir(dir); !s.ok()) return cmd.Failure(s);
  ProgressFn progress = cmd.Progress();
  AdminClient client(server);
  int64_t dim = 0, records = 0, skipped = 0, rows = 0, next_report = 0;
  std::vector<float> features;
  std::vector<int64_t> tokens;
  bool bad = false;
  std::string bad_why;
  absl::Status s = client.ExportDataset(
      readout, limit, [&](const pb::DatasetChunk& c) {
        if (dim == 0 && c.rows() == 0) {
          dim = c.dim();
          records = c.records();
          skipped = c.skipped();
          progress(absl::StrFormat("readout %s: %d records of dim %d to receive",
                                   readout, records, dim));
          features.reserve(static_cast<size_t>(records * dim));
          tokens.reserve(static_cast<size_t>(records));
          next_report = std::max<int64_t>(1, records / 10);
          return true;
        }
        if (dim <= 0 || c.tokens_size() != c.rows() ||
            c.features().size() != static_cast<size_t>(c.rows() * dim) * 4) {
          bad = true;
          bad_why = "a chunk's sizes do not match its header";
          return false;
        }
        const size_t at = features.size();
        features.resize(at + static_cast<size_t>(c.rows() * dim));
        std::memcpy(features.data() + at, c.features().data(), c.features().size());
        tokens.insert(tokens.end(), c.tokens().begin(), c.tokens().end());
        rows += c.rows();
        if (rows >= next_report) {
          progress(absl::StrFormat("received %d/%d rows", rows, records));
          next_report = rows + std::max<int64_t>(1, records / 10);
        }
        return true;
      });
  if (bad) return cmd.Failure(absl::DataLossError(bad_why));
  if (!s.ok()) return cmd.Failure(s);
  if (rows != records) {
    return cmd.Failure(absl::DataLossError(absl::StrCat(
        "leapd announced ", records, " records and sent ", rows)));
  }
  if (rows == 0) {
    return cmd.Failure(absl::NotFoundError(absl::StrCat(
        "readout '", readout, "' has no dataset records yet (completions with "
        "a known length are kept with --data_dir)")));
  }
  const std::string fpath = dir + "/features.npy";
  const std::string lpath = dir + "/lengths.npy";
  const int64_t fshape[] = {rows, dim};
  if (absl::Status w = WriteNpy(fpath, NpyDType::kFloat32, fshape, features.data());
      !w.ok()) {
    return cmd.Failure(w);
  }
  const int64_t lshape[] = {rows};
  if (absl::Status w = WriteNpy(lpath, NpyDType::kInt64, lshape, tokens.data());
      !w.ok()) {
    return cmd.Failure(w);
  }
  out << absl::StrFormat(
      "readout: %s\nrecords: %d\ndim: %d\nskipped: %d\nfeatures: %s\nlengths: "
      "%s\n",
      readout, rows, dim, skipped, fpath, lpath);
  return kExitOk;
}

}  // namespace

int DatasetCommand(const std::vector<std::string>& args, std::ostream& out,
                   std::ostream& err) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h" || args[0] == "help")) {
    out << kDatasetHelp;
    return kExitOk;
  }
  if (args.empty() || args[0] != "export") {
    err << "leapctl dataset: error: "
        << (args.empty() ? std::string("missing subcommand")
                         : absl::StrCat("unknown subcommand '", OneLine(args[0]), "'"))
        << " (export; see 'leapctl dataset --help')" << std::endl;
    return kExitUsage;
  }
  return Export(std::vector<std::string>(args.begin() + 1, args.end()), out, err);
}

}  // namespace leap::leapctl::internal

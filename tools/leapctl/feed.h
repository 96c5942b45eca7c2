// `leapctl feed`: an engine simulator on one leapd Connect stream. Sends the
// rows of a feature file in batches (Hello declares the file's dtype and
// width), collects each batch's predictions, then reports how each of those
// requests ended (STOP with the true length, or the given finish reasons),
// batch after batch, so the serving readout learns while it predicts. Every
// --report-every rows it reports the Spearman of predicted vs. true length
// over that window of rows (those that ended with STOP: only a natural stop
// tells the true length), the readout versions that predicted them, and
// the rescores received so far.
#ifndef LEAP_TOOLS_LEAPCTL_FEED_H_
#define LEAP_TOOLS_LEAPCTL_FEED_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tools/leapctl/commands.h"
#include "tools/leapctl/server.h"

namespace leap::leapctl {

// Inputs of `leapctl feed`.
struct FeedOptions {
  ServerOptions server;
  // Features (.npy float32 or float16 [n, d]) and true output lengths
  // (.npy int32/int64 [n]). Required.
  std::string features_path;
  std::string lengths_path;
  // Optional finish reasons (.npy int32/int64 [n]: 1 stop, 2 length,
  // 3 cancelled, 4 aborted). Empty: every request stops naturally.
  std::string finish_reasons_path;
  // Product line of every request ("" = the default route). Default: ""
  std::string product_line;
  // Requests per FeatureBatch (and CompletionBatch), in [1, 65536].
  // Default: 64
  int64_t batch = 64;
  // Rows per reported window, >= 2. Default: 1000
  int64_t report_every = 1000;
  // Engine id in Hello. Default: leapctl-feed
  std::string engine_id = "leapctl-feed";

  // InvalidArgument (a usage error) for a missing path or a value out of
  // range.
  absl::Status Validate() const;
};

// The first and last version of one readout that predicted rows.
struct VersionRange {
  int64_t first = 0;
  int64_t last = 0;
};

// One window of rows [first_row, last_row] (0-based, inclusive).
struct FeedWindow {
  int64_t first_row = 0;
  int64_t last_row = 0;
  // Rows of the window that got a prediction and ended with STOP (every row
  // without --finish-reasons), and their Spearman of predicted vs. true
  // tokens (NaN when undefined).
  int64_t n = 0;
  double spearman = 0;
  // Readout -> versions that predicted the window's rows.
  std::map<std::string, VersionRange> versions;
  // Totals since the start, as of the end of the window.
  int64_t learned = 0;
  int64_t skipped = 0;
  int64_t rescore_messages = 0;
  int64_t rescored_predictions = 0;
};

// A readout's state when the feed ended.
struct FeedFinal {
  std::string readout;
  int64_t version = 0;
  int64_t completions_learned = 0;
  int64_t rls_backlog = 0;
  bool frozen = false;
};

// What `leapctl feed` did.
struct FeedReport {
  int64_t rows = 0;
  int64_t dim = 0;
  std::string dtype;
  int64_t predicted = 0;
  int64_t prediction_errors = 0;
  // Completions acknowledged as learned / skipped by rule, and refused.
  int64_t learned = 0;
  int64_t skipped = 0;
  int64_t completion_errors = 0;
  // The first per-request error (OK when there was none).
  absl::Status first_error;
  int64_t rescore_messages = 0;
  int64_t rescored_predictions = 0;
  // ReadoutPublished notices received.
  int64_t published = 0;
  // Over every predicted row that ended with STOP.
  double spearman = 0;
  std::vector<FeedWindow> windows;
  // Each readout that predicted, as leapd reported it after the feed.
  std::vector<FeedFinal> finals;
  double seconds = 0;
};

// Receives each window as soon as it is complete.
using FeedWindowFn = std::function<void(const FeedWindow&)>;

// Runs the feed. Fails on unreadable or inconsistent files, an unreachable
// server, a broken stream, or when no row got a prediction (with the first
// per-request error); per-request errors otherwise only count.
absl::StatusOr<FeedReport> RunFeed(const FeedOptions& options,
                                   const FeedWindowFn& on_window,
                                   const ProgressFn& progress);
// One line: "rows A-B: spearman S (n N), predicted by R vX-vY; learned L,
// skipped K, rescores M (P predictions)".
std::string FormatFeedWindow(const FeedWindow& window);
// The totals and final versions ("key: value" lines).
std::string FormatFeedReport(const FeedReport& report);
// One JSON object: {"rows", "dim", "dtype", "predicted",
// "prediction_errors", "learned", "skipped", "completion_errors",
// "rescore_messages", "rescored_predictions", "published", "spearman",
// "windows": [{"first_row", "last_row", "n", "spearman", "versions":
// {READOUT: {"first", "last"}}, "learned", "skipped", "rescore_messages",
// "rescored_predictions"}], "final": [{"readout", "version",
// "completions_learned", "rls_backlog", "frozen"}], "first_error",
// "time_s"}; NaN is null.
std::string FormatFeedJson(const FeedReport& report);

}  // namespace leap::leapctl

#endif  // LEAP_TOOLS_LEAPCTL_FEED_H_

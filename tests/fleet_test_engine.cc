// A test engine process for the fleet tests: asks members of a leapd fleet
// for predictions and sends completions (unary Predict + Complete, one
// request at a time), and writes every acknowledged completion to a file.
//
//   fleet_test_engine --members=A,B,C --start=K --dim=D --seed=S
//                     --instance=ID --out=FILE [--rate=R] [--count=N]
//
// Request i has id "<instance>-<i>", features N(0,1) from the seed and a
// length from a fixed linear model. It goes to the current member (the
// K-th at start); on any failure (UNAVAILABLE while NATS or the member is
// down, a lost connection, NOT_FOUND after a restarted member forgot the
// live request) the engine moves to the next member and sends the request
// again (Predict, then the same completion) until it is acknowledged: so
// completions whose ack was lost are resent, possibly to another member.
// Each acknowledged completion is one line of FILE, flushed at once:
//   A <id> <fleet_seq> <learned> <duplicate> <target> <x_0> ... <x_{D-1}>
// (target = sqrt(min(tokens, 2048)), floats as %a so they read back exactly).
// Signals: SIGUSR1 pauses after the current request's ack (prints "paused
// <acked>" and waits), SIGUSR2 resumes ("resumed"), SIGTERM ends after the
// current request's ack ("done <acked>"). Also ends after N requests.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grpcpp/grpcpp.h"
#include "leap/v1/predictor.grpc.pb.h"

namespace {

namespace pb = ::leap::v1;

std::string Flag(int argc, char** argv, const std::string& name,
                 const std::string& def) {
  const std::string pre = "--" + name + "=";
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], pre.c_str(), pre.size()) == 0) {
      return argv[i] + pre.size();
    }
  }
  return def;
}

std::shared_ptr<grpc::Channel> Channel(const std::string& address) {
  grpc::ChannelArguments args;
  // A killed member comes back on the same port within a second or two: do
  // not let gRPC's reconnect backoff grow to minutes.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 300);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(),
                                   args);
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> members =
      absl::StrSplit(Flag(argc, argv, "members", ""), ',');
  size_t cur = std::stoul(Flag(argc, argv, "start", "0")) % members.size();
  const int64_t dim = std::stoll(Flag(argc, argv, "dim", "16"));
  const uint64_t seed = std::stoull(Flag(argc, argv, "seed", "1"));
  const std::string instance = Flag(argc, argv, "instance", "engine");
  const std::string out_path = Flag(argc, argv, "out", "");
  const double rate = std::stod(Flag(argc, argv, "rate", "0"));
  const int64_t count = std::stoll(Flag(argc, argv, "count", "1000000000"));
  const std::string product_line = Flag(argc, argv, "product_line", "");
  const int64_t budget = 2048;
  if (members.empty() || members[0].empty() || out_path.empty()) {
    std::fprintf(stderr, "usage: see the file comment\n");
    return 2;
  }
  FILE* out = std::fopen(out_path.c_str(), "w");
  if (out == nullptr) {
    std::perror(out_path.c_str());
    return 2;
  }

  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGUSR1);
  sigaddset(&sigs, SIGUSR2);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  // Signals are taken synchronously between requests (sigtimedwait with no
  // wait), so a request in flight always completes first.
  auto poll_signal = [&]() -> int {
    timespec zero{0, 0};
    return sigtimedwait(&sigs, nullptr, &zero);
  };

  std::vector<std::unique_ptr<pb::Predictor::Stub>> stubs;
  for (const std::string& m : members) {
    stubs.push_back(pb::Predictor::NewStub(Channel(m)));
  }
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n01;
  // The length model: sqrt(tokens) = 18 + 0.8 * sum of the first 8 features
  // + noise.
  int64_t acked = 0, switches = 0, duplicates = 0;
  const auto t0 = std::chrono::steady_clock::now();
  bool stop = false;
  for (int64_t i = 0; i < count && !stop; ++i) {
    for (int sig = poll_signal(); sig > 0; sig = poll_signal()) {
      if (sig == SIGTERM) stop = true;
      if (sig == SIGUSR1) {
        std::printf("paused %lld\n", static_cast<long long>(acked));
        std::fflush(stdout);
        int got = 0;
        do {
          sigwait(&sigs, &got);
          if (got == SIGTERM) stop = true;
        } while (got != SIGUSR2 && got != SIGTERM);
        std::printf("resumed\n");
        std::fflush(stdout);
      }
    }
    if (stop) break;
    if (rate > 0) {
      // Pacing, not waiting for an event: request i is due at t0 + i / rate.
      std::this_thread::sleep_until(
          t0 + std::chrono::microseconds(static_cast<int64_t>(i * 1e6 / rate)));
    }
    std::vector<float> x(dim);
    double s = 18;
    for (int64_t k = 0; k < dim; ++k) {
      x[k] = n01(rng);
      if (k < 8) s += 0.8 * x[k];
    }
    s += 0.5 * n01(rng);
    const int64_t tokens = std::clamp<int64_t>(std::llround(s * s), 1, 4000);
    const std::string id = absl::StrCat(instance, "-", i);

    pb::PredictRequest preq;
    preq.set_instance_id(instance);
    preq.set_dtype(pb::FEATURE_DTYPE_FLOAT32);
    preq.mutable_record()->set_request_id(id);
    preq.mutable_record()->set_product_line(product_line);
    preq.mutable_record()->set_features(
        std::string(reinterpret_cast<const char*>(x.data()), x.size() * 4));
    pb::CompleteRequest creq;
    creq.set_instance_id(instance);
    creq.mutable_completion()->set_request_id(id);
    creq.mutable_completion()->set_output_tokens(tokens);
    creq.mutable_completion()->set_reason(pb::FINISH_REASON_STOP);

    int failures = 0;
    while (true) {
      if (failures > 0) {
        cur = (cur + 1) % members.size();
        ++switches;
        // Every member failed in a row: NATS is electing a stream leader or
        // members are restarting; back off a little (bounded) before the
        // next round.
        if (failures % members.size() == 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(
              std::min<int>(20 * failures, 200)));
        }
      }
      grpc::ClientContext pctx;
      pctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      pb::PredictResponse presp;
      grpc::Status ps = stubs[cur]->Predict(&pctx, preq, &presp);
      // ALREADY_EXISTS: the member still holds this request from a try
      // whose Complete failed; the completion below ends it.
      if (!ps.ok() && ps.error_code() != grpc::StatusCode::ALREADY_EXISTS) {
        ++failures;
        continue;
      }
      grpc::ClientContext cctx;
      cctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      pb::CompleteResponse cresp;
      grpc::Status cs = stubs[cur]->Complete(&cctx, creq, &cresp);
      if (!cs.ok()) {
        ++failures;
        continue;
      }
      if (cresp.duplicate()) ++duplicates;
      ++acked;
      const double target =
          std::sqrt(static_cast<double>(std::min(tokens, budget)));
      std::fprintf(out, "A %s %llu %d %d %a", id.c_str(),
                   static_cast<unsigned long long>(cresp.fleet_seq()),
                   cresp.learned() ? 1 : 0, cresp.duplicate() ? 1 : 0, target);
      for (float v : x) std::fprintf(out, " %a", static_cast<double>(v));
      std::fprintf(out, "\n");
      std::fflush(out);
      break;
    }
  }
  std::fclose(out);
  std::printf("done %lld switches %lld duplicates %lld\n",
              static_cast<long long>(acked), static_cast<long long>(switches),
              static_cast<long long>(duplicates));
  std::fflush(stdout);
  return 0;
}

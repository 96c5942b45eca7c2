// A test engine: one Connect stream with a reader thread that records every
// message, so tests can wait on events (an answer, a publish, a rescore)
// instead of sleeping. Test-only.
#ifndef LEAP_TESTS_SUPPORT_ENGINE_CLIENT_H_
#define LEAP_TESTS_SUPPORT_ENGINE_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "leap/v1/admin.grpc.pb.h"
#include "leap/v1/predictor.grpc.pb.h"

namespace leap::testing {

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address);

// Watches `readout` (WatchReadout) until a version has learned at least
// `learned` completions or `timeout` passed; returns the completions_learned
// of the last version seen (-1: none came).
int64_t AwaitLearned(const std::string& address, const std::string& readout,
                     int64_t learned, std::chrono::seconds timeout);

// Creates a cold-start readout `name` of width `dim` (lambda 1) over Admin
// at `address` and routes the default product line to it.
grpc::Status CreateDefaultReadout(const std::string& address,
                                  const std::string& name, int64_t dim);

// Threads: any test thread may call any method (Finish and the destructor
// from one thread, after the others); the reader thread is its own.
class EngineStream {
 public:
  // `instance_id` goes in the hello (Hello.instance_id; "" = none).
  EngineStream(std::shared_ptr<grpc::Channel> channel, int64_t dim,
               leap::v1::FeatureDType dtype = leap::v1::FEATURE_DTYPE_FLOAT32,
               const std::string& instance_id = "");
  ~EngineStream();

  // Sends `m` with a fresh seq; returns the seq.
  uint64_t Send(leap::v1::EngineMessage m);
  // Waits for the answer to `seq`; false on timeout.
  bool Await(uint64_t seq, leap::v1::SidecarMessage* out,
             absl::Duration timeout = absl::Seconds(30));
  // Sends and waits for the answer.
  leap::v1::SidecarMessage Call(leap::v1::EngineMessage m);
  // Waits until `pred` holds: evaluated without the lock, now and after each
  // message the reader records.
  bool WaitUntil(const std::function<bool()>& pred,
                 absl::Duration timeout = absl::Seconds(60));
  // Closes the writing side and waits for the stream's status.
  grpc::Status Finish();

  // Copies of the recorded pushes (under the lock; any thread, also inside a
  // WaitUntil predicate).
  std::vector<int64_t> published(const std::string& readout);
  // request id -> latest rescored prediction, per readout version.
  std::map<int64_t, std::map<std::string, leap::v1::Prediction>> rescores(
      const std::string& readout);
  bool alive() const {
    absl::MutexLock lock(&write_mu_);
    return alive_;
  }

 private:
  void ReadLoop();

  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<leap::v1::EngineMessage,
                                           leap::v1::SidecarMessage>>
      stream_;
  // Lock order: write_mu_ and mu_ are never held together.
  mutable absl::Mutex write_mu_;
  uint64_t next_seq_ ABSL_GUARDED_BY(write_mu_) = 1;
  absl::Mutex mu_;
  std::map<uint64_t, leap::v1::SidecarMessage> answers_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<int64_t>> published_ ABSL_GUARDED_BY(mu_);
  std::map<std::string,
           std::map<int64_t, std::map<std::string, leap::v1::Prediction>>>
      rescores_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t changes_ ABSL_GUARDED_BY(mu_) = 0;  // messages recorded, and close
  bool alive_ ABSL_GUARDED_BY(write_mu_) = true;
  std::thread reader_;
};

}  // namespace leap::testing

#endif  // LEAP_TESTS_SUPPORT_ENGINE_CLIENT_H_

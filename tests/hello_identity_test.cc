// Hello identity against the readouts (real leapd processes): an engine
// whose Hello.model_id or Hello.layer differs from the metadata of a readout
// of its width is refused with FAILED_PRECONDITION naming both, over gRPC
// Connect and over the shm attach; a matching hello, and a hello or readout
// that declares nothing, is served; --allow_hello_mismatch serves the
// mismatch and logs it.
#include <filesystem>
#include <string>

#include "engine_shim/shm_channel.h"
#include "gtest/gtest.h"
#include "readout/artifact.h"
#include "tests/support/engine_client.h"
#include "tests/support/process.h"
#include "tests/support/scoped_temp_dir.h"
#include "tests/support/readout_fixtures.h"

namespace leap {
namespace {

namespace pb = ::leap::v1;

constexpr int64_t kDim = 16;
constexpr char kModel[] = "Qwen/Qwen3-8B";
constexpr int32_t kLayer = 30;

struct Leapd {
  // First: removed after proc is stopped.
  std::unique_ptr<testing::ScopedTempDir> tmp;
  std::string dir, sock, shm;
  std::unique_ptr<testing::Process> proc;
};

Leapd Start(const std::string& name, std::vector<std::string> extra = {}) {
  Leapd l;
  l.tmp = std::make_unique<testing::ScopedTempDir>("hello-" + name);
  l.dir = l.tmp->path();
  readout::ReadoutState s = testing::RandomState(kDim, 5, /*with_p=*/false);
  s.spec.model_id = kModel;
  s.spec.layer = kLayer;
  const std::string artifact = l.dir + "/r.leapr";
  EXPECT_TRUE(readout::WriteArtifact(artifact, s).ok());
  l.sock = "unix://" + l.dir + "/leapd.sock";
  l.shm = l.dir + "/leap.shm";
  std::vector<std::string> args = {"--listen=" + l.sock, "--shm=" + l.shm,
                                   "--import=r=" + artifact};
  args.insert(args.end(), extra.begin(), extra.end());
  std::string addr;
  auto p = testing::StartLeapd(LEAPD_PATH, args, &addr);
  EXPECT_TRUE(p.ok()) << p.status();
  if (p.ok()) l.proc = *std::move(p);
  return l;
}

pb::Hello MakeHello(const std::string& model, int32_t layer) {
  pb::Hello h;
  h.set_engine_id("hello-test");
  h.set_model_id(model);
  h.set_layer(layer);
  h.set_dim(kDim);
  h.set_dtype(pb::FEATURE_DTYPE_FLOAT32);
  return h;
}

// The Connect stream's answer to `hello`: OK with a hello_ack, or the
// stream's status.
grpc::Status GrpcHello(const Leapd& l, const pb::Hello& hello) {
  auto stub = pb::Predictor::NewStub(testing::MakeChannel(l.sock));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = stub->Connect(&ctx);
  pb::EngineMessage m;
  *m.mutable_hello() = hello;
  stream->Write(m);
  pb::SidecarMessage ack;
  if (stream->Read(&ack) && ack.has_hello_ack()) {
    ctx.TryCancel();
    return grpc::Status::OK;
  }
  return stream->Finish();
}

absl::Status ShmHello(const Leapd& l, const pb::Hello& hello) {
  shim::ShmChannelOptions o;
  o.path = l.shm;
  o.hello = hello;
  o.slots = 16;
  o.timeout = absl::Seconds(10);
  pb::SidecarMessage ack;
  auto ch = shim::ShmChannel::Attach(o, &ack);
  return ch.status();
}

TEST(HelloIdentity, MismatchRefusedOverGrpcAndShmNamingBoth) {
  Leapd l = Start("strict");
  ASSERT_NE(l.proc, nullptr);
  struct Case {
    std::string model;
    int32_t layer;
    bool refused;
  };
  const Case cases[] = {
      {kModel, kLayer, false},           // the readout's own
      {"", -1, false},                   // declares nothing
      {kModel, -1, false},               // model only
      {"", kLayer, false},               // layer only
      {kModel, 0, false},                // 0: proto3's unset layer
      {"meta-llama/Llama-3-8B", kLayer, true},
      {kModel, 20, true},
      {"meta-llama/Llama-3-8B", 20, true},
  };
  for (const Case& c : cases) {
    const std::string what = c.model + " layer " + std::to_string(c.layer);
    const grpc::Status g = GrpcHello(l, MakeHello(c.model, c.layer));
    const absl::Status s = ShmHello(l, MakeHello(c.model, c.layer));
    if (!c.refused) {
      EXPECT_TRUE(g.ok()) << what << ": " << g.error_message();
      EXPECT_TRUE(s.ok()) << what << ": " << s;
      continue;
    }
    EXPECT_EQ(g.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << what;
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << what << s;
    for (const std::string& msg :
         {g.error_message(), std::string(s.message())}) {
      // Both identities, and the way out.
      EXPECT_NE(msg.find("model_id '" + c.model + "' layer " +
                         std::to_string(c.layer)),
                std::string::npos)
          << msg;
      EXPECT_NE(msg.find("readout 'r' was trained on model_id '" +
                         std::string(kModel) + "' layer " +
                         std::to_string(kLayer)),
                std::string::npos)
          << msg;
      EXPECT_NE(msg.find("--allow_hello_mismatch"), std::string::npos) << msg;
    }
  }
  // Logged by leapd.
  auto line = l.proc->WaitForLine("leapd: refused: hello of engine 'hello-test'",
                                  absl::Seconds(10));
  EXPECT_TRUE(line.ok()) << l.proc->Tail();
}

TEST(HelloIdentity, AllowFlagServesTheMismatchAndLogsIt) {
  Leapd l = Start("allow", {"--allow_hello_mismatch"});
  ASSERT_NE(l.proc, nullptr);
  const pb::Hello other = MakeHello("meta-llama/Llama-3-8B", 20);
  const grpc::Status g = GrpcHello(l, other);
  EXPECT_TRUE(g.ok()) << g.error_message();
  EXPECT_TRUE(ShmHello(l, other).ok());
  auto line = l.proc->WaitForLine("leapd: warning: hello of engine 'hello-test'",
                                  absl::Seconds(10));
  ASSERT_TRUE(line.ok()) << l.proc->Tail();
  EXPECT_NE(line->find("served anyway (--allow_hello_mismatch)"),
            std::string::npos)
      << *line;
}

}  // namespace
}  // namespace leap

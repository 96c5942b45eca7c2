// Hello identity against the readouts (real leapd processes): an engine
// whose Hello.model_id or Hello.layer differs from the metadata of a readout
// of its width is refused with FAILED_PRECONDITION naming both, over gRPC
// Connect and over the shm attach; a matching hello, and a hello or readout
// that declares nothing, is served; --allow_hello_mismatch serves the
// mismatch and logs it. An engine_id or model_id over 256 bytes is refused
// INVALID_ARGUMENT naming the field, on both transports.
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
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

// engine_id and model_id hold at most 256 bytes (docs/WIRE.md, "Sizes"):
// a longer one is refused INVALID_ARGUMENT naming the field, its size, the
// limit and its start, over gRPC Connect and over the shm attach alike; a
// hello too large for an attach packet (an engine_id of 70,000 bytes) is
// refused in words over shm, not hung up on. 256 bytes are served.
TEST(HelloIdentity, OverlongEngineAndModelIdsAreRefusedNamingTheField) {
  Leapd l = Start("ids");
  ASSERT_NE(l.proc, nullptr);
  auto over = [](const char* field, size_t n, char c) {
    return absl::StrCat(field, " of ", n,
                        " bytes is over the limit of 256 bytes (it starts \"",
                        std::string(32, c), "\")");
  };
  struct Case {
    std::string engine_id, model_id, want;
  };
  const Case cases[] = {
      {std::string(257, 'e'), kModel, over("engine_id", 257, 'e')},
      {"hello-test", std::string(300, 'm'), over("model_id", 300, 'm')},
      {std::string(20000, 'e'), std::string(300, 'm'),
       over("engine_id", 20000, 'e')},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.want.substr(0, 30));
    pb::Hello h = MakeHello(c.model_id, kLayer);
    h.set_engine_id(c.engine_id);
    const grpc::Status g = GrpcHello(l, h);
    EXPECT_EQ(g.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(g.error_message(), c.want);
    const absl::Status s = ShmHello(l, h);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(s.message(), "leapd refused the shm attach: " + c.want);
  }
  pb::Hello huge = MakeHello(kModel, kLayer);
  huge.set_engine_id(std::string(70000, 'h'));
  const grpc::Status g = GrpcHello(l, huge);
  EXPECT_EQ(g.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(g.error_message(), over("engine_id", 70000, 'h'));
  const absl::Status s = ShmHello(l, huge);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(),
            "leapd refused the shm attach: shm attach request larger than "
            "65536 bytes (a hello's engine_id and model_id hold at most 256 "
            "bytes each, its instance_id 128)");
  // At the limit: served on both transports (a model_id of 256 bytes gets
  // as far as the identity check: another model than the readout's).
  pb::Hello at_limit = MakeHello(kModel, kLayer);
  at_limit.set_engine_id(std::string(256, 'e'));
  EXPECT_TRUE(GrpcHello(l, at_limit).ok());
  EXPECT_TRUE(ShmHello(l, at_limit).ok());
  const pb::Hello long_model = MakeHello(std::string(256, 'm'), kLayer);
  EXPECT_EQ(GrpcHello(l, long_model).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(ShmHello(l, long_model).code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace leap

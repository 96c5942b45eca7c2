// Writes the seed corpora of the fuzz targets from the real encoders:
//   fuzz_make_seeds OUT_DIR   (writes OUT_DIR/<target>/<name>)
// The committed fuzz/corpus/ was made with it; rerun it after a format
// change and commit what changed.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "common/npy.h"
#include "common/shm_format.h"
#include "leap/v1/predictor.pb.h"
#include "readout/artifact.h"

namespace {

namespace fs = std::filesystem;
namespace pb = ::leap::v1;

fs::path out_dir;

void Write(const std::string& target, const std::string& name,
           const std::string& bytes) {
  fs::create_directories(out_dir / target);
  std::ofstream(out_dir / target / name, std::ios::binary) << bytes;
}

std::string ReadFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)),
                     std::istreambuf_iterator<char>());
}

template <typename T>
void Put(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}

void NpySeeds() {
  const fs::path tmp = out_dir / "npy.tmp";
  struct Case {
    const char* name;
    leap::NpyDType dtype;
    std::vector<int64_t> shape;
  };
  const Case cases[] = {
      {"f4_2x3", leap::NpyDType::kFloat32, {2, 3}},
      {"f8_5", leap::NpyDType::kFloat64, {5}},
      {"f2_4", leap::NpyDType::kFloat16, {4}},
      {"i4_scalar", leap::NpyDType::kInt32, {}},
      {"i8_2x0x3", leap::NpyDType::kInt64, {2, 0, 3}},
  };
  for (const Case& c : cases) {
    std::vector<uint8_t> data(64);
    for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i);
    if (!leap::WriteNpy(tmp.string(), c.dtype, c.shape, data.data()).ok()) {
      std::fprintf(stderr, "WriteNpy failed for %s\n", c.name);
      std::exit(1);
    }
    Write("npy", c.name, ReadFile(tmp));
  }
  fs::remove(tmp);
  // Hand-made headers: version 2.0 and 3.0, other spellings numpy accepts.
  auto file = [](int major, const std::string& dict, size_t data_bytes) {
    std::string out("\x93NUMPY", 6);
    out.push_back(static_cast<char>(major));
    out.push_back(0);
    const std::string header = dict + "\n";
    if (major == 1) {
      Put<uint16_t>(out, static_cast<uint16_t>(header.size()));
    } else {
      Put<uint32_t>(out, static_cast<uint32_t>(header.size()));
    }
    out += header;
    out.append(data_bytes, '\x01');
    return out;
  };
  Write("npy", "v2_f4",
        file(2, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", 12));
  Write("npy", "v3_i8",
        file(3, "{\"descr\": \"=i8\", \"fortran_order\": False, \"shape\": (1, 2)}",
             16));
  Write("npy", "fortran",
        file(1, "{'descr': '|f8', 'fortran_order': True, 'shape': (2L, 1_0)}",
             160));
  Write("npy", "big_endian",
        file(1, "{'descr': '>f4', 'fortran_order': False, 'shape': ()}", 4));
  Write("npy", "nested",
        file(1, "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': "
                "[(1,), None, 'x\\'y']}",
             4));
}

leap::readout::ReadoutState State(int64_t dim, bool with_p) {
  leap::readout::ReadoutState s;
  s.spec.dim = dim;
  s.spec.max_tokens = 2048;
  s.spec.lambda = 0.5;
  s.spec.layer = 3;
  s.spec.model_id = "seed/model";
  s.standardizer.mean = Eigen::VectorXd::LinSpaced(dim, -1.0, 1.0);
  s.standardizer.scale = Eigen::VectorXd::Constant(dim, 1.5);
  s.theta = Eigen::VectorXd::LinSpaced(dim + 1, 0.25, 2.0);
  if (with_p) s.p = leap::readout::SymMatrix::ScaledIdentity(dim + 1, 0.75f);
  s.version = 7;
  s.completions_learned = 12;
  s.train_rows = 100;
  s.note = "seed";
  s.created_unix_ms = 1700000000000;
  return s;
}

void ArtifactSeeds() {
  struct Case {
    const char* name;
    int64_t dim;
    bool with_p;
  };
  const Case cases[] = {{"d1", 1, false}, {"d3_p", 3, true}, {"d8", 8, false}};
  for (const Case& c : cases) {
    auto bytes = leap::readout::SerializeArtifact(State(c.dim, c.with_p));
    if (!bytes.ok()) {
      std::fprintf(stderr, "SerializeArtifact failed\n");
      std::exit(1);
    }
    // Mode 0: the file as is.
    Write("artifact", std::string("raw_") + c.name, std::string(1, '\0') + *bytes);
    // Mode 3: header text \0 array bytes, checksums and trailer by the target.
    uint32_t hlen;
    std::memcpy(&hlen, bytes->data() + 12, 4);
    const size_t start = (16 + hlen + 4 + 63) / 64 * 64;
    const std::string header = bytes->substr(16, hlen);
    const std::string arrays = bytes->substr(start, bytes->size() - 20 - start);
    Write("artifact", std::string("parts_") + c.name,
          std::string(1, '\3') + header + std::string(1, '\0') + arrays);
  }
}

std::string FeaturesPayload(uint64_t seq, int n) {
  std::string p;
  Put<uint64_t>(p, seq);
  Put<uint32_t>(p, static_cast<uint32_t>(n));
  Put<uint32_t>(p, 0);
  for (int i = 0; i < n; ++i) {
    const std::string id = "req-" + std::to_string(i);
    const std::string pl = i % 2 ? "chat" : "";
    std::string rec(leap::shm::FeatureRecordBytes(id.size(), pl.size()), '\0');
    leap::shm::WriteFeatureRecord(rec.data(), static_cast<uint32_t>(i), 100 * i,
                                  id, pl);
    p += rec;
  }
  return p;
}

void ShmSeeds() {
  Write("shm", "features_0", std::string(1, '\0') + FeaturesPayload(1, 0));
  Write("shm", "features_3", std::string(1, '\0') + FeaturesPayload(2, 3));
  // Mode 1: dim, dtype, slots, ring exponent, attach id, mapped, how.
  auto header = [](int32_t dim, uint8_t dtype, uint32_t slots, uint8_t ring_exp,
                   uint8_t how, const std::string& edits) {
    std::string s(1, '\1');
    Put<int32_t>(s, dim);
    Put<uint8_t>(s, dtype);
    Put<uint32_t>(s, slots);
    Put<uint8_t>(s, ring_exp);
    Put<uint64_t>(s, 0x1234567890ull);
    Put<uint32_t>(s, 4096);
    Put<uint8_t>(s, how);
    return s + edits;
  };
  Write("shm", "header_ok", header(4096, 1, 256, 20, 3, ""));
  std::string edit;
  Put<uint16_t>(edit, 40);  // inside dim
  Put<uint8_t>(edit, 7);
  Write("shm", "header_edited", header(64, 3, 8, 16, 3, edit));
  Write("shm", "header_raw", header(16, 2, 1, 17, 0, std::string(200, '\x11')));
  // Mode 2: ring operations.
  auto ring = [](uint8_t exp, const std::string& ops) {
    return std::string(1, '\2') + std::string(1, static_cast<char>(exp)) + ops;
  };
  auto produce = [](uint16_t n, uint8_t kind) {
    std::string s(1, '\0');
    Put<uint16_t>(s, n);
    Put<uint8_t>(s, kind);
    return s;
  };
  const std::string publish(1, '\1'), consume(1, '\2'), release(1, '\3');
  std::string ops;
  for (int i = 0; i < 6; ++i) ops += produce(static_cast<uint16_t>(40 + 8 * i), 1);
  ops += publish;
  for (int i = 0; i < 6; ++i) ops += consume;
  ops += release;
  Write("shm", "ring_roundtrip", ring(4, ops));  // 1 KiB ring
  std::string wrap;
  for (int k = 0; k < 20; ++k) {
    wrap += produce(static_cast<uint16_t>(100 + k), static_cast<uint8_t>(k % 6));
    wrap += produce(60, 1);
    wrap += publish + consume + consume + release;
  }
  Write("shm", "ring_wrap", ring(3, wrap));  // 512 B ring
  std::string features = produce(static_cast<uint16_t>(FeaturesPayload(3, 2).size()), 2);
  features += FeaturesPayload(3, 2) + publish + consume + release;
  Write("shm", "ring_features", ring(6, features));
  std::string hostile = produce(16, 1) + publish;
  hostile += std::string(1, '\5') + std::string(1, '\1');
  Put<uint64_t>(hostile, 1 << 20);
  hostile += consume;
  Write("shm", "ring_hostile_tail", ring(4, hostile));
}

// "r<i>" (appended, not "r" + to_string: GCC 12's -Wrestrict misfires there).
std::string Id(int i) {
  std::string id = "r";
  id += std::to_string(i);
  return id;
}

std::string Stream(const std::vector<pb::EngineMessage>& msgs) {
  std::string out;
  for (const auto& m : msgs) {
    const std::string b = m.SerializeAsString();
    uint32_t n = static_cast<uint32_t>(b.size());
    while (n >= 0x80) {
      out.push_back(static_cast<char>(n | 0x80));
      n >>= 7;
    }
    out.push_back(static_cast<char>(n));
    out += b;
  }
  return out;
}

pb::EngineMessage Hello(pb::FeatureDType dtype, int64_t dim,
                        const std::string& instance = "") {
  pb::EngineMessage m;
  m.mutable_hello()->set_instance_id(instance);
  m.set_seq(1);
  m.mutable_hello()->set_dim(dim);
  m.mutable_hello()->set_dtype(dtype);
  m.mutable_hello()->set_model_id("fuzz");
  return m;
}

pb::EngineMessage Features(uint64_t seq, int n, size_t bytes,
                           const std::string& product_line) {
  pb::EngineMessage m;
  m.set_seq(seq);
  for (int i = 0; i < n; ++i) {
    auto* r = m.mutable_features()->add_records();
    r->set_request_id(Id(i));
    r->set_product_line(product_line);
    std::string f(bytes, '\0');
    for (size_t k = 0; k < bytes; ++k) f[k] = static_cast<char>(k % 4 == 3 ? 0x3f : 0);
    r->set_features(f);
    r->mutable_decoding()->set_max_tokens(i * 300);
  }
  return m;
}

pb::EngineMessage Completions(uint64_t seq, int n, pb::FinishReason reason) {
  pb::EngineMessage m;
  m.set_seq(seq);
  for (int i = 0; i < n; ++i) {
    auto* c = m.mutable_completions()->add_completions();
    c->set_request_id(Id(i));
    c->set_output_tokens(50 + 100 * i);
    c->set_reason(reason);
  }
  return m;
}

// Completions that carry their prompt length (they teach the length
// prior), and prior queries at arrival (one bad record: prompt_tokens 0).
pb::EngineMessage PromptCompletions(uint64_t seq, int n) {
  pb::EngineMessage m = Completions(seq, n, pb::FINISH_REASON_STOP);
  for (int i = 0; i < n; ++i) {
    m.mutable_completions()->mutable_completions(i)->set_prompt_tokens(10 + 40 * i);
  }
  return m;
}

pb::EngineMessage PriorQueries(uint64_t seq, int n) {
  pb::EngineMessage m;
  m.set_seq(seq);
  for (int i = 0; i < n; ++i) {
    auto* r = m.mutable_prior_queries()->add_records();
    r->set_request_id(Id(i));
    r->set_product_line(i % 2 ? "pl" : "");
    r->set_prompt_tokens(i == n - 1 ? 0 : 20 * (i + 1));
    r->mutable_decoding()->set_max_tokens(i * 100);
  }
  return m;
}

pb::EngineMessage Cancels(uint64_t seq, int n) {
  pb::EngineMessage m;
  m.set_seq(seq);
  for (int i = 0; i < n; ++i) m.mutable_cancels()->add_request_ids(Id(i));
  return m;
}

void EngineSeeds() {
  Write("engine_session", "predict_complete",
        Stream({Hello(pb::FEATURE_DTYPE_FLOAT32, 4), Features(2, 3, 16, ""),
                Completions(3, 3, pb::FINISH_REASON_STOP)}));
  Write("engine_session", "predict_cancel_bf16",
        Stream({Hello(pb::FEATURE_DTYPE_BFLOAT16, 4), Features(2, 2, 8, "pl"),
                Cancels(3, 3)}));
  Write("engine_session", "fp16_length_mixed",
        Stream({Hello(pb::FEATURE_DTYPE_FLOAT16, 4), Features(2, 4, 8, "pl"),
                Features(3, 1, 7, ""), Completions(4, 2, pb::FINISH_REASON_LENGTH),
                Completions(5, 2, pb::FINISH_REASON_ABORTED), Cancels(6, 4)}));
  pb::EngineMessage empty;
  empty.set_seq(9);
  Write("engine_session", "second_hello_empty",
        Stream({Hello(pb::FEATURE_DTYPE_FLOAT32, 4),
                Hello(pb::FEATURE_DTYPE_FLOAT32, 4), empty,
                Completions(10, 1, pb::FINISH_REASON_UNSPECIFIED)}));
  Write("engine_session", "instance_predict_complete",
        Stream({Hello(pb::FEATURE_DTYPE_FLOAT32, 4, "engine-a"),
                Features(2, 2, 16, "pl"), Completions(3, 2, pb::FINISH_REASON_STOP),
                Completions(4, 2, pb::FINISH_REASON_STOP)}));
  Write("engine_session", "prior_learn_query",
        Stream({Hello(pb::FEATURE_DTYPE_FLOAT32, 4), PriorQueries(2, 3),
                Features(3, 3, 16, "pl"), PromptCompletions(4, 3),
                PriorQueries(5, 4)}));
  Write("engine_session", "dim_mismatch",
        Stream({Hello(pb::FEATURE_DTYPE_FLOAT32, 8), Features(2, 1, 32, "")}));
}

}  // namespace

// shm_frames: first byte 0 kPredictions, 1 kRelease, 2 kCancels.
void ShmFrameSeeds() {
  namespace shm = leap::shm;
  auto predictions = [](uint64_t seq, int n, int errors) {
    std::string p;
    Put<uint64_t>(p, seq);
    Put<uint32_t>(p, static_cast<uint32_t>(n));
    Put<uint32_t>(p, static_cast<uint32_t>(errors));
    for (int i = 0; i < n; ++i) {
      const std::string id = "req-" + std::to_string(i);
      const std::string arm = i % 2 ? "b" : "";
      std::string rec(shm::PredictionRecordBytes(id.size(), 1, arm.size()), '\0');
      shm::WritePredictionRecord(rec.data(), static_cast<uint32_t>(i), id, "r",
                                 arm, 120.0 + i, 10.9 + i, 3);
      p += rec;
    }
    for (int i = 0; i < errors; ++i) {
      const std::string id = "bad-" + std::to_string(i);
      const std::string msg = "expected 4 float32 values (16 bytes), got 12";
      std::string rec(shm::ErrorRecordBytes(id.size(), msg.size()), '\0');
      shm::WriteErrorRecord(rec.data(), 7, id, 3, msg);
      p += rec;
    }
    return p;
  };
  Write("shm_frames", "predictions_0", std::string(1, '\0') + predictions(1, 0, 0));
  Write("shm_frames", "predictions_3_1", std::string(1, '\0') + predictions(2, 3, 1));
  std::string truncated = predictions(3, 2, 0);
  truncated.resize(truncated.size() - 5);
  Write("shm_frames", "predictions_truncated", std::string(1, '\0') + truncated);
  auto release = [](std::vector<uint32_t> slots, uint32_t claimed) {
    std::string p;
    Put<uint32_t>(p, claimed);
    Put<uint32_t>(p, 0);
    for (uint32_t s : slots) Put<uint32_t>(p, s);
    return p;
  };
  Write("shm_frames", "release_3", std::string(1, '\1') + release({0, 5, 2}, 3));
  Write("shm_frames", "release_overclaimed",
        std::string(1, '\1') + release({1, 2}, 1000));
  auto cancels = [](uint64_t seq, const std::vector<std::string>& ids) {
    std::string p;
    Put<uint64_t>(p, seq);
    Put<uint32_t>(p, static_cast<uint32_t>(ids.size()));
    Put<uint32_t>(p, 0);
    for (const std::string& id : ids) {
      Put<uint16_t>(p, static_cast<uint16_t>(id.size()));
      p += id;
    }
    return p;
  };
  Write("shm_frames", "cancels_2", std::string(1, '\2') + cancels(4, {"a5", "ghost"}));
  Write("shm_frames", "cancels_nul_and_empty",
        std::string(1, '\2') + cancels(5, {std::string("a\0b", 3), ""}));
  std::string over = cancels(6, {"abc"});
  over.resize(over.size() - 1);
  Write("shm_frames", "cancels_overrun", std::string(1, '\2') + over);
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_make_seeds OUT_DIR\n");
    return 2;
  }
  out_dir = argv[1];
  fs::create_directories(out_dir);
  NpySeeds();
  ArtifactSeeds();
  ShmSeeds();
  ShmFrameSeeds();
  EngineSeeds();
  std::printf("seeds written to %s\n", argv[1]);
  return 0;
}

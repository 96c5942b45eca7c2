#include "sidecar/grpc/admin_auth.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <string>

#include "gtest/gtest.h"

namespace leap::sidecar {
namespace {

using Metadata = std::multimap<grpc::string_ref, grpc::string_ref>;

class TokenFile {
 public:
  explicit TokenFile(const std::string& content) {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl =
        std::string(base && *base ? base : "/tmp") + "/admin_auth_test.XXXXXX";
    int fd = ::mkstemp(tmpl.data());
    EXPECT_GE(fd, 0);
    ::close(fd);
    path_ = tmpl;
    std::ofstream(path_, std::ios::binary) << content;
  }
  ~TokenFile() { ::unlink(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(ReadAdminTokenFile, TrimsSurroundingWhitespace) {
  TokenFile f("  s3cret-token\n");
  auto t = ReadAdminTokenFile(f.path());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t, "s3cret-token");
}

TEST(ReadAdminTokenFile, RefusesEmptyMissingAndMultiWord) {
  TokenFile empty(" \n\n");
  EXPECT_EQ(ReadAdminTokenFile(empty.path()).status().code(),
            absl::StatusCode::kInvalidArgument);
  TokenFile two("one two\n");
  EXPECT_EQ(ReadAdminTokenFile(two.path()).status().code(),
            absl::StatusCode::kInvalidArgument);
  TokenFile huge(std::string(5000, 'a'));
  EXPECT_EQ(ReadAdminTokenFile(huge.path()).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto missing = ReadAdminTokenFile("/nonexistent/leap/admin.token");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent/leap/admin.token"),
            std::string::npos);
}

TEST(ConstantTimeEquals, ComparesWholeStrings) {
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abd", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("ab", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abcd", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("", "abc"));
  EXPECT_FALSE(ConstantTimeEquals(absl::string_view("abc\0", 4), "abc"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
}

TEST(AdminAuth, WithoutTokenEverythingPasses) {
  AdminAuth auth;
  EXPECT_FALSE(auth.enabled());
  EXPECT_TRUE(auth.Check("ipv4:10.0.0.3:5555", Metadata()).ok());
}

TEST(AdminAuth, TcpNeedsTheBearerToken) {
  AdminAuth auth("tok");
  const std::string peer = "ipv4:127.0.0.1:41234";
  absl::Status none = auth.Check(peer, Metadata());
  EXPECT_EQ(none.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_NE(none.message().find("authorization: Bearer"), std::string::npos)
      << none;

  Metadata basic = {{"authorization", "Basic dG9rOg=="}};
  absl::Status b = auth.Check(peer, basic);
  EXPECT_EQ(b.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_NE(b.message().find("not 'Bearer"), std::string::npos) << b;

  Metadata wrong = {{"authorization", "Bearer tok2"}};
  absl::Status w = auth.Check(peer, wrong);
  EXPECT_EQ(w.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_NE(w.message().find("does not match"), std::string::npos) << w;

  Metadata right = {{"authorization", "Bearer tok"}};
  EXPECT_TRUE(auth.Check(peer, right).ok());
  Metadata lower = {{"authorization", "bearer tok"}};
  EXPECT_TRUE(auth.Check("ipv6:[::1]:5555", lower).ok());
  // One good value among several is enough.
  Metadata several = {{"authorization", "Bearer nope"},
                      {"authorization", "Bearer tok"}};
  EXPECT_TRUE(auth.Check(peer, several).ok());
}

TEST(AdminAuth, UnixSocketPeersAreTrusted) {
  AdminAuth auth("tok");
  EXPECT_TRUE(auth.Check("unix:", Metadata()).ok());
  EXPECT_TRUE(auth.Check("unix:/run/leap/leapd.sock", Metadata()).ok());
  // Abstract sockets are reachable from the whole network namespace.
  EXPECT_EQ(auth.Check("unix-abstract:leap", Metadata()).code(),
            absl::StatusCode::kUnauthenticated);
}

}  // namespace
}  // namespace leap::sidecar

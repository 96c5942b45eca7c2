#include "tools/leapctl/flags.h"

#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace leap::leapctl {
namespace {

using ::testing::HasSubstr;

struct Parsed {
  std::string path;
  int64_t n = 5;
  double x = 0.25;
  std::optional<double> lambda;
  bool flag = false;
};

FlagSet MakeFlags(Parsed& p) {
  FlagSet f("cmd", "leapctl cmd --path P", "Does things.");
  f.String("path", &p.path, "PATH", "A path.", /*required=*/true);
  f.Int64("n", &p.n, "N", "A count.");
  f.Double("x", &p.x, "X", "A number.");
  f.OptionalDouble("lambda", &p.lambda, "L", "Maybe a number.");
  f.Bool("flag", &p.flag, "A switch.");
  return f;
}

TEST(FlagSetTest, ParsesBothValueForms) {
  Parsed p;
  FlagSet f = MakeFlags(p);
  ASSERT_TRUE(f.Parse({"--path", "a.npy", "--n=12", "--x", "-1.5e3", "--flag",
                       "--lambda=0"})
                  .ok());
  EXPECT_EQ(p.path, "a.npy");
  EXPECT_EQ(p.n, 12);
  EXPECT_EQ(p.x, -1500.0);
  ASSERT_TRUE(p.lambda.has_value());
  EXPECT_EQ(*p.lambda, 0.0);
  EXPECT_TRUE(p.flag);
  EXPECT_TRUE(f.WasSet("n"));
}

TEST(FlagSetTest, DefaultsStayWhenAbsent) {
  Parsed p;
  FlagSet f = MakeFlags(p);
  ASSERT_TRUE(f.Parse({"--path", "a"}).ok());
  EXPECT_EQ(p.n, 5);
  EXPECT_EQ(p.x, 0.25);
  EXPECT_FALSE(p.lambda.has_value());
  EXPECT_FALSE(p.flag);
  EXPECT_FALSE(f.WasSet("n"));
}

TEST(FlagSetTest, UsageErrors) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{}, "missing required flag --path"},
      {{"--path", "a", "--bogus"}, "unknown flag --bogus"},
      {{"--path", "a", "--n", "1x"}, "invalid value '1x' for --n"},
      {{"--path", "a", "--x", "nan"}, "invalid value 'nan' for --x"},
      {{"--path", "a", "--n"}, "flag --n needs a value"},
      {{"--path", "a", "--path", "b"}, "given more than once"},
      {{"--path", "a", "--flag=yes"}, "takes no value"},
      {{"--path", "a", "stray"}, "unexpected argument 'stray'"},
  };
  for (const auto& [args, want] : cases) {
    Parsed p;
    FlagSet f = MakeFlags(p);
    absl::Status s = f.Parse(args);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << want;
    EXPECT_THAT(std::string(s.message()), HasSubstr(want));
  }
}

TEST(FlagSetTest, HelpSkipsRequiredChecksAndListsEveryFlag) {
  Parsed p;
  FlagSet f = MakeFlags(p);
  ASSERT_TRUE(f.Parse({"--help"}).ok());
  EXPECT_TRUE(f.help_requested());
  const std::string h = f.Help();
  EXPECT_THAT(h, HasSubstr("Usage: leapctl cmd --path P"));
  EXPECT_THAT(h, HasSubstr("--path PATH\n      A path. Required."));
  EXPECT_THAT(h, HasSubstr("--n N\n      A count. Default: 5."));
  EXPECT_THAT(h, HasSubstr("--x X\n      A number. Default: 0.25."));
  EXPECT_THAT(h, HasSubstr("--lambda L\n"));
  EXPECT_THAT(h, HasSubstr("--flag\n      A switch."));
}

TEST(FlagSetTest, PositionalsAndListFlags) {
  std::string name, extra;
  std::vector<std::string> arms;
  bool json = false;
  FlagSet f("cmd", "leapctl cmd NAME [EXTRA]", "Does things.");
  f.Positional("NAME", &name, "The name.");
  f.Positional("EXTRA", &extra, "More.", /*required=*/false);
  f.StringList("arm", &arms, "SPEC", "An arm.");
  f.Bool("json", &json, "JSON.");
  ASSERT_TRUE(
      f.Parse({"--arm", "a=x:50", "n1", "--json", "--arm=b=y:50"}).ok());
  EXPECT_EQ(name, "n1");
  EXPECT_EQ(extra, "");
  EXPECT_FALSE(f.WasSet("EXTRA"));
  EXPECT_EQ(arms, (std::vector<std::string>{"a=x:50", "b=y:50"}));
  EXPECT_TRUE(json);

  // "--" makes the rest positional, even when it looks like a flag; an empty
  // argument is a value.
  std::string a, b;
  FlagSet g("cmd", "u", "d");
  g.Positional("A", &a, "a");
  g.Positional("B", &b, "b");
  ASSERT_TRUE(g.Parse({"", "--", "--json"}).ok());
  EXPECT_EQ(a, "");
  EXPECT_EQ(b, "--json");
  EXPECT_TRUE(g.WasSet("A"));

  const std::string h = f.Help();
  EXPECT_THAT(h, HasSubstr("Arguments:\n  NAME\n      The name. Required.\n"));
  EXPECT_THAT(h, HasSubstr("  EXTRA\n      More.\n"));
  EXPECT_THAT(h, HasSubstr("--arm SPEC\n      An arm. Repeatable.\n"));
}

TEST(FlagSetTest, PositionalUsageErrors) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{}, "missing required argument NAME"},
      {{"a", "b"}, "unexpected argument 'b' (too many arguments)"},
      {{"a", "--arm"}, "flag --arm needs a value"},
      {{"a", "--arm="}, "invalid value '' for --arm"},
  };
  for (const auto& [args, want] : cases) {
    std::string name;
    std::vector<std::string> arms;
    FlagSet f("cmd", "u", "d");
    f.Positional("NAME", &name, "n");
    f.StringList("arm", &arms, "SPEC", "s");
    absl::Status s = f.Parse(args);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << want;
    EXPECT_THAT(std::string(s.message()), HasSubstr(want));
  }
}

}  // namespace
}  // namespace leap::leapctl

#include "sidecar/core/routing.h"

#include <cstdint>
#include <map>
#include <set>
#include <string>

#include "gtest/gtest.h"

namespace leap::sidecar {
namespace {

Arm Serving(const std::string& name, double percent) {
  return Arm{name, "r-" + name, percent, false};
}

Arm Shadow(const std::string& name) { return Arm{name, "r-" + name, 0, true}; }

// Expects `s` to be INVALID_ARGUMENT with `needle` in its message.
void ExpectInvalid(const absl::Status& s, const std::string& needle) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find(needle), std::string::npos)
      << "'" << s.message() << "' does not mention '" << needle << "'";
}

TEST(RouteValidate, AcceptsWellFormedRoutes) {
  EXPECT_TRUE((Route{"", {Serving("a", 100)}}).Validate().ok());
  EXPECT_TRUE(
      (Route{"search", {Serving("a", 30), Serving("b", 70), Shadow("s")}})
          .Validate()
          .ok());
  // Thirds: the sum is 100 within rounding.
  EXPECT_TRUE((Route{"x",
                     {Serving("a", 100.0 / 3), Serving("b", 100.0 / 3),
                      Serving("c", 100.0 / 3)}})
                  .Validate()
                  .ok());
  // A single unnamed arm is allowed (leapd names it after its readout).
  EXPECT_TRUE((Route{"", {Arm{"", "r", 100, false}}}).Validate().ok());
}

TEST(RouteValidate, PercentsMustSumToHundred) {
  ExpectInvalid((Route{"p", {Serving("a", 30), Serving("b", 60)}}).Validate(),
                "sum to 100, got 90");
  ExpectInvalid((Route{"p", {Serving("a", 50), Serving("b", 60)}}).Validate(),
                "sum to 100, got 110");
  // Shadow percents do not count towards the sum.
  ExpectInvalid(
      (Route{"p", {Serving("a", 70), Arm{"s", "r-s", 30, true}}}).Validate(),
      "sum to 100, got 70");
  ExpectInvalid((Route{"p", {Serving("a", 0), Serving("b", 100)}}).Validate(),
                "percent must be in (0, 100], got 0");
  ExpectInvalid((Route{"p", {Serving("a", -10), Serving("b", 110)}}).Validate(),
                "percent must be in (0, 100]");
}

TEST(RouteValidate, NeedsAServingArm) {
  ExpectInvalid((Route{"p", {}}).Validate(), "has no arms");
  ExpectInvalid((Route{"p", {Shadow("s")}}).Validate(), "only shadow arms");
  ExpectInvalid((Route{"p", {Shadow("s"), Shadow("t")}}).Validate(),
                "only shadow arms");
}

TEST(RouteValidate, ArmNamesAreUniqueAndSet) {
  ExpectInvalid((Route{"p", {Serving("a", 50), Serving("a", 50)}}).Validate(),
                "duplicate arm name 'a'");
  // A shadow may not reuse a serving arm's name either.
  ExpectInvalid(
      (Route{"p", {Serving("a", 100), Arm{"a", "r-s", 0, true}}}).Validate(),
      "duplicate arm name 'a'");
  ExpectInvalid(
      (Route{"p", {Serving("a", 50), Arm{"", "r-b", 50, false}}}).Validate(),
      "needs a name");
}

TEST(RouteValidate, EveryArmNamesAReadout) {
  ExpectInvalid(
      (Route{"p", {Serving("a", 50), Arm{"b", "", 50, false}}}).Validate(),
      "arm 'b' names no readout");
  ExpectInvalid(
      (Route{"p", {Serving("a", 100), Arm{"s", "", 0, true}}}).Validate(),
      "arm 's' names no readout");
}

// Values from an independent implementation (Python: FNV-1a 64 over the
// UTF-8 bytes, then the splitmix64 finalizer). The hash decides the arm of
// every request id in production: if this test breaks, request ids move
// between A/B arms across a leapd upgrade.
TEST(StableRequestHash, FixedValues) {
  EXPECT_EQ(StableRequestHash(""), 0xf52a15e9a9b5e89bull);
  EXPECT_EQ(StableRequestHash("a"), 0x02c0bdbf481420f8ull);
  EXPECT_EQ(StableRequestHash("q-0"), 0x12ae6b9686954330ull);
  EXPECT_EQ(StableRequestHash("q-1"), 0x948866c7745c2b73ull);
  EXPECT_EQ(StableRequestHash("req-12345"), 0xdb87d21387f70a71ull);
  EXPECT_EQ(StableRequestHash("search/q-9999"), 0xfbe98e90c24445b8ull);
}

TEST(RoutingTableChoose, ArmFollowsTheHashPosition) {
  // Position = hash % 10^6 / 10^4: q-0 is at 55.2432, q-1 at 70.6291,
  // "" at 2.6203, "a" at 98.3736 (see FixedValues).
  const Route r{
      "p",
      {Serving("a", 55.2432), Serving("b", 15.3858), Serving("c", 29.371)}};
  ASSERT_TRUE(r.Validate().ok());
  // At a's upper edge (exclusive): b.
  EXPECT_EQ(RoutingTable::Choose(r, "q-0").serving->name, "b");
  // 1e-4 past b's upper edge (70.629): c.
  EXPECT_EQ(RoutingTable::Choose(r, "q-1").serving->name, "c");
  EXPECT_EQ(RoutingTable::Choose(r, "").serving->name, "a");
  EXPECT_EQ(RoutingTable::Choose(r, "a").serving->name, "c");
}

TEST(RoutingTableChoose, SplitMatchesPercentsAndShadowsScoreEverything) {
  const Route r{"p",
                {Serving("a", 30), Shadow("s1"), Serving("b", 50),
                 Serving("c", 20), Shadow("s2")}};
  ASSERT_TRUE(r.Validate().ok());
  constexpr int kIds = 200000;
  std::map<std::string, int> counts;
  for (int i = 0; i < kIds; ++i) {
    const std::string id = "req-" + std::to_string(i);
    const ArmChoice c = RoutingTable::Choose(r, id);
    ASSERT_NE(c.serving, nullptr);
    ASSERT_FALSE(c.serving->shadow) << id;
    ASSERT_EQ(c.shadows.size(), 2u);
    EXPECT_EQ(c.shadows[0]->name, "s1");
    EXPECT_EQ(c.shadows[1]->name, "s2");
    ++counts[c.serving->name];
    // Pure function of the id.
    ASSERT_EQ(RoutingTable::Choose(r, id).serving, c.serving);
  }
  EXPECT_EQ(counts.size(), 3u);
  // Binomial sd at 200k ids is ~0.11 %: 0.5 % is > 4 sd.
  EXPECT_NEAR(counts["a"] / double{kIds}, 0.30, 0.005);
  EXPECT_NEAR(counts["b"] / double{kIds}, 0.50, 0.005);
  EXPECT_NEAR(counts["c"] / double{kIds}, 0.20, 0.005);
}

TEST(RoutingTableChoose, RoundingAtTheTopStillPicksAServingArm) {
  // Percents that sum to just under 100 (accepted by Validate): ids whose
  // position lies above the sum fall to the last serving arm.
  const Route r{"p", {Serving("a", 50), Serving("b", 50 - 1e-7), Shadow("s")}};
  ASSERT_TRUE(r.Validate().ok());
  std::set<std::string> seen;
  for (int i = 0; i < 20000; ++i) {
    const ArmChoice c = RoutingTable::Choose(r, "id-" + std::to_string(i));
    ASSERT_NE(c.serving, nullptr);
    ASSERT_FALSE(c.serving->shadow);
    seen.insert(c.serving->name);
  }
  EXPECT_EQ(seen, (std::set<std::string>{"a", "b"}));
}

TEST(RoutingTable, FindFallsBackToTheDefaultRoute) {
  RoutingTable empty;
  EXPECT_EQ(empty.Find("search").status().code(), absl::StatusCode::kNotFound);
  auto t1 = empty.With(Route{"search", {Serving("a", 100)}});
  ASSERT_TRUE(t1->Find("search").ok());
  EXPECT_EQ((*t1->Find("search"))->arms[0].name, "a");
  EXPECT_EQ(t1->Find("chat").status().code(), absl::StatusCode::kNotFound);
  auto t2 = t1->With(Route{"", {Serving("d", 100)}});
  ASSERT_TRUE(t2->Find("chat").ok());
  EXPECT_EQ((*t2->Find("chat"))->product_line, "");
  EXPECT_EQ((*t2->Find("search"))->product_line, "search");
  // Tables are immutable: With/Without return new ones.
  EXPECT_EQ(t1->routes().size(), 1u);
  auto t3 = t2->Without("search");
  EXPECT_EQ((*t3->Find("search"))->product_line, "");
  EXPECT_EQ(t2->routes().size(), 2u);
  EXPECT_EQ(t3->routes().size(), 1u);
}

}  // namespace
}  // namespace leap::sidecar

// AutoRebalancer's decisions, with its readings and actions faked: it acts only after `checks`
// low readings in a row, only on advice that predicts enough gain, and at most once per gap.
#include "server/gateway/auto_rebalancer.h"

#include <vector>

#include "gtest/gtest.h"

namespace moe {
namespace {

struct Fake {
  double balance = 1.0;
  double current = 0.3, predicted = 0.9;
  int advised = 0;
  std::vector<std::string> applied;
  absl::Status apply_status;

  AutoRebalancer::Hooks Hooks() {
    AutoRebalancer::Hooks hooks;
    hooks.balancedness = [this] { return balance; };
    hooks.advise = [this](int redundant) -> absl::StatusOr<moe::v1::PlacementAdvice> {
      ++advised;
      moe::v1::PlacementAdvice advice;
      advice.set_placement("placement with " + std::to_string(redundant));
      advice.set_current_balancedness(current);
      advice.set_predicted_balancedness(predicted);
      return advice;
    };
    hooks.apply = [this](const std::string& placement) {
      applied.push_back(placement);
      return apply_status;
    };
    return hooks;
  }
};

AutoRebalanceOptions Options(absl::Duration gap) {
  AutoRebalanceOptions o;
  o.enabled = true;
  o.threshold = 0.7;
  o.checks = 3;
  o.redundant = 4;
  o.interval = absl::Hours(1);  // the thread stays out of the way: the test calls Check()
  o.min_gap = gap;
  return o;
}

TEST(AutoRebalancerTest, ActsAfterEnoughLowReadingsInARowOnly) {
  Fake fake;
  AutoRebalancer rebalancer(Options(absl::ZeroDuration()), fake.Hooks());
  fake.balance = 0.5;
  EXPECT_FALSE(rebalancer.Check());
  EXPECT_FALSE(rebalancer.Check());
  fake.balance = 0.8;  // one good reading starts the count again
  EXPECT_FALSE(rebalancer.Check());
  fake.balance = 0.5;
  EXPECT_FALSE(rebalancer.Check());
  EXPECT_FALSE(rebalancer.Check());
  EXPECT_EQ(fake.advised, 0);
  EXPECT_TRUE(rebalancer.Check());
  ASSERT_EQ(fake.applied.size(), 1u);
  EXPECT_EQ(fake.applied[0], "placement with 4");
}

TEST(AutoRebalancerTest, AdviceWithTooLittleGainIsKept) {
  Fake fake;
  fake.current = 0.5;
  fake.predicted = 0.52;  // below min_gain 0.05
  AutoRebalancer rebalancer(Options(absl::ZeroDuration()), fake.Hooks());
  fake.balance = 0.5;
  for (int i = 0; i < 6; ++i) EXPECT_FALSE(rebalancer.Check());
  EXPECT_GT(fake.advised, 0);
  EXPECT_TRUE(fake.applied.empty());
}

TEST(AutoRebalancerTest, AtMostOneChangePerGapAndAFailedChangeCounts) {
  Fake fake;
  fake.apply_status = absl::UnavailableError("a rank could not load");
  AutoRebalancer rebalancer(Options(absl::Hours(1)), fake.Hooks());
  fake.balance = 0.5;
  for (int i = 0; i < 12; ++i) rebalancer.Check();
  EXPECT_EQ(fake.applied.size(), 1u) << "one attempt, then the gap";
}

}  // namespace
}  // namespace moe

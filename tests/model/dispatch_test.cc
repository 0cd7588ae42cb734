// DispatchPlan: which replica of each chosen expert a token's row goes to. GroupByExpert: a rank
// regroups the per-row expert choices it was sent (off the wire) by local expert, refusing
// malformed ones before reading a row.
#include "model/dispatch.h"

#include "gtest/gtest.h"

namespace moe {
namespace {

RowAssignments Rows(std::vector<int32_t> offsets, std::vector<int32_t> experts) {
  RowAssignments r;
  r.offsets = std::move(offsets);
  r.local_experts = std::move(experts);
  for (size_t i = 0; i < r.local_experts.size(); ++i)
    r.gates.push_back(0.125f * static_cast<float>(i + 1));
  return r;
}

TEST(GroupByExpertTest, RowsAscendWithinEachExpert) {
  // Row 0 -> experts 2, 0; row 1 -> none; row 2 -> 0, 1.
  auto g = GroupByExpert(Rows({0, 2, 2, 4}, {2, 0, 0, 1}), 3);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->offsets, (std::vector<int32_t>{0, 2, 3, 4}));
  EXPECT_EQ(g->rows, (std::vector<int32_t>{0, 2, 2, 0}));
  EXPECT_EQ(g->gates, (std::vector<float>{0.25f, 0.375f, 0.5f, 0.125f}));
}

TEST(GroupByExpertTest, MalformedAssignmentsAreRefused) {
  EXPECT_EQ(GroupByExpert(Rows({1, 2}, {0, 0}), 2).status().message(), "malformed row assignments");
  EXPECT_EQ(GroupByExpert(Rows({0, 1}, {0, 0}), 2).status().message(), "malformed row assignments");
  EXPECT_EQ(GroupByExpert(Rows({0, 2}, {0, 5}), 2).status().message(),
            "local expert 5 outside [0, 2)");
}

// Found by tests/fuzz (step target): offsets that jump past the end and come back read
// local_experts[2..99] before the descent was noticed.
TEST(GroupByExpertTest, OffsetsThatDescendAreRefusedBeforeAnyRowIsRead) {
  const auto g = GroupByExpert(Rows({0, 100, 2}, {1, 0}), 2);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g.status().message(), "row assignment offsets not ascending");
  EXPECT_EQ(GroupByExpert(Rows({0, -5, 2}, {1, 0}), 2).status().message(),
            "row assignment offsets not ascending");
}

// A placement text can come from the network: nothing in it may make the parser expand more
// than num_experts ids per rank, or store more ranks than allowed.
TEST(ExpertPlacementTest, ParseRefusesHugeRangesRepeatsAndTooManyRanks) {
  auto ok = ExpertPlacement::Parse(8, "# comment\n0-3, 7\n4-6\n", 2);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->rank_experts[0], (std::vector<int>{0, 1, 2, 3, 7}));
  EXPECT_EQ(ExpertPlacement::Parse(8, "0-2147483647\n").status().message(),
            "placement: rank 0 lists expert 2147483647 outside [0, 8)");
  EXPECT_EQ(ExpertPlacement::Parse(8, "0-7\n3-5,0-7,0-7\n").status().message(),
            "placement: rank 1 lists expert 3 twice");
  EXPECT_EQ(ExpertPlacement::Parse(8, "0-7\n0-7\n0-7\n", 2).status().message(),
            "placement has more than 2 ranks");
  EXPECT_EQ(ExpertPlacement::Parse(8, "0-7\n-1\n").status().code(),
            absl::StatusCode::kInvalidArgument);
}

Routing MakeRouting(int top_k, std::vector<int32_t> ids) {
  Routing r;
  r.top_k = top_k;
  r.tokens = static_cast<int64_t>(ids.size()) / top_k;
  r.ids = std::move(ids);
  for (size_t i = 0; i < r.ids.size(); ++i) r.weights.push_back(0.5f + 0.01f * i);
  return r;
}

// Assignments per rank, and rows per rank.
std::vector<int64_t> Pairs(const DispatchPlan& plan) {
  std::vector<int64_t> out;
  for (const RankDispatch& rd : plan.ranks)
    out.push_back(static_cast<int64_t>(rd.assignments.local_experts.size()));
  return out;
}

TEST(DispatchPlanTest, AHotReplicatedExpertIsSplitEvenlyOverItsReplicas) {
  // Expert 0 on ranks 0, 1 and 2; expert 1 on rank 2 only. 9 tokens choose expert 0 alone.
  auto p = ExpertPlacement::FromRankExperts(2, {{0}, {0}, {0, 1}});
  ASSERT_TRUE(p.ok()) << p.status();
  auto plan = DispatchPlan::Build(MakeRouting(1, std::vector<int32_t>(9, 0)), *p);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(Pairs(*plan), (std::vector<int64_t>{3, 3, 3}));
  // Deterministic: the same routing gives the same plan.
  auto again = DispatchPlan::Build(MakeRouting(1, std::vector<int32_t>(9, 0)), *p);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(again->ranks[r].token_rows, plan->ranks[r].token_rows);
}

TEST(DispatchPlanTest, AReplicaOnARankTheRowGoesToAnywayIsPreferred) {
  // Expert 1 lives on rank 1 only, so a token choosing 0 and 1 sends its row to rank 1: its
  // expert 0 (on both ranks) goes there too, one row instead of two.
  auto p = ExpertPlacement::FromRankExperts(2, {{0}, {0, 1}});
  ASSERT_TRUE(p.ok()) << p.status();
  auto plan = DispatchPlan::Build(MakeRouting(2, {0, 1, 0, 1, 1, 0}), *p);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->ranks[0].token_rows.empty());
  EXPECT_EQ(plan->ranks[1].token_rows, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(plan->ranks[1].assignments.offsets, (std::vector<int32_t>{0, 2, 4, 6}));
  // Local ids on rank 1: expert 0 -> 0, expert 1 -> 1, ascending per row; gates follow them.
  EXPECT_EQ(plan->ranks[1].assignments.local_experts, (std::vector<int32_t>{0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(plan->ranks[1].assignments.gates[4], 0.5f + 0.01f * 5);  // token 2 chose 1, then 0
}

TEST(DispatchPlanTest, OnlyLiveReplicasAndThePreciseErrorWhenNoneIsLeft) {
  auto p = ExpertPlacement::FromRankExperts(3, {{0, 1}, {0, 2}, {1, 2}});
  ASSERT_TRUE(p.ok()) << p.status();
  const Routing routing = MakeRouting(1, {0, 0, 1, 2, 0, 1});
  const std::vector<bool> rank0_down{false, true, true};
  auto plan = DispatchPlan::Build(routing, *p, &rank0_down);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(Pairs(*plan), (std::vector<int64_t>{0, 3, 3}));
  const std::vector<bool> only_rank2{false, false, true};
  auto failed = DispatchPlan::Build(routing, *p, &only_rank2);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(failed.status().message(), "no live replica of expert 0 (their ranks are down)");
}

TEST(DispatchPlanTest, ServingPartiallyLeavesOutWholeSegmentsThatChoseALostExpert) {
  auto p = ExpertPlacement::FromRankExperts(3, {{0}, {1}, {2}});
  ASSERT_TRUE(p.ok()) << p.status();
  // Tokens 0-1 are one caller's, 2-3 another's, 4 a third's; expert 1 (rank 1) is lost.
  const Routing routing = MakeRouting(1, {0, 1, 0, 2, 2});
  const std::vector<bool> live{true, false, true};
  EXPECT_EQ(DispatchPlan::Build(routing, *p, &live).status().message(),
            "no live replica of expert 1 (their ranks are down)");
  const std::vector<int64_t> segments{2, 4, 5};
  auto plan = DispatchPlan::Build(routing, *p, &live, &segments);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->unserved_tokens, (std::vector<int64_t>{0, 1}));  // token 0 goes with token 1
  EXPECT_EQ(plan->unavailable_experts, (std::vector<int>{1}));
  EXPECT_EQ(plan->ranks[0].token_rows, (std::vector<int32_t>{2}));
  EXPECT_EQ(plan->ranks[2].token_rows, (std::vector<int32_t>{3, 4}));
  EXPECT_EQ(plan->UnavailableStatus().code(), absl::StatusCode::kUnavailable);
  // Empty segments: every token on its own.
  const std::vector<int64_t> each;
  auto single = DispatchPlan::Build(routing, *p, &live, &each);
  ASSERT_TRUE(single.ok());
  EXPECT_EQ(single->unserved_tokens, (std::vector<int64_t>{1}));
  EXPECT_EQ(single->ranks[0].token_rows, (std::vector<int32_t>{0, 2}));
}

}  // namespace
}  // namespace moe

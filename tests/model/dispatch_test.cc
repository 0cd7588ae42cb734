// GroupByExpert: a rank regroups the per-row expert choices it was sent (off the wire) by
// local expert, refusing malformed ones before reading a row.
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

}  // namespace
}  // namespace moe

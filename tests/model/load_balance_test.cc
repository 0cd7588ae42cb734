// model/load_balance: balancedness, rank loads, Quantile Balancing on hand-made windows (the
// comparison with the torch transcription of the seed is load_balance_reference_test.cc),
// the router-score window, and EPLB placement advice.
#include "model/load_balance.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace moe {
namespace {

RoutingParams Routing(int experts, int top_k, int n_group = 1, int topk_group = 1) {
  RoutingParams r;
  r.num_experts = experts;
  r.top_k = top_k;
  r.n_group = n_group;
  r.topk_group = topk_group;
  return r;
}

// ---- Balancedness and rank loads ---------------------------------------------------------

TEST(BalancednessTest, MeanOverMax) {
  EXPECT_DOUBLE_EQ(Balancedness(std::vector<double>{3, 3, 3, 3}), 1.0);
  EXPECT_DOUBLE_EQ(Balancedness(std::vector<double>{8, 0, 0, 0}), 0.25);
  EXPECT_DOUBLE_EQ(Balancedness(std::vector<double>{1, 2, 3}), 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(Balancedness(std::vector<double>{0.5}), 1.0);
}

TEST(BalancednessTest, EmptyAndAllZeroAreBalanced) {
  EXPECT_EQ(Balancedness(std::vector<double>{}), 1.0);
  EXPECT_EQ(Balancedness(std::vector<double>{0, 0, 0}), 1.0);
}

TEST(RankLoadsTest, ContiguousPlacementSumsItsExperts) {
  const ExpertPlacement p = ExpertPlacement::Contiguous(5, 2);  // {0,1,2}, {3,4}
  auto loads = RankLoads(p, std::vector<double>{1, 2, 3, 4, 5});
  ASSERT_TRUE(loads.ok()) << loads.status();
  EXPECT_EQ(*loads, (std::vector<double>{6, 9}));
}

TEST(RankLoadsTest, ReplicatedExpertIsSplitEvenly) {
  // Expert 0 on all three ranks, expert 1 on ranks 1 and 2.
  auto p = ExpertPlacement::FromRankExperts(3, {{0, 2}, {0, 1}, {0, 1}});
  ASSERT_TRUE(p.ok()) << p.status();
  auto loads = RankLoads(*p, std::vector<double>{30, 10, 7});
  ASSERT_TRUE(loads.ok()) << loads.status();
  EXPECT_EQ(*loads, (std::vector<double>{10 + 7, 10 + 5, 10 + 5}));
  EXPECT_DOUBLE_EQ(Balancedness(*loads), (47.0 / 3.0) / 17.0);
}

TEST(RankLoadsTest, WrongExpertCountFails) {
  EXPECT_FALSE(RankLoads(ExpertPlacement::Contiguous(4, 2), std::vector<double>{1, 2, 3}).ok());
}

// ---- the "higher" quantile index -----------------------------------------------------------

TEST(QuantileHigherIndexTest, MatchesTorchFp32Rank) {
  EXPECT_EQ(QuantileHigherIndex(1, 0.5), 0);
  EXPECT_EQ(QuantileHigherIndex(5, 0.0), 0);
  EXPECT_EQ(QuantileHigherIndex(5, 1.0), 4);
  EXPECT_EQ(QuantileHigherIndex(101, 0.5), 50);        // exact rank: no rounding up
  EXPECT_EQ(QuantileHigherIndex(100, 0.5), 50);        // 49.5 -> 50
  EXPECT_EQ(QuantileHigherIndex(1000, 2.0 / 64), 32);  // 31.21875 -> 32
  // torch.quantile(torch.arange(51.), 3 / 10, interpolation="higher") == 16: the rank
  // fp32(0.3) * 50 rounds to 15.000001 in fp32, although 0.3 * 50 is exactly 15.
  EXPECT_EQ(QuantileHigherIndex(51, 3.0 / 10), 16);
  EXPECT_EQ(QuantileHigherIndex(26, 6.0 / 10), 16);
}

// ---- selection counts ----------------------------------------------------------------------

TEST(CountSelectionsTest, TiesGoToTheLowerIndex) {
  // One token, all four scores equal: top-2 are experts 0 and 1.
  auto c = CountSelections(std::vector<float>{0.5f, 0.5f, 0.5f, 0.5f},
                           std::vector<float>{0, 0, 0, 0}, Routing(4, 2));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c, (std::vector<int64_t>{1, 1, 0, 0}));
  // The bias makes 2 and 3 tie above 0 and 1.
  c = CountSelections(std::vector<float>{0.5f, 0.5f, 0.25f, 0.25f},
                      std::vector<float>{0, 0, 0.25f, 0.25f}, Routing(4, 3));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c, (std::vector<int64_t>{1, 1, 1, 0}));
}

TEST(CountSelectionsTest, BiasChoosesButDoesNotWeigh) {
  // The seed's example: scores .9 .8 .65 .2, bias -.4 on expert 0 and +.25 on expert 2.
  auto c = CountSelections(std::vector<float>{0.9f, 0.8f, 0.65f, 0.2f},
                           std::vector<float>{-0.4f, 0, 0.25f, 0}, Routing(4, 2));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c, (std::vector<int64_t>{0, 1, 1, 0}));
}

TEST(CountSelectionsTest, GroupLimitExcludesWeakGroups) {
  // 3 groups of 2: group scores 0.9+0.1=1.0, 0.6+0.6=1.2, 0.7+0.2=0.9. Keep 1 group -> {2, 3}
  // although expert 0 has the best single score.
  const std::vector<float> s{0.9f, 0.1f, 0.6f, 0.6f, 0.7f, 0.2f};
  auto c = CountSelections(s, std::vector<float>(6, 0), Routing(6, 2, 3, 1));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c, (std::vector<int64_t>{0, 0, 1, 1, 0, 0}));
  // Keep 2 groups -> groups 1 and 0; top-2 of {0.9, 0.1, 0.6, 0.6} -> experts 0 and 2.
  c = CountSelections(s, std::vector<float>(6, 0), Routing(6, 2, 3, 2));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c, (std::vector<int64_t>{1, 0, 1, 0, 0, 0}));
  // Without the limit -> experts 0 and 4.
  c = CountSelections(s, std::vector<float>(6, 0), Routing(6, 2, 3, 3));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c, (std::vector<int64_t>{1, 0, 0, 0, 1, 0}));
}

TEST(CountSelectionsTest, RejectsBadShapes) {
  EXPECT_FALSE(CountSelections(std::vector<float>(7), std::vector<float>(4), Routing(4, 2)).ok());
  EXPECT_FALSE(CountSelections(std::vector<float>(8), std::vector<float>(3), Routing(4, 2)).ok());
  EXPECT_FALSE(CountSelections(std::vector<float>(8), std::vector<float>(4), Routing(4, 5)).ok());
  EXPECT_FALSE(
      CountSelections(std::vector<float>(8), std::vector<float>(4), Routing(4, 2, 3, 1)).ok());
  // Group limit leaves 2 experts for top-3.
  EXPECT_FALSE(
      CountSelections(std::vector<float>(8), std::vector<float>(4), Routing(4, 3, 2, 1)).ok());
}

// ---- Quantile Balancing on hand-made windows -------------------------------------------------

TEST(QuantileBalanceTest, HandComputedWindow) {
  // E = 4, k = 1, p = 1/4, N = 4: index ceil(0.25 * 3) = 1 (the second smallest).
  const std::vector<float> s{
      0.9f, 0.5f, 0.5f, 0.1f,  // biased (no bias): cutoff = 2nd largest = 0.5 (a tie)
      0.8f, 0.7f, 0.2f, 0.1f,  // cutoff 0.7
      0.6f, 0.1f, 0.3f, 0.4f,  // cutoff 0.4
      0.5f, 0.5f, 0.5f, 0.5f,  // cutoff 0.5 (all tied)
  };
  auto r = QuantileBalance(s, std::vector<float>(4, 0.0f), Routing(4, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  // relative = cutoff - s, per column; the sample at index 1 ascending:
  auto rel = [&](int t, int e) {
    const float cut[] = {0.5f, 0.7f, 0.4f, 0.5f};
    return cut[t] - s[t * 4 + e];
  };
  std::vector<float> expected(4);
  for (int e = 0; e < 4; ++e) {
    std::vector<float> col{rel(0, e), rel(1, e), rel(2, e), rel(3, e)};
    std::sort(col.begin(), col.end());
    expected[e] = col[1];
  }
  EXPECT_EQ(r->quantile, expected);
  const float mean =
      static_cast<float>((double{expected[0]} + expected[1] + expected[2] + expected[3]) / 4);
  for (int e = 0; e < 4; ++e) EXPECT_EQ(r->bias[e], expected[e] - mean) << e;
  EXPECT_EQ(r->tokens, 4);
  // Observed: argmax per token with ties to the lower index: 0, 0, 0, 0.
  EXPECT_EQ(r->observed_counts, (std::vector<int64_t>{4, 0, 0, 0}));
  EXPECT_DOUBLE_EQ(r->observed_balancedness, 0.25);
  EXPECT_EQ(std::accumulate(r->predicted_counts.begin(), r->predicted_counts.end(), int64_t{0}), 4);
}

TEST(QuantileBalanceTest, CutoffForTopKEqualsEMinusOneIsTheRowMinimum) {
  // E = 3, k = 2: cutoff = smallest biased score; p = 2/3, N = 2: index ceil(2/3) = 1 (max).
  const std::vector<float> s{0.2f, 0.6f, 0.4f, 0.9f, 0.3f, 0.5f};
  const std::vector<float> b{0.0f, -0.1f, 0.1f};
  auto r = QuantileBalance(s, b, Routing(3, 2));
  ASSERT_TRUE(r.ok()) << r.status();
  const float cut0 = std::min({0.2f + 0.0f, 0.6f + -0.1f, 0.4f + 0.1f});
  const float cut1 = std::min({0.9f + 0.0f, 0.3f + -0.1f, 0.5f + 0.1f});
  for (int e = 0; e < 3; ++e)
    EXPECT_EQ(r->quantile[e], std::max(cut0 - s[e], cut1 - s[3 + e])) << e;
}

TEST(QuantileBalanceTest, BiasIsCentered) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> s(300 * 16);
  for (float& v : s) v = u(rng);
  auto r = QuantileBalance(s, std::vector<float>(16, 0.0f), Routing(16, 3));
  ASSERT_TRUE(r.ok()) << r.status();
  double sum = 0;
  for (float v : r->bias) sum += v;
  EXPECT_LT(std::abs(sum / 16), 1e-7);
}

TEST(QuantileBalanceTest, EveryQuantileIsASampleOfItsColumn) {
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0.0f, 2.0f);
  const int E = 12, N = 51, k = 3;  // p = 1/4: exact
  std::vector<float> s(N * E), b(E);
  for (float& v : s) v = 1.0f / (1.0f + std::exp(-n(rng)));
  for (float& v : b) v = 0.05f * n(rng);
  auto r = QuantileBalance(s, b, Routing(E, k));
  ASSERT_TRUE(r.ok()) << r.status();
  for (int e = 0; e < E; ++e) {
    std::vector<float> col(N);
    for (int t = 0; t < N; ++t) {
      std::vector<float> row(E);
      for (int j = 0; j < E; ++j) row[j] = s[t * E + j] + b[j];
      std::sort(row.begin(), row.end(), std::greater<float>());
      col[t] = row[k] - s[t * E + e];
    }
    std::sort(col.begin(), col.end());
    EXPECT_EQ(r->quantile[e], col[QuantileHigherIndex(N, 0.25)]) << e;
    EXPECT_EQ(QuantileHigherIndex(N, 0.25), 13);  // ceil(12.5)
  }
}

TEST(QuantileBalanceTest, SkewedRouterGetsBalanced) {
  // Bias favouring the first 10% of experts: they take almost every token.
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.0f, 1.0f);
  const int E = 64, N = 4096, k = 2;
  std::vector<float> s(N * E), b(E, 0.0f);
  for (float& v : s) v = 1.0f / (1.0f + std::exp(-n(rng)));
  for (int e = 0; e < E / 10; ++e) b[e] = 0.3f;
  auto r = QuantileBalance(s, b, Routing(E, k));
  ASSERT_TRUE(r.ok()) << r.status();
  std::printf("  skewed router: balancedness observed %.3f, predicted %.3f\n",
              r->observed_balancedness, r->predicted_balancedness);
  EXPECT_LT(r->observed_balancedness, 0.2);
  EXPECT_GT(r->predicted_balancedness, r->observed_balancedness + 0.3);
  // One step takes most of the 0.3 head start away (not all: the cutoffs it measures were
  // set by the old bias).
  for (int e = 0; e < E / 10; ++e) EXPECT_LT(r->bias[e] - r->bias[E - 1], 0.1f) << e;
  // Repeated on the same window (as training would, batch after batch), it settles.
  for (int step = 2; step <= 6; ++step) {
    auto next = QuantileBalance(s, r->bias, Routing(E, k));
    ASSERT_TRUE(next.ok()) << next.status();
    EXPECT_EQ(next->observed_counts, r->predicted_counts);
    r = std::move(next);
    std::printf("  step %d: predicted %.3f\n", step, r->predicted_balancedness);
  }
  EXPECT_GT(r->predicted_balancedness, 0.8);
}

TEST(QuantileBalanceTest, Errors) {
  const std::vector<float> b4(4, 0.0f);
  EXPECT_FALSE(QuantileBalance({}, b4, Routing(4, 2)).ok());                          // N = 0
  EXPECT_FALSE(QuantileBalance(std::vector<float>(8, .5f), b4, Routing(4, 4)).ok());  // k = E
  EXPECT_FALSE(QuantileBalance(std::vector<float>(8, .5f), b4, Routing(4, 0)).ok());  // k = 0
  EXPECT_FALSE(QuantileBalance(std::vector<float>(9, .5f), b4, Routing(4, 2)).ok());  // shape
  EXPECT_FALSE(
      QuantileBalance(std::vector<float>(8, .5f), std::vector<float>(3), Routing(4, 2)).ok());
  std::vector<float> nan(8, 0.5f);
  nan[5] = std::nanf("");
  EXPECT_FALSE(QuantileBalance(nan, b4, Routing(4, 2)).ok());
  std::vector<float> inf_bias = b4;
  inf_bias[1] = INFINITY;
  EXPECT_FALSE(QuantileBalance(std::vector<float>(8, .5f), inf_bias, Routing(4, 2)).ok());
  EXPECT_TRUE(QuantileBalance(std::vector<float>(4, .5f), b4, Routing(4, 3)).ok());  // N = 1
}

// ---- RouterScoreWindow -------------------------------------------------------------------------

std::vector<float> Rows(int first, int count, int E) {  // row t holds t*10 + e
  std::vector<float> v;
  for (int t = first; t < first + count; ++t)
    for (int e = 0; e < E; ++e) v.push_back(static_cast<float>(t * 10 + e));
  return v;
}

TEST(RouterScoreWindowTest, KeepsTheLastCapacityTokensOldestFirst) {
  RouterScoreWindow w(3, 4);
  EXPECT_EQ(w.size(), 0);
  EXPECT_TRUE(w.Snapshot().empty());
  ASSERT_TRUE(w.Add(Rows(0, 3, 3)).ok());
  EXPECT_EQ(w.Snapshot(), Rows(0, 3, 3));
  ASSERT_TRUE(w.Add(Rows(3, 2, 3)).ok());  // 5 tokens: 0 is evicted
  EXPECT_EQ(w.size(), 4);
  EXPECT_EQ(w.Snapshot(), Rows(1, 4, 3));
  for (int t = 5; t < 11; ++t) ASSERT_TRUE(w.Add(Rows(t, 1, 3)).ok());
  EXPECT_EQ(w.Snapshot(), Rows(7, 4, 3));
  ASSERT_TRUE(w.Add({}).ok());
  EXPECT_EQ(w.Snapshot(), Rows(7, 4, 3));
  ASSERT_TRUE(w.Add(Rows(11, 9, 3)).ok());  // more than the capacity at once
  EXPECT_EQ(w.Snapshot(), Rows(16, 4, 3));
  EXPECT_EQ(w.total_added(), 20);
  w.Clear();
  EXPECT_EQ(w.size(), 0);
  ASSERT_TRUE(w.Add(Rows(0, 1, 3)).ok());
  EXPECT_EQ(w.Snapshot(), Rows(0, 1, 3));
}

TEST(RouterScoreWindowTest, RejectsPartialRowsAndEmptyCapacity) {
  RouterScoreWindow w(3, 4);
  EXPECT_FALSE(w.Add(std::vector<float>(4)).ok());
  EXPECT_EQ(w.size(), 0);
  RouterScoreWindow none(3, 0);
  EXPECT_FALSE(none.Add(Rows(0, 1, 3)).ok());
}

TEST(RouterScoreWindowTest, FeedsQuantileBalance) {
  RouterScoreWindow w(4, 2);
  ASSERT_TRUE(w.Add(std::vector<float>{0.1f, 0.2f, 0.3f, 0.4f, 0.9f, 0.8f, 0.7f, 0.6f}).ok());
  auto r = QuantileBalance(w.Snapshot(), std::vector<float>(4, 0.0f), Routing(4, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens, 2);
  EXPECT_EQ(r->observed_counts, (std::vector<int64_t>{1, 0, 0, 1}));
}

// ---- placement advice (EPLB) -----------------------------------------------------------------

// Checks the structural promises: slots per rank, distinct experts per rank, replica counts.
void ExpectValidAdvice(const PlacementAdvice& a, int E, int R, int S) {
  ASSERT_EQ(a.placement.num_ranks(), R);
  ASSERT_EQ(a.placement.num_experts, E);
  for (const auto& experts : a.placement.rank_experts) {
    EXPECT_EQ(static_cast<int>(experts.size()), S / R);
    EXPECT_EQ(std::set<int>(experts.begin(), experts.end()).size(), experts.size())
        << "two replicas of one expert on one rank";
  }
  int total = 0;
  for (int e = 0; e < E; ++e) {
    EXPECT_EQ(static_cast<int>(a.placement.replicas[e].size()), a.replica_counts[e]) << e;
    total += a.replica_counts[e];
  }
  EXPECT_EQ(total, S);
}

TEST(AdvisePlacementTest, HotExpertGetsTheRedundantReplicas) {
  // 10 experts, 4 ranks, 12 slots (2 redundant): expert 5 carries 3x the others.
  std::vector<double> loads(10, 10.0);
  loads[5] = 30.0;
  const ExpertPlacement current = ExpertPlacement::Contiguous(10, 4);  // {0-2} {3-5} {6,7} {8,9}
  auto a = AdvisePlacement(loads, 4, 12, current);
  ASSERT_TRUE(a.ok()) << a.status();
  ExpectValidAdvice(*a, 10, 4, 12);
  // 30 -> 15 per replica (above 10) -> 10 (ties with the rest, but no slot is left).
  EXPECT_EQ(a->replica_counts, (std::vector<int>{1, 1, 1, 1, 1, 3, 1, 1, 1, 1}));
  // All replicas weigh 10, placed in expert order: 0-3 on ranks 0-3, 4 on rank 0, the three
  // replicas of 5 on ranks 1-3 (not 0 again: lowest load first), 6-9 on ranks 0-3.
  EXPECT_EQ(a->placement.rank_experts,
            (std::vector<std::vector<int>>{{0, 4, 6}, {1, 5, 7}, {2, 5, 8}, {3, 5, 9}}));
  EXPECT_EQ(a->predicted_rank_load, (std::vector<double>{30, 30, 30, 30}));
  EXPECT_DOUBLE_EQ(a->predicted_balancedness, 1.0);
  EXPECT_DOUBLE_EQ(a->current_balancedness, 30.0 / 50.0);  // rank 1 holds {3, 4, 5}
  std::printf("  hot expert: balancedness %.3f (contiguous) -> %.3f (advice)\n",
              a->current_balancedness, a->predicted_balancedness);
}

TEST(AdvisePlacementTest, ReplicationTiesGoToTheLowerExpert) {
  // Loads 6, 3, 3; 5 ranks of one slot: the first redundant slot halves expert 0 to 3, which
  // ties with experts 1 and 2 (3 / 1); the tie goes to the lower id, expert 0 again.
  auto a = AdvisePlacement(std::vector<double>{6, 3, 3}, 5, 5, ExpertPlacement::Contiguous(3, 5));
  ASSERT_TRUE(a.ok()) << a.status();
  ExpectValidAdvice(*a, 3, 5, 5);
  EXPECT_EQ(a->replica_counts, (std::vector<int>{3, 1, 1}));
}

TEST(AdvisePlacementTest, PackingBalancesWithoutRedundancy) {
  // S = E: pure packing (LPT with slot limits). Loads 9 8 7 6 5 4 3 2 on 2 ranks of 4 slots:
  // 9->r0, 8->r1, 7->r1 (8 < 9), 6->r0 (9 < 15), 5->r0 (tie 15: lower rank), 4->r1 (15 < 20),
  // 3->r1 (19 < 20; r1 is full now), 2->r0 (the only free slot).
  auto a = AdvisePlacement(std::vector<double>{9, 8, 7, 6, 5, 4, 3, 2}, 2, 8,
                           ExpertPlacement::Contiguous(8, 2));
  ASSERT_TRUE(a.ok()) << a.status();
  ExpectValidAdvice(*a, 8, 2, 8);
  EXPECT_EQ(a->placement.rank_experts, (std::vector<std::vector<int>>{{0, 3, 4, 7}, {1, 2, 5, 6}}));
  EXPECT_EQ(a->predicted_rank_load, (std::vector<double>{22, 22}));
  EXPECT_DOUBLE_EQ(a->current_balancedness, 22.0 / 30.0);
}

TEST(AdvisePlacementTest, NeverColocatesAndBeatsContiguousOnSkewedLoads) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    const int R = 1 + static_cast<int>(rng() % 8);
    const int per_rank = 1 + static_cast<int>(rng() % 6);
    const int S = R * per_rank;
    const int E = per_rank + static_cast<int>(rng() % (S - per_rank + 1));  // [per_rank, S]
    std::vector<double> loads(E);
    std::exponential_distribution<double> heavy(0.2);
    for (double& l : loads) l = std::floor(std::pow(heavy(rng), 2.0));
    if (trial % 10 == 0) std::fill(loads.begin(), loads.end(), 0.0);
    const ExpertPlacement current = ExpertPlacement::Contiguous(E, R);
    auto a = AdvisePlacement(loads, R, S, current);
    ASSERT_TRUE(a.ok()) << a.status() << " trial " << trial;
    ExpectValidAdvice(*a, E, R, S);
    if (S == E * R) {
      for (int c : a->replica_counts) EXPECT_EQ(c, R);
    }
    auto again = AdvisePlacement(loads, R, S, current);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->placement.rank_experts, a->placement.rank_experts) << "deterministic";
  }
  // A Zipf-like router on 64 experts, 8 ranks, 8 redundant slots: the advice must clearly beat
  // the contiguous placement.
  std::vector<double> loads(64);
  for (int e = 0; e < 64; ++e) loads[e] = 10000.0 / (1 + (e * 37) % 64);
  auto a = AdvisePlacement(loads, 8, 72, ExpertPlacement::Contiguous(64, 8));
  ASSERT_TRUE(a.ok()) << a.status();
  ExpectValidAdvice(*a, 64, 8, 72);
  EXPECT_GT(a->predicted_balancedness, a->current_balancedness + 0.2);
  EXPECT_GT(a->predicted_balancedness, 0.95);
  std::printf("  zipf 64 experts / 8 ranks / 72 slots: balancedness %.3f -> %.3f\n",
              a->current_balancedness, a->predicted_balancedness);
}

TEST(AdvisePlacementTest, FileTextParsesBack) {
  std::vector<double> loads{50, 1, 1, 1, 30, 1};
  auto a = AdvisePlacement(loads, 3, 9, ExpertPlacement::Contiguous(6, 3));
  ASSERT_TRUE(a.ok()) << a.status();
  const std::string text = PlacementFileText(*a);
  EXPECT_EQ(text.rfind("# ", 0), 0u) << text;
  auto parsed = ExpertPlacement::Parse(6, text);
  ASSERT_TRUE(parsed.ok()) << parsed.status() << "\n" << text;
  EXPECT_EQ(parsed->rank_experts, a->placement.rank_experts);
  auto loads_again = RankLoads(*parsed, loads);
  ASSERT_TRUE(loads_again.ok());
  EXPECT_EQ(*loads_again, a->predicted_rank_load);
}

TEST(AdvisePlacementTest, RejectsBadArguments) {
  const std::vector<double> loads{1, 2, 3, 4};
  const ExpertPlacement current = ExpertPlacement::Contiguous(4, 2);
  EXPECT_FALSE(AdvisePlacement(loads, 2, 5, current).ok());   // 5 % 2 != 0
  EXPECT_FALSE(AdvisePlacement(loads, 2, 2, current).ok());   // fewer slots than experts
  EXPECT_FALSE(AdvisePlacement(loads, 2, 10, current).ok());  // 5 per rank > 4 experts
  EXPECT_FALSE(AdvisePlacement(loads, 0, 4, current).ok());
  EXPECT_FALSE(AdvisePlacement({}, 2, 4, current).ok());
  EXPECT_FALSE(AdvisePlacement(std::vector<double>{1, -2, 3, 4}, 2, 4, current).ok());
  EXPECT_FALSE(AdvisePlacement(std::vector<double>{1, NAN, 3, 4}, 2, 4, current).ok());
  EXPECT_FALSE(AdvisePlacement(loads, 2, 4, ExpertPlacement::Contiguous(5, 2)).ok());
  EXPECT_TRUE(AdvisePlacement(loads, 2, 8, current).ok());  // every expert on every rank
}

}  // namespace
}  // namespace moe

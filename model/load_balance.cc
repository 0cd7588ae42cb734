#include "model/load_balance.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "kernels/router_rule.h"

namespace moe {
namespace {

constexpr int64_t kMaxQuantileSamples = int64_t{1} << 24;  // torch.quantile's limit

bool AllFinite(absl::Span<const float> v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

// Shape and group checks shared by CountSelections and QuantileBalance; sets *tokens.
absl::Status CheckRouting(absl::Span<const float> scores, absl::Span<const float> bias,
                          const RoutingParams& routing, int64_t* tokens) {
  const int E = routing.num_experts, k = routing.top_k;
  if (E < 1) return absl::InvalidArgumentError(absl::StrCat("num_experts ", E, " < 1"));
  if (k < 1 || k > E)
    return absl::InvalidArgumentError(absl::StrCat("top_k ", k, " outside [1, ", E, "]"));
  if (scores.size() % E != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("scores hold ", scores.size(), " values, not a multiple of ", E, " experts"));
  if (bias.size() != static_cast<size_t>(E))
    return absl::InvalidArgumentError(
        absl::StrCat("bias has ", bias.size(), " values for ", E, " experts"));
  const int groups = std::max(1, routing.n_group);
  if (E % groups != 0 || routing.topk_group < 1 || routing.topk_group > groups)
    return absl::InvalidArgumentError(absl::StrCat("bad expert grouping: ", E, " experts, n_group ",
                                                   routing.n_group, ", topk_group ",
                                                   routing.topk_group));
  if (GroupLimited(routing) && k > routing.topk_group * (E / groups))
    return absl::InvalidArgumentError(absl::StrCat("top_k ", k, " exceeds the ",
                                                   routing.topk_group * (E / groups),
                                                   " experts of the kept groups"));
  *tokens = static_cast<int64_t>(scores.size()) / E;
  return absl::OkStatus();
}

}  // namespace

double Balancedness(absl::Span<const double> loads) {
  if (loads.empty()) return 1.0;
  const double max = *std::max_element(loads.begin(), loads.end());
  if (max == 0.0) return 1.0;
  const double sum = std::accumulate(loads.begin(), loads.end(), 0.0);
  return sum / static_cast<double>(loads.size()) / max;
}

absl::StatusOr<std::vector<double>> RankLoads(const ExpertPlacement& placement,
                                              absl::Span<const double> expert_loads) {
  if (expert_loads.size() != static_cast<size_t>(placement.num_experts) ||
      placement.replicas.size() != expert_loads.size())
    return absl::InvalidArgumentError(absl::StrCat("placement has ", placement.num_experts,
                                                   " experts, loads ", expert_loads.size()));
  std::vector<double> rank_load(placement.num_ranks(), 0.0);
  for (size_t e = 0; e < expert_loads.size(); ++e) {
    const auto& replicas = placement.replicas[e];
    if (replicas.empty())
      return absl::InvalidArgumentError(absl::StrCat("expert ", e, " has no replica"));
    const double share = expert_loads[e] / static_cast<double>(replicas.size());
    for (const auto& replica : replicas) rank_load[replica.rank] += share;
  }
  return rank_load;
}

// --- Quantile Balancing --------------------------------------------------------------------

int64_t QuantileHigherIndex(int64_t n, double p) {
  if (n <= 1) return 0;
  // NOTES: fp32 on purpose, as torch computes `q * last_index` in the input's dtype.
  const float rank = static_cast<float>(p) * static_cast<float>(n - 1);
  const int64_t index = static_cast<int64_t>(std::ceil(rank));
  return std::clamp<int64_t>(index, 0, n - 1);
}

absl::StatusOr<std::vector<int64_t>> CountSelections(absl::Span<const float> scores,
                                                     absl::Span<const float> bias,
                                                     const RoutingParams& routing) {
  int64_t tokens = 0;
  if (absl::Status s = CheckRouting(scores, bias, routing, &tokens); !s.ok()) return s;
  const int E = routing.num_experts, k = routing.top_k;
  std::vector<int64_t> counts(E, 0);
  std::vector<float> biased(E);
  RouterScratch scratch(routing);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* s = scores.data() + t * E;
    for (int e = 0; e < E; ++e) biased[e] = s[e] + bias[e];
    RankExperts(routing, biased.data(), scratch);
    for (int j = 0; j < k; ++j) ++counts[scratch.order[j]];
  }
  return counts;
}

absl::StatusOr<QuantileBalanceResult> QuantileBalance(absl::Span<const float> scores,
                                                      absl::Span<const float> bias,
                                                      const RoutingParams& routing) {
  const int E = routing.num_experts, k = routing.top_k;
  if (E < 2) return absl::InvalidArgumentError(absl::StrCat("num_experts ", E, " < 2"));
  if (k < 1 || k > E - 1)
    return absl::InvalidArgumentError(
        absl::StrCat("top_k ", k, " outside [1, ", E - 1, "]: the cutoff is the (k+1)-th score"));
  int64_t tokens = 0;
  if (absl::Status s = CheckRouting(scores, bias, routing, &tokens); !s.ok()) return s;
  if (tokens == 0) return absl::InvalidArgumentError("no tokens in the window");
  if (tokens > kMaxQuantileSamples)
    return absl::InvalidArgumentError(
        absl::StrCat(tokens, " tokens; quantiles are defined for at most 2^24"));
  if (!AllFinite(scores)) return absl::InvalidArgumentError("a router score is NaN or infinite");
  if (!AllFinite(bias)) return absl::InvalidArgumentError("a bias is NaN or infinite");

  // 1. Per token: the (k+1)-th largest biased score (a value, so tie order does not matter).
  std::vector<float> cutoff(tokens), row(E);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* s = scores.data() + t * E;
    for (int e = 0; e < E; ++e) row[e] = s[e] + bias[e];
    std::nth_element(row.begin(), row.begin() + k, row.end(), std::greater<float>());
    cutoff[t] = row[k];
  }

  // 2. Per expert: the "higher" p-quantile of cutoff - s over the window.
  QuantileBalanceResult result;
  result.tokens = tokens;
  result.quantile.resize(E);
  const int64_t index = QuantileHigherIndex(tokens, static_cast<double>(k) / E);
  std::vector<float> column(tokens);
  for (int e = 0; e < E; ++e) {
    for (int64_t t = 0; t < tokens; ++t) column[t] = cutoff[t] - scores[t * E + e];
    std::nth_element(column.begin(), column.begin() + index, column.end());
    result.quantile[e] = column[index];
  }

  // 3. Center (NOTES in the header: fp64 sum, one rounding of the mean).
  double sum = 0.0;
  for (float q : result.quantile) sum += q;
  const float mean = static_cast<float>(sum / E);
  result.bias.resize(E);
  for (int e = 0; e < E; ++e) result.bias[e] = result.quantile[e] - mean;

  // 4. Selections over the same window with the current and the new bias.
  ASSIGN_OR_RETURN(result.observed_counts, CountSelections(scores, bias, routing));
  ASSIGN_OR_RETURN(result.predicted_counts, CountSelections(scores, result.bias, routing));
  result.observed_balancedness = Balancedness(
      std::vector<double>(result.observed_counts.begin(), result.observed_counts.end()));
  result.predicted_balancedness = Balancedness(
      std::vector<double>(result.predicted_counts.begin(), result.predicted_counts.end()));
  return result;
}

// --- RouterScoreWindow ---------------------------------------------------------------------

RouterScoreWindow::RouterScoreWindow(int num_experts, int64_t capacity_tokens)
    : num_experts_(num_experts), capacity_(capacity_tokens) {}

int64_t RouterScoreWindow::size() const {
  return num_experts_ > 0 ? static_cast<int64_t>(rows_.size()) / num_experts_ : 0;
}

absl::Status RouterScoreWindow::Add(absl::Span<const float> scores) {
  if (num_experts_ < 1 || capacity_ < 1)
    return absl::FailedPreconditionError(
        absl::StrCat("RouterScoreWindow(", num_experts_, ", ", capacity_, ") cannot hold tokens"));
  const int64_t E = num_experts_;
  if (scores.size() % E != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("scores hold ", scores.size(), " values, not a multiple of ", E, " experts"));
  int64_t tokens = static_cast<int64_t>(scores.size()) / E;
  total_added_ += tokens;
  const float* src = scores.data();
  if (tokens > capacity_) {  // the older ones would be evicted by this very call
    src += (tokens - capacity_) * E;
    tokens = capacity_;
  }
  for (int64_t t = 0; t < tokens; ++t, src += E) {
    if (size() < capacity_) {
      rows_.insert(rows_.end(), src, src + E);
      next_ = size() % capacity_;
    } else {
      std::memcpy(rows_.data() + next_ * E, src, E * sizeof(float));
      next_ = (next_ + 1) % capacity_;
    }
  }
  return absl::OkStatus();
}

std::vector<float> RouterScoreWindow::Snapshot() const {
  if (size() < capacity_) return rows_;  // not wrapped yet: oldest first already
  std::vector<float> out;
  out.reserve(rows_.size());
  const auto split = rows_.begin() + next_ * num_experts_;
  out.insert(out.end(), split, rows_.end());
  out.insert(out.end(), rows_.begin(), split);
  return out;
}

void RouterScoreWindow::Clear() {
  rows_.clear();
  rows_.shrink_to_fit();
  next_ = 0;
  total_added_ = 0;
}

// --- placement advice ----------------------------------------------------------------------

absl::StatusOr<PlacementAdvice> AdvisePlacement(absl::Span<const double> expert_loads,
                                                int num_ranks, int num_slots,
                                                const ExpertPlacement& current) {
  const int E = static_cast<int>(expert_loads.size()), R = num_ranks, S = num_slots;
  if (E < 1) return absl::InvalidArgumentError("no experts");
  if (R < 1) return absl::InvalidArgumentError(absl::StrCat("num_ranks ", R, " < 1"));
  if (S % R != 0)
    return absl::InvalidArgumentError(
        absl::StrCat(S, " slots do not divide evenly over ", R, " ranks"));
  if (S < E || static_cast<int64_t>(S) > static_cast<int64_t>(E) * R)
    return absl::InvalidArgumentError(absl::StrCat(S, " slots outside [", E, ", ",
                                                   static_cast<int64_t>(E) * R, "] for ", E,
                                                   " experts on ", R, " ranks"));
  for (int e = 0; e < E; ++e)
    if (!std::isfinite(expert_loads[e]) || expert_loads[e] < 0)
      return absl::InvalidArgumentError(
          absl::StrCat("expert ", e, " has load ", expert_loads[e], "; need finite, >= 0"));
  if (current.num_experts != E)
    return absl::InvalidArgumentError(
        absl::StrCat("current placement has ", current.num_experts, " experts, loads ", E));
  const int per_rank = S / R;

  // (a) Redundant slots, one at a time, to the highest load per replica (ties: lower id).
  // NOTES: equal rationals divide to equal doubles, so exact ties are seen as ties.
  std::vector<int> replicas(E, 1);
  for (int slot = E; slot < S; ++slot) {
    int best = -1;
    double best_load = 0.0;
    for (int e = 0; e < E; ++e) {
      if (replicas[e] >= R) continue;
      const double load = expert_loads[e] / replicas[e];
      if (best < 0 || load > best_load) {
        best = e;
        best_load = load;
      }
    }
    ++replicas[best];  // exists: sum(replicas) < S <= E * R
  }

  // (b) Heaviest replica first onto the least-loaded rank with room that lacks the expert.
  // An expert's replicas share one key, so they are placed one after another.
  std::vector<int> experts(E);
  std::iota(experts.begin(), experts.end(), 0);
  std::stable_sort(experts.begin(), experts.end(), [&](int a, int b) {
    return expert_loads[a] / replicas[a] > expert_loads[b] / replicas[b];
  });
  std::vector<double> rank_load(R, 0.0);
  std::vector<std::vector<int>> rank_experts(R);
  for (int e : experts) {
    const double share = expert_loads[e] / replicas[e];
    for (int i = 0; i < replicas[e]; ++i) {
      int best = -1;
      for (int r = 0; r < R; ++r) {
        if (static_cast<int>(rank_experts[r].size()) >= per_rank) continue;
        if (!rank_experts[r].empty() && rank_experts[r].back() == e) continue;  // hosts e
        if (best < 0 || rank_load[r] < rank_load[best]) best = r;
      }
      if (best < 0)
        return absl::InternalError(absl::StrCat(
            "placement packing dead-ended: every rank with a free slot already hosts expert ", e));
      rank_load[best] += share;
      rank_experts[best].push_back(e);
    }
  }

  PlacementAdvice advice;
  ASSIGN_OR_RETURN(advice.placement, ExpertPlacement::FromRankExperts(E, std::move(rank_experts)));
  advice.replica_counts = std::move(replicas);
  ASSIGN_OR_RETURN(advice.predicted_rank_load, RankLoads(advice.placement, expert_loads));
  ASSIGN_OR_RETURN(const std::vector<double> current_load, RankLoads(current, expert_loads));
  advice.predicted_balancedness = Balancedness(advice.predicted_rank_load);
  advice.current_balancedness = Balancedness(current_load);
  return advice;
}

std::string PlacementFileText(const PlacementAdvice& advice) {
  const ExpertPlacement& p = advice.placement;
  int slots = 0;
  for (const auto& experts : p.rank_experts) slots += static_cast<int>(experts.size());
  return absl::StrCat(
      absl::StrFormat("# expert placement: %d experts, %d ranks, %d slots (EPLB advice)\n",
                      p.num_experts, p.num_ranks(), slots),
      absl::StrFormat("# predicted balancedness %.6f, current %.6f (mean / max rank load)\n",
                      advice.predicted_balancedness, advice.current_balancedness),
      p.ToString());
}

}  // namespace moe

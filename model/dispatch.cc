#include "model/dispatch.h"

#include <algorithm>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace moe {

ExpertPlacement ExpertPlacement::Contiguous(int num_experts, int num_ranks) {
  std::vector<std::vector<int>> rank_experts(num_ranks);
  int next = 0;
  for (int r = 0; r < num_ranks; ++r) {
    const int count = num_experts / num_ranks + (r < num_experts % num_ranks ? 1 : 0);
    for (int i = 0; i < count; ++i) rank_experts[r].push_back(next++);
  }
  return *FromRankExperts(num_experts, std::move(rank_experts));
}

absl::StatusOr<ExpertPlacement> ExpertPlacement::FromRankExperts(
    int num_experts, std::vector<std::vector<int>> rank_experts) {
  if (rank_experts.empty()) return absl::InvalidArgumentError("placement has no ranks");
  ExpertPlacement p;
  p.num_experts = num_experts;
  p.replicas.resize(num_experts);
  for (size_t r = 0; r < rank_experts.size(); ++r) {
    auto& experts = rank_experts[r];
    std::sort(experts.begin(), experts.end());
    for (size_t i = 0; i < experts.size(); ++i) {
      const int e = experts[i];
      if (e < 0 || e >= num_experts)
        return absl::InvalidArgumentError(absl::StrCat("placement: rank ", r, " lists expert ", e,
                                                       " outside [0, ", num_experts, ")"));
      if (i > 0 && experts[i - 1] == e)
        return absl::InvalidArgumentError(
            absl::StrCat("placement: rank ", r, " lists expert ", e, " twice"));
      p.replicas[e].push_back({static_cast<int>(r), static_cast<int>(i)});
    }
  }
  for (int e = 0; e < num_experts; ++e)
    if (p.replicas[e].empty())
      return absl::InvalidArgumentError(
          absl::StrCat("placement: expert ", e, " is hosted by no rank"));
  p.rank_experts = std::move(rank_experts);
  return p;
}

absl::StatusOr<ExpertPlacement> ExpertPlacement::Parse(int num_experts, const std::string& text,
                                                       int max_ranks) {
  std::vector<std::vector<int>> ranks;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    const size_t r = ranks.size();
    if (static_cast<int64_t>(r) >= max_ranks)
      return absl::InvalidArgumentError(
          absl::StrCat("placement has more than ", max_ranks, " ranks"));
    std::vector<int> experts;
    std::vector<bool> listed(num_experts, false);
    for (absl::string_view item :
         absl::StrSplit(line, absl::ByAnyChar(", \t"), absl::SkipEmpty())) {
      std::vector<absl::string_view> range = absl::StrSplit(item, '-');
      int a, b;
      if (range.size() == 1 && absl::SimpleAtoi(range[0], &a)) {
        b = a;
      } else if (!(range.size() == 2 && absl::SimpleAtoi(range[0], &a) &&
                   absl::SimpleAtoi(range[1], &b) && a <= b)) {
        return absl::InvalidArgumentError(
            absl::StrCat("placement line ", r + 1, ": cannot parse '", item, "'"));
      }
      for (int e : {a, b})
        if (e < 0 || e >= num_experts)
          return absl::InvalidArgumentError(absl::StrCat("placement: rank ", r, " lists expert ", e,
                                                         " outside [0, ", num_experts, ")"));
      for (int e = a; e <= b; ++e) {
        if (listed[e])
          return absl::InvalidArgumentError(
              absl::StrCat("placement: rank ", r, " lists expert ", e, " twice"));
        listed[e] = true;
        experts.push_back(e);
      }
    }
    ranks.push_back(std::move(experts));
  }
  return FromRankExperts(num_experts, std::move(ranks));
}

std::string ExpertPlacement::ToString() const {
  std::ostringstream out;
  for (const auto& experts : rank_experts) out << absl::StrJoin(experts, ",") << "\n";
  return out.str();
}

absl::Status DispatchPlan::UnavailableStatus() const {
  if (unavailable_experts.empty()) return absl::OkStatus();
  std::string list = absl::StrJoin(
      unavailable_experts.begin(),
      unavailable_experts.begin() + std::min<size_t>(unavailable_experts.size(), 16), ", ");
  if (unavailable_experts.size() > 16)
    absl::StrAppend(&list, ", ... (", unavailable_experts.size(), " in all)");
  return absl::UnavailableError(absl::StrCat("no live replica of expert",
                                             unavailable_experts.size() > 1 ? "s " : " ", list,
                                             " (their ranks are down)"));
}

absl::StatusOr<DispatchPlan> DispatchPlan::Build(const Routing& routing,
                                                 const ExpertPlacement& placement,
                                                 const std::vector<bool>* live_ranks,
                                                 const std::vector<int64_t>* segment_ends) {
  const int R = placement.num_ranks();
  const int k = routing.top_k;
  if (static_cast<int64_t>(routing.ids.size()) != routing.tokens * k ||
      routing.weights.size() != routing.ids.size())
    return absl::InvalidArgumentError("routing arrays do not match tokens x top_k");
  if (live_ranks != nullptr && static_cast<int>(live_ranks->size()) != R)
    return absl::InvalidArgumentError("live rank mask does not match the placement");
  // The replicas each expert may use: all, or those on live ranks.
  std::vector<std::vector<ExpertPlacement::Replica>> usable;
  if (live_ranks != nullptr) {
    usable.resize(placement.num_experts);
    for (int e = 0; e < placement.num_experts; ++e)
      for (const auto& replica : placement.replicas[e])
        if ((*live_ranks)[replica.rank]) usable[e].push_back(replica);
  }
  const auto& replicas_of = live_ranks != nullptr ? usable : placement.replicas;
  DispatchPlan plan;
  plan.ranks.resize(R);
  std::vector<int64_t> rank_load(R, 0);  // (token, expert) pairs given to each rank so far
  std::vector<int> unavailable;          // chosen experts without a live replica
  // Per token: the (rank, local expert, gate) choices, then one row per distinct rank.
  std::vector<std::pair<int, int>> chosen(k);  // (rank, slot in the token's choices)
  std::vector<int> locals(k);
  std::vector<bool> token_on(R, false);  // ranks this token's row already goes to
  // Tokens that cannot be served: they chose an expert without a usable replica, or share a
  // segment with one that did.
  std::vector<bool> skip(routing.tokens, false);
  for (int64_t t = 0; t < routing.tokens; ++t)
    for (int j = 0; j < k; ++j) {
      const int e = routing.ids[t * k + j];
      if (e < 0 || e >= placement.num_experts)
        return absl::InvalidArgumentError(
            absl::StrCat("routing chose expert ", e, " outside [0, ", placement.num_experts, ")"));
      if (!replicas_of[e].empty()) continue;
      skip[t] = true;
      if (std::find(unavailable.begin(), unavailable.end(), e) == unavailable.end())
        unavailable.push_back(e);
    }
  std::sort(unavailable.begin(), unavailable.end());
  plan.unavailable_experts = std::move(unavailable);
  if (segment_ends == nullptr && !plan.unavailable_experts.empty()) return plan.UnavailableStatus();
  if (segment_ends != nullptr && !segment_ends->empty()) {
    int64_t begin = 0;
    for (int64_t end : *segment_ends) {
      end = std::clamp(end, begin, routing.tokens);
      const auto first = skip.begin() + begin, last = skip.begin() + end;
      if (std::find(first, last, true) != last) std::fill(first, last, true);
      begin = end;
    }
  }
  for (int64_t t = 0; t < routing.tokens; ++t) {
    if (skip[t]) {
      plan.unserved_tokens.push_back(t);
      continue;
    }
    // Experts with one usable replica first: they fix ranks the token's row goes to anyway.
    for (int pass = 0; pass < 2; ++pass) {
      for (int j = 0; j < k; ++j) {
        const int e = routing.ids[t * k + j];
        const auto& replicas = replicas_of[e];
        if ((replicas.size() == 1) != (pass == 0)) continue;
        // A replica on a rank the row goes to anyway (no extra row on the wire), else the
        // least loaded rank of this step; ties rotate with the token, so equal loads spread.
        size_t best = 0;
        for (size_t i = 0; i < replicas.size(); ++i) {
          const size_t c = (static_cast<size_t>(t) + i) % replicas.size();
          const auto better = [&](size_t a, size_t b) -> bool {
            const int ra = replicas[a].rank, rb = replicas[b].rank;
            if (token_on[ra] != token_on[rb]) return token_on[ra];
            return rank_load[ra] < rank_load[rb];
          };
          if (i == 0 || better(c, best)) best = c;
        }
        const auto& replica = replicas[best];
        chosen[j] = {replica.rank, j};
        locals[j] = replica.local_index;
        token_on[replica.rank] = true;
        ++rank_load[replica.rank];
      }
    }
    for (int j = 0; j < k; ++j) token_on[chosen[j].first] = false;
    // Group the token's choices by rank; within a rank keep ascending local expert order.
    std::sort(chosen.begin(), chosen.end(), [&](const auto& a, const auto& b) {
      return a.first != b.first ? a.first < b.first : locals[a.second] < locals[b.second];
    });
    for (int j = 0; j < k;) {
      const int r = chosen[j].first;
      RankDispatch& rd = plan.ranks[r];
      rd.token_rows.push_back(static_cast<int32_t>(t));
      for (; j < k && chosen[j].first == r; ++j) {
        rd.assignments.local_experts.push_back(locals[chosen[j].second]);
        rd.assignments.gates.push_back(routing.weights[t * k + chosen[j].second]);
      }
      rd.assignments.offsets.push_back(static_cast<int32_t>(rd.assignments.local_experts.size()));
    }
  }
  return plan;
}

absl::StatusOr<ExpertAssignments> GroupByExpert(const RowAssignments& rows, int num_local_experts) {
  ExpertAssignments out;
  out.offsets.assign(num_local_experts + 1, 0);
  const int64_t n = static_cast<int64_t>(rows.local_experts.size());
  if (rows.offsets.empty() || rows.offsets.front() != 0 || rows.offsets.back() != n ||
      rows.gates.size() != rows.local_experts.size())
    return absl::InvalidArgumentError("malformed row assignments");
  // Checked before any row is read: ascending from 0 to n keeps every row inside the lists
  // (offsets come off the wire, e.g. [0, 100, 2] with 2 assignments).
  for (size_t r = 0; r + 1 < rows.offsets.size(); ++r)
    if (rows.offsets[r] > rows.offsets[r + 1])
      return absl::InvalidArgumentError("row assignment offsets not ascending");
  for (int32_t e : rows.local_experts) {
    if (e < 0 || e >= num_local_experts)
      return absl::InvalidArgumentError(
          absl::StrCat("local expert ", e, " outside [0, ", num_local_experts, ")"));
    out.offsets[e + 1]++;
  }
  for (int e = 0; e < num_local_experts; ++e) out.offsets[e + 1] += out.offsets[e];
  out.rows.resize(n);
  out.gates.resize(n);
  std::vector<int32_t> fill(out.offsets.begin(), out.offsets.end() - 1);
  for (int64_t r = 0; r + 1 < static_cast<int64_t>(rows.offsets.size()); ++r) {
    for (int32_t i = rows.offsets[r]; i < rows.offsets[r + 1]; ++i) {
      const int32_t slot = fill[rows.local_experts[i]]++;
      out.rows[slot] = static_cast<int32_t>(r);
      out.gates[slot] = rows.gates[i];
    }
  }
  return out;
}

}  // namespace moe

// Expert placement and the per-step dispatch plan (docs/DESIGN.md "Dispatch rule").
//
// A token's expert-input row crosses to a rank once, however many of its selected experts
// live there (rank dedup); with it go the token's local expert ids and gate weights.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace moe {

// Which rank hosts which experts. An expert may have several replicas (load balancing);
// each token uses exactly one of them, so results do not depend on the replica chosen.
struct ExpertPlacement {
  struct Replica {
    int rank;
    int local_index;  // position in rank_experts[rank]
  };
  int num_experts = 0;
  std::vector<std::vector<int>> rank_experts;  // rank -> hosted global expert ids, ascending
  std::vector<std::vector<Replica>> replicas;  // expert -> its replicas (>= 1)

  int num_ranks() const { return static_cast<int>(rank_experts.size()); }

  // Contiguous ranges, sizes differing by at most one (the first E % R ranks get one more).
  static ExpertPlacement Contiguous(int num_experts, int num_ranks);
  // From an explicit rank -> experts map; every expert must be hosted at least once.
  static absl::StatusOr<ExpertPlacement> FromRankExperts(
      int num_experts, std::vector<std::vector<int>> rank_experts);
  // Text form: one line per rank, expert ids separated by commas or spaces ("0-3,7" ranges ok).
  // The text may come from the network (ApplyPlacement): ids are checked before a range is
  // expanded and a rank lists each expert once, so a line costs at most num_experts ids, and
  // more than `max_ranks` lines are refused before they are stored.
  static absl::StatusOr<ExpertPlacement> Parse(int num_experts, const std::string& text,
                                               int max_ranks = std::numeric_limits<int>::max());
  std::string ToString() const;
};

// Routing of one step: ids/weights [tokens, top_k], host memory.
struct Routing {
  int64_t tokens = 0;
  int top_k = 0;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// Per-row expert choices a rank receives: row r uses local experts
// local_experts[offsets[r] .. offsets[r+1]) with the matching gates.
struct RowAssignments {
  std::vector<int32_t> offsets{0};
  std::vector<int32_t> local_experts;
  std::vector<float> gates;
  int64_t num_rows() const { return static_cast<int64_t>(offsets.size()) - 1; }
  void Clear() {
    offsets.assign(1, 0);
    local_experts.clear();
    gates.clear();
  }
};

struct RankDispatch {
  std::vector<int32_t> token_rows;  // rows of the step sent to this rank, ascending
  RowAssignments assignments;       // one entry per token row
};

struct DispatchPlan {
  std::vector<RankDispatch> ranks;
  // Serving partially (Build with `segment_ends`): the tokens left out because they, or a token
  // of their segment, chose an expert without a live replica (ascending), and those experts.
  std::vector<int64_t> unserved_tokens;
  std::vector<int> unavailable_experts;
  // UNAVAILABLE naming the unavailable experts (OK when there are none).
  absl::Status UnavailableStatus() const;
  // Builds the plan. Each (token, replicated expert) goes to one replica, chosen in token order
  // (deterministic): one on a rank the token's row goes to anyway (for its experts with a single
  // replica, or an earlier choice), else the replica on the rank with the fewest (token, expert)
  // pairs of this step so far, ties rotating with the token. With `live_ranks`, only replicas
  // on live ranks count, and UNAVAILABLE names the chosen experts that have none, unless
  // `segment_ends` is given (the ascending token offsets where each caller's rows end; empty:
  // every token on its own): then every segment holding a token that chose one is left out of
  // the plan and listed (the others' results do not depend on them). Fails on expert ids out
  // of range. The result does not depend on the replica chosen (fp64 combine).
  static absl::StatusOr<DispatchPlan> Build(const Routing& routing,
                                            const ExpertPlacement& placement,
                                            const std::vector<bool>* live_ranks = nullptr,
                                            const std::vector<int64_t>* segment_ends = nullptr);
};

// Regroups a rank's per-row choices by local expert (CSR) for the grouped expert kernel;
// within an expert, rows stay ascending.
absl::StatusOr<ExpertAssignments> GroupByExpert(const RowAssignments& rows, int num_local_experts);

}  // namespace moe

// Load-balance math for the expert-parallel layer: how even the per-expert and per-rank loads
// are, the Quantile Balancing bias update of Kimi K3 (seed 002, paper §2.3.3 Eq. 14) as an
// offline diagnostic, and DeepSeek-EPLB-style placement advice (redundant replicas of hot
// experts, packed onto ranks by load). Pure math: no I/O, no threads, no backend.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "model/dispatch.h"

namespace moe {

// --- balance of loads ---------------------------------------------------------------------

// mean(loads) / max(loads): 1 = perfectly balanced, 1/n = everything on one of n. Returns 1 for
// an empty span and when max(loads) == 0 (nothing to balance). Loads must be >= 0 (not checked).
double Balancedness(absl::Span<const double> loads);

// Per-rank loads under `placement` from per-expert loads: a replicated expert's load is split
// evenly over its replicas (what DispatchPlan's round-robin over replicas does in expectation).
// Fails if expert_loads.size() != placement.num_experts.
absl::StatusOr<std::vector<double>> RankLoads(const ExpertPlacement& placement,
                                              absl::Span<const double> expert_loads);

// --- Quantile Balancing --------------------------------------------------------------------

// Quantile Balancing over a window of N recorded tokens (seed 002, QuantileBalancer.update):
//   biased[t, e]   = s[t, e] + b[e]                         (fp32)
//   cutoff[t]      = the (k+1)-th largest of biased[t, :]   (torch.topk(biased, k + 1)[:, -1])
//   relative[t, e] = cutoff[t] - s[t, e]                    (fp32; the bias e needs to cross)
//   quantile[e]    = torch.quantile(relative[:, e], p, interpolation="higher"), p = k / E
//   bias[e]        = quantile[e] - mean(quantile)           (centered)
// Edge cases, exactly:
//  * "(k+1)-th largest" counts ties with multiplicity: the value at 0-based position k of the
//    row sorted in descending order (so (0.9, 0.5, 0.5, 0.1) has cutoff 0.5 for k = 1 and
//    k = 2). k = E - 1 makes the cutoff the row's smallest biased score; k = 1 its second
//    largest. The cutoff ignores the DeepSeek group limit, as the seed's snippet does.
//  * "higher" quantile: the sample at 0-based index QuantileHigherIndex(N, k / E) of the
//    column sorted ascending. That is ceil(p * (N - 1)) evaluated as torch 1.13 evaluates it,
//    in fp32 (see QuantileHigherIndex), so the result is always one of the column's samples.
//  * Centering: mean(quantile) is the fp64 sum of the fp32 quantiles divided by E, rounded once
//    to fp32; bias[e] = fp32(quantile[e] - that). NOTES: the seed takes an fp32 torch mean,
//    whose summation order depends on torch's SIMD dispatch; the fp64 sum is exact (hence
//    order-free) unless the quantiles span more than ~2^29 in magnitude, and differs from the
//    seed's result by an ulp of the mean at most.
//  * Equal values compare equal (-0 == +0); results are defined up to the sign of a zero.
//  * Errors (InvalidArgument): N = 0; N > 2^24 (torch.quantile refuses it too); E < 2;
//    k outside [1, E - 1]; scores.size() not a multiple of E; bias.size() != E; a NaN or
//    infinite score or bias; a bad group setting (see CountSelections).
struct QuantileBalanceResult {
  std::vector<float> bias;                // [E] the new selection bias, centered to mean zero
  std::vector<float> quantile;            // [E] the same before centering (a sample of each column)
  std::vector<int64_t> observed_counts;   // [E] selections per expert with the current bias
  std::vector<int64_t> predicted_counts;  // [E] selections per expert with the new bias
  double observed_balancedness = 1;       // mean / max of observed_counts
  double predicted_balancedness = 1;      // mean / max of predicted_counts
  int64_t tokens = 0;                     // N
};

// scores: [N, E] row-major raw router scores (sigmoid outputs, fp32), E = routing.num_experts,
// N = scores.size() / E. bias: [E] the selection bias the scores were routed with. Uses
// routing.top_k, n_group and topk_group (the counts honour the group limit).
absl::StatusOr<QuantileBalanceResult> QuantileBalance(absl::Span<const float> scores,
                                                      absl::Span<const float> bias,
                                                      const RoutingParams& routing);

// Index of torch.quantile(x, p, interpolation="higher") in x sorted ascending, for n >= 1
// samples: ceil(fp32(fp32(p) * fp32(n - 1))), clamped to [0, n - 1]. NOTES: torch turns q into a
// tensor of the input's dtype and computes the rank in it, so for fp32 input this can exceed
// the exact ceil(p * (n - 1)): p = 0.3, n = 51 gives 16, not 15. Exact for n - 1 <= 2^24.
int64_t QuantileHigherIndex(int64_t n, double p);

// Per-expert selection counts of the router's top-k of s + b over [N, E] scores: fp32 adds,
// higher biased score first, ties to the lower expert index (as CpuBackend::SelectExperts).
// DeepSeek group limit when n_group > 1 and topk_group < n_group: a group's score is the sum of
// its two best biased scores (the best alone for groups of one expert), the topk_group best
// groups are kept (ties to the lower group index), experts of other groups cannot be chosen.
// Fails unless E % n_group == 0, 1 <= topk_group <= n_group, 1 <= k <= E, scores.size() a
// multiple of E, bias.size() == E, and, with the group limit, k <= topk_group * E / n_group.
absl::StatusOr<std::vector<int64_t>> CountSelections(absl::Span<const float> scores,
                                                     absl::Span<const float> bias,
                                                     const RoutingParams& routing);

// The router scores of the last `capacity_tokens` tokens, for QuantileBalance. Memory grows
// with the tokens added, up to capacity_tokens * num_experts floats.
// Thread-safety: none. The caller serializes Add and Clear against every other call (const
// calls may run concurrently with each other).
class RouterScoreWindow {
 public:
  // Needs num_experts >= 1 and capacity_tokens >= 1; otherwise every Add fails.
  RouterScoreWindow(int num_experts, int64_t capacity_tokens);

  // Appends scores [T, E] row-major (T = scores.size() / E, may be 0), evicting the oldest
  // tokens beyond the capacity. Fails, adding nothing, if scores.size() % E != 0.
  absl::Status Add(absl::Span<const float> scores);
  // [size(), E] row-major, oldest token first.
  std::vector<float> Snapshot() const;
  void Clear();

  int num_experts() const { return num_experts_; }
  int64_t capacity() const { return capacity_; }
  int64_t size() const;                                 // tokens held, <= capacity()
  int64_t total_added() const { return total_added_; }  // tokens ever added since Clear

 private:
  int num_experts_;
  int64_t capacity_;
  std::vector<float> rows_;  // ring of size() rows; grows until it holds capacity() rows
  int64_t next_ = 0;         // row the next token overwrites once the ring is full
  int64_t total_added_ = 0;
};

// --- expert placement advice (DeepSeek EPLB) ---------------------------------------------

struct PlacementAdvice {
  ExpertPlacement placement;
  std::vector<int> replica_counts;          // [E] replicas per expert (>= 1)
  std::vector<double> predicted_rank_load;  // [R] RankLoads(placement, expert_loads)
  double predicted_balancedness = 1;        // Balancedness(predicted_rank_load)
  double current_balancedness = 1;          // the same under the current placement
};

// Placement of E experts (E = expert_loads.size(), loads e.g. token counts) on num_ranks ranks
// with num_slots expert slots in all (E plus the redundant replicas), num_slots / num_ranks per
// rank:
//  (a) every expert gets one replica; each of the num_slots - E redundant slots then goes, one
//      at a time, to the expert with the highest load per replica (ties: lower expert id)
//      among those with fewer than num_ranks replicas;
//  (b) replicas, sorted by load per replica descending (ties: lower expert id), are placed one
//      at a time on the rank with the lowest load so far (ties: lower rank) among those with
//      a free slot that do not host the expert yet.
// Deterministic. Requires E >= 1, num_ranks >= 1, num_slots % num_ranks == 0 and
// E <= num_slots <= E * num_ranks (every rank fills its slots with distinct experts);
// loads finite and >= 0; current.num_experts == E. All zero loads give the redundant
// replicas to the lowest expert ids. Returns Internal if the packing reaches a replica for
// which every rank with a free slot already hosts its expert (never seen: see the tests).
absl::StatusOr<PlacementAdvice> AdvisePlacement(absl::Span<const double> expert_loads,
                                                int num_ranks, int num_slots,
                                                const ExpertPlacement& current);

// The placement file (ExpertPlacement::Parse reads it back): '#' comment lines with the
// predicted and current balancedness, then placement.ToString() (one line per rank).
std::string PlacementFileText(const PlacementAdvice& advice);

}  // namespace moe

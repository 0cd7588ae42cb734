// The router's selection rule on the host, written once: the CPU backend's SelectExperts and the
// load balancer's what-if counts (model/load_balance.h) both rank experts with it, so the
// placement advice counts exactly the choices the router makes. The CUDA kernel implements the
// same comparisons (kernels/cuda/cuda_backend.h); tests compare it with this one.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/backend.h"

namespace moe {

// A total order on (score, expert): the higher score first, ties to the lower index, NaN last.
inline bool RanksBefore(float a, int ia, float b, int ib) {
  const bool a_nan = std::isnan(a), b_nan = std::isnan(b);
  if (a_nan != b_nan) return b_nan;
  if (!a_nan && a != b) return a > b;
  return ia < ib;
}

// Whether `params` limits the choice to the best groups (DeepSeek-V3 group-limited routing).
inline bool GroupLimited(const RoutingParams& params) {
  return params.n_group > 1 && params.topk_group < params.n_group;
}

// Scratch of one thread's rankings, sized once per expert count.
struct RouterScratch {
  explicit RouterScratch(const RoutingParams& params)
      : order(params.num_experts),
        group_order(std::max(1, params.n_group)),
        group_score(std::max(1, params.n_group)),
        keep(std::max(1, params.n_group)) {}
  std::vector<int> order, group_order;
  std::vector<float> group_score;
  std::vector<bool> keep;
};

// Ranks the experts of one token by their biased scores `biased` (E of them): afterwards
// scratch.order[0..top_k) are the chosen experts, best first. With a group limit, a group's score
// is the sum of its two best biased scores and experts outside the topk_group best groups are
// set to -inf in `biased` first, so they cannot be chosen.
inline void RankExperts(const RoutingParams& params, float* biased, RouterScratch& scratch) {
  const int E = params.num_experts;
  if (GroupLimited(params)) {
    const int groups = params.n_group, size = E / groups;
    for (int g = 0; g < groups; ++g) {
      float best = -std::numeric_limits<float>::infinity(), second = best;
      for (int e = g * size; e < (g + 1) * size; ++e) {
        const float v = biased[e];
        if (v > best) {
          second = best;
          best = v;
        } else if (v > second) {
          second = v;
        }
      }
      scratch.group_score[g] = size >= 2 ? best + second : best;
    }
    std::iota(scratch.group_order.begin(), scratch.group_order.end(), 0);
    std::partial_sort(scratch.group_order.begin(), scratch.group_order.begin() + params.topk_group,
                      scratch.group_order.end(), [&](int a, int c) {
                        return RanksBefore(scratch.group_score[a], a, scratch.group_score[c], c);
                      });
    std::fill(scratch.keep.begin(), scratch.keep.end(), false);
    for (int i = 0; i < params.topk_group; ++i) scratch.keep[scratch.group_order[i]] = true;
    for (int e = 0; e < E; ++e)
      if (!scratch.keep[e / size]) biased[e] = -std::numeric_limits<float>::infinity();
  }
  std::iota(scratch.order.begin(), scratch.order.end(), 0);
  std::partial_sort(scratch.order.begin(), scratch.order.begin() + params.top_k,
                    scratch.order.end(),
                    [&](int a, int c) { return RanksBefore(biased[a], a, biased[c], c); });
}

}  // namespace moe

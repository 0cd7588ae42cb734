// The router: s = sigmoid(logit); top-k of s + bias with DeepSeek-V3 group limits; weights
// from s, renormalized (top_k > 1) and scaled. One thread block per token.
//
// NOTES: the comparisons and the fp32 operation sequence are CpuBackend::SelectExperts':
// the same group scores (best + second in a sequential scan), the same strict total order
// (higher biased score first, lower index on ties, NaN last), the same sequential weight sum
// and division, and core/numerics.h Sigmoid (a fixed fp32 sequence, no libm). Given the same
// logits the ids and weights are bitwise the CPU's; the logits themselves come from a GEMM
// whose fp32 summation order differs, so in a whole layer a choice can differ on near-ties.
#include <cmath>

#include "kernels/cuda/device_common.cuh"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxExperts = 4096;

__device__ __forceinline__ bool RanksBefore(float a, int ia, float b, int ib) {
  // ib < 0 is "no candidate": after everything.
  if (ib < 0) return ia >= 0;
  if (ia < 0) return false;
  const bool a_nan = isnan(a), b_nan = isnan(b);
  if (a_nan != b_nan) return b_nan;
  if (!a_nan && a != b) return a > b;
  return ia < ib;
}

__global__ void SelectExpertsKernel(const float* logits, int64_t stride, int64_t tokens,
                                    const float* bias, int num_experts, int top_k, bool renormalize,
                                    float scaling, int n_group, int topk_group, int32_t* ids,
                                    float* weights) {
  extern __shared__ float smem[];
  const int E = num_experts;
  float* score = smem;
  float* biased = score + E;
  float* group_score = biased + E;                                            // [n_group]
  int* selected = reinterpret_cast<int*>(group_score + n_group);              // [top_k]
  unsigned char* taken = reinterpret_cast<unsigned char*>(selected + top_k);  // [E]
  unsigned char* keep = taken + E;                                            // [n_group]
  __shared__ float warp_val[kThreads / 32];
  __shared__ int warp_idx[kThreads / 32];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool limit_groups = n_group > 1 && topk_group < n_group;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const float* z = logits + t * stride;
    for (int e = tid; e < E; e += kThreads) {
      const float s = Sigmoid(z[e]);
      score[e] = s;
      biased[e] = __fadd_rn(s, bias != nullptr ? bias[e] : 0.0f);
      taken[e] = 0;
    }
    __syncthreads();

    if (limit_groups) {
      // A group's score: the sum of its two best biased scores (CpuBackend's scan).
      const int size = E / n_group;
      for (int g = tid; g < n_group; g += kThreads) {
        float best = -INFINITY, second = -INFINITY;
        for (int e = g * size; e < (g + 1) * size; ++e) {
          const float v = biased[e];
          if (v > best) {
            second = best;
            best = v;
          } else if (v > second) {
            second = v;
          }
        }
        group_score[g] = size >= 2 ? __fadd_rn(best, second) : best;
        keep[g] = 0;
      }
      __syncthreads();
      if (tid == 0) {
        // The topk_group best groups under the router's order (the set is unique).
        for (int i = 0; i < topk_group; ++i) {
          int best = -1;
          for (int g = 0; g < n_group; ++g)
            if (!keep[g] &&
                RanksBefore(group_score[g], g, best >= 0 ? group_score[best] : 0.0f, best))
              best = g;
          keep[best] = 1;
        }
      }
      __syncthreads();
      for (int e = tid; e < E; e += kThreads)
        if (!keep[e / size]) biased[e] = -INFINITY;
      __syncthreads();
    }

    // top_k rounds of a block-wide arg-best over the experts not yet taken.
    for (int j = 0; j < top_k; ++j) {
      float best_v = 0.0f;
      int best_i = -1;
      for (int e = tid; e < E; e += kThreads) {
        if (taken[e]) continue;
        if (RanksBefore(biased[e], e, best_v, best_i)) {
          best_v = biased[e];
          best_i = e;
        }
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best_v, offset);
        const int oi = __shfl_xor_sync(0xffffffffu, best_i, offset);
        if (RanksBefore(ov, oi, best_v, best_i)) {
          best_v = ov;
          best_i = oi;
        }
      }
      if (lane == 0) {
        warp_val[warp] = best_v;
        warp_idx[warp] = best_i;
      }
      __syncthreads();
      if (tid == 0) {
        float v = warp_val[0];
        int i = warp_idx[0];
        for (int w = 1; w < kThreads / 32; ++w)
          if (RanksBefore(warp_val[w], warp_idx[w], v, i)) {
            v = warp_val[w];
            i = warp_idx[w];
          }
        selected[j] = i;
        taken[i] = 1;
      }
      __syncthreads();
    }

    if (tid == 0) {
      int32_t* out_ids = ids + t * top_k;
      float* out_w = weights + t * top_k;
      float sum = 0.0f;
      for (int j = 0; j < top_k; ++j) {
        out_ids[j] = selected[j];
        out_w[j] = score[selected[j]];
        sum = __fadd_rn(sum, out_w[j]);
      }
      for (int j = 0; j < top_k; ++j) {
        float w = out_w[j];
        if (renormalize) w = __fdiv_rn(w, __fadd_rn(sum, 1e-20f));
        out_w[j] = __fmul_rn(w, scaling);
      }
    }
    __syncthreads();  // shared arrays are reused by the next token
  }
}

}  // namespace

cudaError_t LaunchSelectExperts(const float* logits, int64_t stride, int64_t tokens,
                                const float* bias, int num_experts, int top_k, bool renormalize,
                                float scaling, int n_group, int topk_group, int32_t* ids,
                                float* weights, cudaStream_t s) {
  if (tokens == 0) return cudaSuccess;
  if (num_experts <= 0 || num_experts > kMaxExperts || top_k <= 0 || top_k > num_experts ||
      n_group <= 0 || num_experts % n_group != 0 || topk_group <= 0 || topk_group > n_group)
    return cudaErrorInvalidValue;
  const size_t smem = sizeof(float) * (2 * num_experts + n_group) + sizeof(int) * top_k +
                      static_cast<size_t>(num_experts + n_group);
  const int64_t blocks = tokens < (int64_t{1} << 20) ? tokens : (int64_t{1} << 20);
  SelectExpertsKernel<<<static_cast<unsigned>(blocks), kThreads, smem, s>>>(
      logits, stride, tokens, bias, num_experts, top_k, renormalize, scaling, n_group, topk_group,
      ids, weights);
  return cudaGetLastError();
}

}  // namespace moe::cuda

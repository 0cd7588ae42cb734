// The instruction-level probes of the roofline: a streaming read and the peak of the arithmetic
// each CPU kernel tier runs on (fp32 FMA on 8 or 16 lanes, VDPBF16PS). Each ISA variant is one
// function with its own target attribute, called only after the host check, so the benchmark
// runs on any x86-64 host.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "tools/bench/probes.h"

namespace moe::bench {
namespace {

#if defined(__x86_64__)
// Four independent accumulators, so the loop is bound by memory, not by the add latency.
__attribute__((target("avx512f"))) uint64_t StreamReadAvx512(const uint8_t* data, size_t bytes) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 256 <= bytes; i += 256) {
    a0 = _mm512_add_epi64(a0, _mm512_load_si512(data + i));
    a1 = _mm512_add_epi64(a1, _mm512_load_si512(data + i + 64));
    a2 = _mm512_add_epi64(a2, _mm512_load_si512(data + i + 128));
    a3 = _mm512_add_epi64(a3, _mm512_load_si512(data + i + 192));
  }
  const __m512i s = _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3));
  uint64_t sum = static_cast<uint64_t>(_mm512_reduce_add_epi64(s));
  for (; i < bytes; ++i) sum += data[i];
  return sum;
}

__attribute__((target("avx2"))) uint64_t StreamReadAvx2(const uint8_t* data, size_t bytes) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    a0 = _mm256_add_epi64(a0, _mm256_load_si256(reinterpret_cast<const __m256i*>(data + i)));
    a1 = _mm256_add_epi64(a1, _mm256_load_si256(reinterpret_cast<const __m256i*>(data + i + 32)));
    a2 = _mm256_add_epi64(a2, _mm256_load_si256(reinterpret_cast<const __m256i*>(data + i + 64)));
    a3 = _mm256_add_epi64(a3, _mm256_load_si256(reinterpret_cast<const __m256i*>(data + i + 96)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                     _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
  uint64_t sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  for (; i < bytes; ++i) sum += data[i];
  return sum;
}

uint64_t StreamReadPortable(const uint8_t* data, size_t bytes) {
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  size_t i = 0;
  const auto* words = reinterpret_cast<const uint64_t*>(data);
  for (; i + 32 <= bytes; i += 32) {
    a0 += words[i / 8];
    a1 += words[i / 8 + 1];
    a2 += words[i / 8 + 2];
    a3 += words[i / 8 + 3];
  }
  uint64_t sum = a0 + a1 + a2 + a3;
  for (; i < bytes; ++i) sum += data[i];
  return sum;
}

// Independent chains (more than latency x ports on the cores measured): 12 in the 16 ymm
// registers, 24 in the 32 zmm ones; `iters` steps each. The chain loops are unrolled by pragma:
// left to GCC, the 24-chain zmm loops kept their accumulators on the stack (a load, an FMA and a
// store per step), and the avx512 tier's "peak" came out below what its kernels then ran at.
constexpr int kChains = 12;
constexpr int kZmmChains = 24;

__attribute__((target("avx2,fma"))) float FmaLoopYmm(int64_t iters) {
  __m256 acc[kChains];
#pragma GCC unroll 12
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_ps(1.0f + 0.001f * static_cast<float>(c));
  const __m256 m = _mm256_set1_ps(0.9999999f), a = _mm256_set1_ps(1e-7f);
  for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 12
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], m, a);
  __m256 s = acc[0];
#pragma GCC unroll 12
  for (int c = 1; c < kChains; ++c) s = _mm256_add_ps(s, acc[c]);
  return _mm256_cvtss_f32(s);
}

__attribute__((target("avx512f"))) float FmaLoopZmm(int64_t iters) {
  __m512 acc[kZmmChains];
#pragma GCC unroll 24
  for (int c = 0; c < kZmmChains; ++c)
    acc[c] = _mm512_set1_ps(1.0f + 0.001f * static_cast<float>(c));
  const __m512 m = _mm512_set1_ps(0.9999999f), a = _mm512_set1_ps(1e-7f);
  for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 24
    for (int c = 0; c < kZmmChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], m, a);
  __m512 s = acc[0];
#pragma GCC unroll 24
  for (int c = 1; c < kZmmChains; ++c) s = _mm512_add_ps(s, acc[c]);
  return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx512f,avx512bf16"))) float Bf16DotLoopZmm(int64_t iters) {
  __m512 acc[kZmmChains];
#pragma GCC unroll 24
  for (int c = 0; c < kZmmChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3F80), w = (__m512bh)_mm512_set1_epi16(0x3380);
  for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 24
    for (int c = 0; c < kZmmChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], x, w);
  __m512 s = acc[0];
#pragma GCC unroll 24
  for (int c = 1; c < kZmmChains; ++c) s = _mm512_add_ps(s, acc[c]);
  return _mm512_reduce_add_ps(s);
}

#endif  // __x86_64__

// Scalar FMAs through libm (what the portable kernels run).
float FmaLoopScalar(int64_t iters) {
  float acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = 1.0f + 0.001f * static_cast<float>(c);
  for (int64_t i = 0; i < iters; ++i)
    for (float& v : acc) v = __builtin_fmaf(v, 0.9999999f, 1e-7f);
  float s = 0;
  for (float v : acc) s += v;
  return s;
}

}  // namespace

StreamReadFn StreamReadKernel(std::string* name) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) {
    if (name) *name = "avx512";
    return &StreamReadAvx512;
  }
  if (__builtin_cpu_supports("avx2")) {
    if (name) *name = "avx2";
    return &StreamReadAvx2;
  }
#endif
  if (name) *name = "portable";
  return &StreamReadPortable;
}

ComputeLoop ComputeLoopFor(const std::string& tier, bool bf16_mode) {
#if defined(__x86_64__)
  if (tier == "avx512-bf16" && bf16_mode)
    return {&Bf16DotLoopZmm, 64.0 * kZmmChains, "VDPBF16PS zmm"};
  if (tier == "avx512-bf16" || tier == "avx512")
    return {&FmaLoopZmm, 32.0 * kZmmChains, "fp32 FMA zmm"};
  if (tier == "avx2") return {&FmaLoopYmm, 16.0 * kChains, "fp32 FMA ymm"};
#endif
  (void)bf16_mode;
  return {&FmaLoopScalar, 2.0 * kChains, "scalar fp32 FMA"};
}

}  // namespace moe::bench

// Bit-for-bit checks of a kernel table against the portable definition, as functions that say
// what differed (so a test can also show that each check fails on a corrupted kernel), and the
// corrupted kernels themselves.
#pragma once

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/canonical.h"
#include "kernels/cpu/dot.h"
#include "tests/kernels/test_weights.h"

namespace moe::testing {

// Packed operand rows in a format's canonical order (the portable packing).
struct PackedRows {
  std::vector<uint8_t> bytes;
  int64_t stride = 0;  // elements
};
inline PackedRows PackRows(const std::vector<float>& x, int64_t m, int64_t k, WeightFormat f,
                           Precision p) {
  PackedRows out;
  out.stride = cpu::PaddedK(k);
  const size_t elem = ElementBytes(p);
  out.bytes.resize(m * out.stride * elem);
  for (int64_t i = 0; i < m; ++i)
    cpu::PackActivationRow(x.data() + i * k, k, f, p, out.bytes.data() + i * out.stride * elem);
  return out;
}

// y = x W^T by `kernels`, as two calls over a split of the weight rows (as threads make them).
inline std::vector<float> RunDot(const cpu::DotKernels& kernels, const PackedRows& x, int64_t m,
                                 const WeightMatrix& w, Precision p,
                                 const int32_t* rows = nullptr) {
  cpu::DotOperands op;
  op.x = x.bytes.data();
  op.x_stride = x.stride;
  op.x_rows = rows;
  op.m = m;
  op.w = &w;
  op.precision = p;
  std::vector<float> y(m * w.rows, NAN);
  cpu::DotScratch scratch;
  const int64_t split = w.rows / 2;
  kernels.dot_rows(op, 0, split, y.data(), w.rows, &scratch);
  kernels.dot_rows(op, split, w.rows, y.data() + split, w.rows, &scratch);
  return y;
}

inline bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

// Whether `kernels` gives the portable bits for y = x W^T on random data of this shape.
inline ::testing::AssertionResult DotMatchesPortable(const cpu::DotKernels& kernels, WeightFormat f,
                                                     Precision p, int64_t k, int64_t n, int64_t m) {
  const uint32_t seed = static_cast<uint32_t>(k * 131 + n * 17 + m);
  RandomWeight w(f, n, k, seed);
  const auto x = RandomActivations(m, k, seed + 1, p == Precision::kBF16);
  const PackedRows packed = PackRows(x, m, k, f, p);
  const auto want = RunDot(*cpu::PortableDotKernels(), packed, m, w.view, p);
  const auto got = RunDot(kernels, packed, m, w.view, p);
  for (size_t e = 0; e < want.size(); ++e)
    if (!SameBits(got[e], want[e]))
      return ::testing::AssertionFailure()
             << kernels.name << " " << WeightFormatName(f) << " " << PrecisionName(p) << " k=" << k
             << " n=" << n << " m=" << m << ": y[" << e / n << "][" << e % n << "] = " << got[e]
             << ", portable " << want[e];
  return ::testing::AssertionSuccess();
}

// Whether `glu` gives the portable bits on random gate/up values (with the branch boundaries
// of tanh and its saturation point among them).
inline ::testing::AssertionResult GluMatchesPortable(cpu::GluRowFn glu, int64_t n,
                                                     const ActivationParams& act, Precision p) {
  std::mt19937 rng(static_cast<uint32_t>(n * 7 + static_cast<int>(act.kind)));
  std::uniform_real_distribution<float> dist(-12.0f, 12.0f);
  std::vector<float> g(n), u(n);
  for (int64_t i = 0; i < n; ++i) {
    g[i] = dist(rng) * (i % 5 == 0 ? 0.02f : 1.0f) * (i % 11 == 0 ? 20.0f : 1.0f);
    u[i] = dist(rng) * (i % 3 == 0 ? 5.0f : 1.0f);
  }
  if (n > 4) {
    g[0] = 4 * 0.3f;
    u[1] = 25 * 0.3f;
    g[2] = 36.0f;
    u[3] = -225.0f;
  }
  std::vector<float> want(n), got(n);
  cpu::PortableGluRow(g.data(), u.data(), n, act, p, want.data());
  glu(g.data(), u.data(), n, act, p, got.data());
  for (int64_t i = 0; i < n; ++i)
    if (!SameBits(got[i], want[i]))
      return ::testing::AssertionFailure()
             << "GLU n=" << n << " " << PrecisionName(p) << " i=" << i << " g=" << g[i]
             << " u=" << u[i] << ": " << got[i] << ", portable " << want[i];
  return ::testing::AssertionSuccess();
}

// Whether `pack` gives PackActivationRow's bytes (padding included) for a random row of k.
inline ::testing::AssertionResult PackMatchesPortable(cpu::PackRowFn pack, WeightFormat f,
                                                      Precision p, int64_t k) {
  std::mt19937 rng(static_cast<uint32_t>(k));
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> x(k);
  for (float& v : x) v = normal(rng);
  const size_t bytes = cpu::PaddedK(k) * ElementBytes(p);
  std::vector<uint8_t> want(bytes, 0xAB), got(bytes, 0xCD);  // different garbage: padding too
  cpu::PackActivationRow(x.data(), k, f, p, want.data());
  pack(x.data(), k, f, p, got.data());
  for (size_t b = 0; b < bytes; ++b)
    if (got[b] != want[b])
      return ::testing::AssertionFailure()
             << "pack " << WeightFormatName(f) << " " << PrecisionName(p) << " k=" << k << ": byte "
             << b << " = " << int{got[b]} << ", portable " << int{want[b]};
  return ::testing::AssertionSuccess();
}

// A copy of a kernel table with one deliberate bug, to show that the checks catch one.
enum class Corruption {
  kDot,   // one output of calls with at least 5 operand rows (a scratch-path bug) is 1 ulp off
  kGlu,   // one activation of each row is 1 ulp off
  kPack,  // one packed bf16 operand is 1 ulp off
};
inline const cpu::DotKernels*& CorruptedBase() {
  static const cpu::DotKernels* base = nullptr;
  return base;
}
inline cpu::DotKernels Corrupted(const cpu::DotKernels& base, Corruption what) {
  CorruptedBase() = &base;
  cpu::DotKernels k = base;
  switch (what) {
    case Corruption::kDot:
      k.dot_rows = [](const cpu::DotOperands& op, int64_t n0, int64_t n1, float* y, int64_t ldy,
                      cpu::DotScratch* scratch) {
        CorruptedBase()->dot_rows(op, n0, n1, y, ldy, scratch);
        if (op.m >= 5 && n1 > n0) y[(op.m - 1) * ldy] = std::nextafter(y[(op.m - 1) * ldy], 1e30f);
      };
      break;
    case Corruption::kGlu:
      k.glu_row = [](const float* g, const float* u, int64_t n, const ActivationParams& act,
                     Precision p, float* out) {
        CorruptedBase()->glu_row(g, u, n, act, p, out);
        if (n > 0) out[n / 2] = std::nextafter(out[n / 2], 1e30f);
      };
      break;
    case Corruption::kPack:
      k.pack_row = [](const float* x, int64_t kk, WeightFormat f, Precision p, void* out) {
        CorruptedBase()->pack_row(x, kk, f, p, out);
        if (p == Precision::kBF16 && kk > 0)
          static_cast<uint16_t*>(out)[cpu::CanonicalIndex(f, kk / 2)] ^= 1;
      };
      break;
  }
  return k;
}

}  // namespace moe::testing

// CudaBackend op by op against CpuBackend (ggml style), on fresh random data, awkward sizes
// (1, 3, 257 rows; widths that are not multiples of 8, 16 or 128), every weight format and
// both precisions, through both GEMM paths (fused GEMV and dequantize + cuBLAS).
//
// Tolerances and why:
//  * Round, Add, RoundPartials, Zero, GatherRows, ScatterAddRows, RmsNorm (bf16): bitwise.
//    Same fp32/fp64 operation sequence on both sides (RmsNorm's fp64 sum of squares is exact
//    for bf16 inputs, whatever the order).
//  * RmsNorm fp32: 2 fp32 ulp (the fp64 sum of squares is summed in another order).
//  * GluActivation: bitwise. Both evaluate core/numerics.h GluActivate, whose exp/tanh are
//    fixed fp32 operation sequences (no libm), without contraction.
//  * Linear: fp32 sums in another order than the CPU's canonical one. bf16: every output
//    within half a bf16 ulp (+ the fp32 accumulation error) of the exact fp64 product, as the
//    CPU test asserts, and >= 98% bitwise equal to the CPU. fp32: |gpu - cpu| <=
//    2 (K + K/128 + 2) 2^-24 sum_k |x_k w_k| (both within the recursive-summation bound).
//  * SelectExperts: given the same logits, ids and weights bitwise (same comparisons, same
//    fp32 sequence, deterministic sigmoid); exact ties go to the lower index.
//  * ExpertMlp: the fp64 combine is bitwise the CPU's given equal o; o differs only by bf16
//    flips from fp32 summation order. bf16: relative L2 <= 4e-3 and >= 80% of elements
//    bitwise equal; fp32: relative L2 <= 1e-5. Determinism: two runs bitwise equal.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/kernels/test_weights.h"

namespace moe {
namespace {

using testing::AbsDot;
using testing::Bf16Ulp;
using testing::DeviceArray;
using testing::Poison;
using testing::RandomActivations;
using testing::RandomWeight;
using testing::ReferenceLinear;
using testing::RelL2;
using testing::SameBits;

constexpr WeightFormat kFormats[] = {WeightFormat::kBF16, WeightFormat::kMXFP4,
                                     WeightFormat::kFP8Block128};
constexpr Precision kPrecisions[] = {Precision::kBF16, Precision::kFP32};

const char* Name(Precision p) { return p == Precision::kBF16 ? "bf16" : "fp32"; }

std::vector<double> RandomPartials(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0, 1);
  std::vector<double> v(n);
  for (auto& d : v) d = normal(rng) * (1.0 + 1e-9 * normal(rng));
  return v;
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MOE_SKIP_WITHOUT_CUDA();
    auto gpu = CudaBackend::Create(CudaBackendOptions{});
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    gpu_ = std::move(*gpu);
    CudaBackendOptions no_gemv;
    no_gemv.gemv_max_rows = 0;
    auto cublas_only = CudaBackend::Create(no_gemv);
    ASSERT_TRUE(cublas_only.ok()) << cublas_only.status();
    cublas_only_ = std::move(*cublas_only);
    CudaBackendOptions all_gemv;
    all_gemv.gemv_max_rows = 1 << 20;
    auto gemv_only = CudaBackend::Create(all_gemv);
    ASSERT_TRUE(gemv_only.ok()) << gemv_only.status();
    gemv_only_ = std::move(*gemv_only);
  }

  // The backends under test: default paths, cuBLAS only, GEMV only.
  std::vector<std::pair<const char*, CudaBackend*>> Variants() {
    return {{"default", gpu_.get()}, {"cublas", cublas_only_.get()}, {"gemv", gemv_only_.get()}};
  }

  CpuBackend cpu_{CpuBackendOptions{2, ""}};
  std::unique_ptr<CudaBackend> gpu_, cublas_only_, gemv_only_;
};

// Runs without a device: the factory must say why it cannot start.
TEST(CudaBackendFactoryTest, UnavailableWithoutDeviceOrForBadOrdinal) {
  if (CudaDeviceCount() == 0) {
    auto backend = CreateCudaBackend(0);
    ASSERT_FALSE(backend.ok());
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kUnavailable) << backend.status();
    EXPECT_NE(backend.status().message().find("no CUDA device"), absl::string_view::npos)
        << backend.status();
  }
  auto bad = CreateCudaBackend(1000);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kUnavailable) << bad.status();
}

TEST_F(CudaBackendTest, ElementwiseOpsAreBitwiseTheCpus) {
  for (int64_t rows : {1, 3, 257}) {
    const int64_t cols = 203, stride = 211;  // strided views
    std::mt19937 rng(static_cast<uint32_t>(rows));
    std::normal_distribution<float> normal(0, 3);
    std::vector<float> a(rows * stride), b(rows * stride);
    for (auto& v : a) v = normal(rng);
    for (auto& v : b) v = normal(rng);
    for (Precision p : kPrecisions) {
      // Round
      {
        std::vector<float> want = a;
        ASSERT_TRUE(cpu_.Round(MatrixView(want.data(), rows, cols, stride), p).ok());
        DeviceArray<float> d(gpu_.get(), a);
        ASSERT_TRUE(gpu_->Round(d.View(rows, cols, stride), p).ok());
        const auto got = d.ToHost();
        for (size_t i = 0; i < got.size(); ++i) ASSERT_TRUE(SameBits(got[i], want[i])) << i;
      }
      // Add (output poisoned first; padding columns must stay untouched)
      {
        std::vector<float> want = Poison(rows * stride);
        ASSERT_TRUE(cpu_.Add(ConstMatrixView(a.data(), rows, cols, stride),
                             ConstMatrixView(b.data(), rows, cols, stride),
                             MatrixView(want.data(), rows, cols, stride), p)
                        .ok());
        DeviceArray<float> da(gpu_.get(), a), db(gpu_.get(), b),
            dy(gpu_.get(), Poison(rows * stride));
        ASSERT_TRUE(gpu_->Add(da.View(rows, cols, stride), db.View(rows, cols, stride),
                              dy.View(rows, cols, stride), p)
                        .ok());
        const auto got = dy.ToHost();
        for (size_t i = 0; i < got.size(); ++i) ASSERT_TRUE(SameBits(got[i], want[i])) << i;
      }
      // RoundPartials (fp64 -> bf16 in one rounding)
      {
        const auto y = RandomPartials(rows * stride, 5);
        std::vector<float> want = Poison(rows * stride);
        ASSERT_TRUE(cpu_.RoundPartials(ConstPartialView(y.data(), rows, cols, stride),
                                       MatrixView(want.data(), rows, cols, stride), p)
                        .ok());
        DeviceArray<double> dy(gpu_.get(), y);
        DeviceArray<float> dout(gpu_.get(), Poison(rows * stride));
        ASSERT_TRUE(
            gpu_->RoundPartials(dy.View(rows, cols, stride), dout.View(rows, cols, stride), p)
                .ok());
        const auto got = dout.ToHost();
        for (size_t i = 0; i < got.size(); ++i) ASSERT_TRUE(SameBits(got[i], want[i])) << i;
      }
    }
    // Zero leaves the padding alone.
    {
      const auto y = RandomPartials(rows * stride, 6);
      std::vector<double> want = y;
      ASSERT_TRUE(cpu_.Zero(PartialView(want.data(), rows, cols, stride)).ok());
      DeviceArray<double> dy(gpu_.get(), y);
      ASSERT_TRUE(gpu_->Zero(dy.View(rows, cols, stride)).ok());
      const auto got = dy.ToHost();
      for (size_t i = 0; i < got.size(); ++i) ASSERT_TRUE(SameBits(got[i], want[i])) << i;
    }
  }
}

TEST_F(CudaBackendTest, GatherAndScatterAddRowsAreExact) {
  const int64_t cols = 77, src_rows = 300;
  std::mt19937 rng(3);
  for (int64_t n : {1, 3, 257}) {
    const auto x = RandomActivations(src_rows, cols, static_cast<uint32_t>(n), false);
    std::vector<int32_t> rows(n);
    std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(src_rows) - 1);
    for (auto& r : rows) r = pick(rng);
    std::vector<float> want(n * cols);
    ASSERT_TRUE(cpu_.GatherRows(ConstMatrixView(x.data(), src_rows, cols, cols), rows,
                                MatrixView(want.data(), n, cols, cols))
                    .ok());
    DeviceArray<float> dx(gpu_.get(), x), dout(gpu_.get(), Poison(n * cols));
    ASSERT_TRUE(
        gpu_->GatherRows(dx.View(src_rows, cols, cols), rows, dout.View(n, cols, cols)).ok());
    EXPECT_EQ(dout.ToHost(), want);
    // Into bf16 storage (a bf16 step's dispatch rows): the CPU backend's bits, strided.
    std::vector<uint16_t> want16(n * (cols + 2), 0x7777);
    ASSERT_TRUE(
        cpu_.GatherRows(ConstMatrixView(x.data(), src_rows, cols, cols), rows,
                        MutableActivationView(want16.data(), Precision::kBF16, n, cols, cols + 2))
            .ok());
    DeviceArray<uint16_t> dout16(gpu_.get(), std::vector<uint16_t>(want16.size(), 0x7777));
    ASSERT_TRUE(
        gpu_->GatherRows(dx.View(src_rows, cols, cols), rows,
                         MutableActivationView(dout16.data(), Precision::kBF16, n, cols, cols + 2))
            .ok());
    EXPECT_EQ(dout16.ToHost(), want16);

    // ScatterAdd: unique rows (a permutation prefix) and rows with repeats.
    for (bool unique : {true, false}) {
      std::vector<int32_t> dst(n);
      if (unique) {
        std::vector<int32_t> perm(src_rows);
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        std::copy(perm.begin(), perm.begin() + n, dst.begin());
      } else {
        std::uniform_int_distribution<int32_t> few(0, 4);
        for (auto& r : dst) r = few(rng);
      }
      const auto partial = RandomPartials(n * cols, 11);
      const auto base = RandomPartials(src_rows * cols, 12);
      std::vector<double> want_y = base;
      ASSERT_TRUE(cpu_.ScatterAddRows(ConstPartialView(partial.data(), n, cols, cols), dst,
                                      PartialView(want_y.data(), src_rows, cols, cols))
                      .ok());
      DeviceArray<double> dp(gpu_.get(), partial), dy(gpu_.get(), base);
      ASSERT_TRUE(
          gpu_->ScatterAddRows(dp.View(n, cols, cols), dst, dy.View(src_rows, cols, cols)).ok());
      const auto got = dy.ToHost();
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_TRUE(SameBits(got[i], want_y[i])) << "unique=" << unique << " i=" << i;
    }
  }
  // Bad row indices are refused before any device work.
  DeviceArray<float> dx(gpu_.get(), std::vector<float>(10 * cols, 1.0f));
  DeviceArray<float> dout(gpu_.get(), std::vector<float>(cols, 0.0f));
  const std::vector<int32_t> bad = {10};
  EXPECT_EQ(gpu_->GatherRows(dx.View(10, cols, cols), bad, dout.View(1, cols, cols)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CudaBackendTest, RmsNormMatchesCpu) {
  for (int64_t rows : {1, 3, 257}) {
    for (int64_t cols : {320, 3584, 77}) {
      std::mt19937 rng(static_cast<uint32_t>(rows * cols));
      std::normal_distribution<float> normal(0, 1);
      std::vector<uint16_t> w(cols);
      for (auto& v : w) v = FloatToBf16Bits(1.0f + 0.05f * normal(rng));
      WeightVector host{w.data(), cols, MemorySpace::kHost};
      auto dw = gpu_->PrepareVector(host);
      ASSERT_TRUE(dw.ok()) << dw.status();
      for (Precision p : kPrecisions) {
        const auto x =
            RandomActivations(rows, cols, static_cast<uint32_t>(cols), p == Precision::kBF16);
        std::vector<float> want(rows * cols);
        ASSERT_TRUE(cpu_.RmsNorm(ConstMatrixView(x.data(), rows, cols, cols), host, 1e-6f,
                                 MatrixView(want.data(), rows, cols, cols), p)
                        .ok());
        DeviceArray<float> dx(gpu_.get(), x), dy(gpu_.get(), Poison(rows * cols));
        ASSERT_TRUE(
            gpu_->RmsNorm(dx.View(rows, cols, cols), *dw, 1e-6f, dy.View(rows, cols, cols), p)
                .ok());
        const auto got = dy.ToHost();
        for (size_t i = 0; i < got.size(); ++i) {
          if (p == Precision::kBF16) {
            ASSERT_TRUE(SameBits(got[i], want[i])) << i << ": " << got[i] << " vs " << want[i];
          } else {
            ASSERT_NEAR(got[i], want[i], 2 * std::ldexp(1.0, std::ilogb(want[i]) - 23)) << i;
          }
        }
      }
    }
  }
}

TEST_F(CudaBackendTest, GluActivationMatchesCpu) {
  for (Activation kind : {Activation::kSiTU, Activation::kSiLU}) {
    ActivationParams act;
    act.kind = kind;
    for (Precision p : kPrecisions) {
      const int64_t rows = 257, cols = 301;
      auto g = RandomActivations(rows, cols, 21, false),
           u = RandomActivations(rows, cols, 22, false);
      for (auto& v : g) v *= 4;  // reach the saturated parts of tanh / sigmoid
      for (auto& v : u) v *= 20;
      std::vector<float> want(rows * cols);
      ASSERT_TRUE(cpu_.GluActivation(ConstMatrixView(g.data(), rows, cols, cols),
                                     ConstMatrixView(u.data(), rows, cols, cols), act,
                                     MatrixView(want.data(), rows, cols, cols), p)
                      .ok());
      DeviceArray<float> dg(gpu_.get(), g), du(gpu_.get(), u),
          dout(gpu_.get(), Poison(rows * cols));
      ASSERT_TRUE(gpu_->GluActivation(dg.View(rows, cols, cols), du.View(rows, cols, cols), act,
                                      dout.View(rows, cols, cols), p)
                      .ok());
      const auto got = dout.ToHost();
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_TRUE(SameBits(got[i], want[i]))
            << Name(p) << " " << i << ": g " << g[i] << " u " << u[i] << " gpu " << got[i]
            << " cpu " << want[i] << (kind == Activation::kSiTU ? " situ" : " silu");
    }
  }
}

struct LinearCase {
  WeightFormat format;
  int64_t n, k;
};

TEST_F(CudaBackendTest, LinearMatchesCpuEveryFormatPrecisionAndPath) {
  // Widths: multiples of 32 (MXFP4 needs them), and for bf16/FP8 widths that are not
  // multiples of 8 / 16 / 128 (scalar GEMV path, partial FP8 scale blocks).
  const LinearCase cases[] = {
      {WeightFormat::kBF16, 67, 320},         {WeightFormat::kBF16, 130, 100},
      {WeightFormat::kMXFP4, 67, 320},        {WeightFormat::kMXFP4, 257, 96},
      {WeightFormat::kFP8Block128, 67, 320},  {WeightFormat::kFP8Block128, 200, 456},
      {WeightFormat::kFP8Block128, 129, 200},
  };
  for (const LinearCase& c : cases) {
    RandomWeight w(c.format, c.n, c.k, static_cast<uint32_t>(c.n * 7 + c.k));
    for (auto& [variant, backend] : Variants()) {
      auto dw = backend->PrepareWeight(w.view);
      ASSERT_TRUE(dw.ok()) << dw.status();
      for (Precision p : kPrecisions) {
        for (int64_t m : {1, 3, 257}) {
          const int64_t x_stride = c.k + 5, y_stride = c.n + 3;  // strided views
          auto x =
              RandomActivations(m, x_stride, static_cast<uint32_t>(m + c.k), p == Precision::kBF16);
          std::vector<float> want(m * y_stride, 0.0f);
          ASSERT_TRUE(cpu_.Linear(ConstMatrixView(x.data(), m, c.k, x_stride), w.view,
                                  MatrixView(want.data(), m, c.n, y_stride), p)
                          .ok());
          DeviceArray<float> dx(backend, x), dy(backend, Poison(m * y_stride));
          ASSERT_TRUE(
              backend->Linear(dx.View(m, c.k, x_stride), *dw, dy.View(m, c.n, y_stride), p).ok());
          const auto got = dy.ToHost();
          // The fp64 reference on the packed (unstrided) operand.
          std::vector<float> xc(m * c.k);
          for (int64_t i = 0; i < m; ++i)
            std::copy(x.begin() + i * x_stride, x.begin() + i * x_stride + c.k,
                      xc.begin() + i * c.k);
          const auto ref = ReferenceLinear(xc, m, w);
          int64_t same = 0;
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < c.n; ++j) {
              const float g = got[i * y_stride + j], cpu = want[i * y_stride + j];
              const double r = ref[i * c.n + j], scale = AbsDot(xc, i, w, j);
              const std::string where = std::string(WeightFormatName(c.format)) + " " + variant +
                                        " " + Name(p) + " m=" + std::to_string(m) +
                                        " k=" + std::to_string(c.k) + " (" + std::to_string(i) +
                                        ", " + std::to_string(j) + ")";
              ASSERT_FALSE(std::isnan(g)) << where;
              if (p == Precision::kBF16) {
                ASSERT_EQ(g, RoundToBf16(g)) << where;
                ASSERT_LE(std::fabs(g - r), 0.5 * Bf16Ulp(r) + 1e-5 * scale + 1e-6) << where;
              } else {
                const double bound =
                    2.0 * (c.k + c.k / 128 + 2) * std::ldexp(1.0, -24) * scale + 1e-30;
                ASSERT_LE(std::fabs(g - cpu), bound) << where << " gpu " << g << " cpu " << cpu;
              }
              same += SameBits(g, cpu);
            }
          if (p == Precision::kBF16) {
            EXPECT_GE(same, 0.98 * m * c.n)
                << WeightFormatName(c.format) << " " << variant << " m=" << m;
          }
          // The row stride padding of y is untouched.
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = c.n; j < y_stride; ++j) ASSERT_TRUE(std::isnan(got[i * y_stride + j]));
        }
      }
    }
  }
}

TEST_F(CudaBackendTest, LinearRefusesHostWeightsAndBadScales) {
  RandomWeight w(WeightFormat::kBF16, 8, 32, 1);
  DeviceArray<float> dx(gpu_.get(), std::vector<float>(32, 1.0f)),
      dy(gpu_.get(), std::vector<float>(8));
  EXPECT_EQ(gpu_->Linear(dx.View(1, 32, 32), w.view, dy.View(1, 8, 8), Precision::kBF16).code(),
            absl::StatusCode::kInvalidArgument);
  RandomWeight q(WeightFormat::kMXFP4, 8, 32, 2);
  q.scale_bytes[3] = 255;
  EXPECT_EQ(gpu_->PrepareWeight(q.view).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->Linear(dx.View(1, 16, 16), *gpu_->PrepareWeight(w.view), dy.View(1, 8, 8),
                         Precision::kBF16)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CudaBackendTest, SelectExpertsMatchesCpuIncludingTiesAndGroups) {
  struct Case {
    int E, k, n_group, topk_group;
    bool renorm;
    float scale;
  };
  for (const Case& c : {Case{64, 2, 1, 1, true, 1.0f}, Case{16, 1, 1, 1, true, 1.0f},
                        Case{16, 16, 1, 1, true, 1.0f}, Case{384, 8, 8, 4, true, 2.827f},
                        Case{896, 16, 1, 1, true, 1.0f}, Case{10, 3, 1, 1, false, 1.0f},
                        Case{64, 8, 8, 4, true, 2.5f}}) {
    const int64_t T = 257;
    std::mt19937 rng(c.E * 13 + c.k);
    std::normal_distribution<float> normal(0, 1);
    std::vector<float> logits(T * c.E), bias(c.E);
    for (auto& v : logits) v = normal(rng);
    for (auto& v : bias) v = 0.02f * normal(rng);
    for (int64_t t = 0; t < 5; ++t)  // exact ties
      for (int e = 0; e < c.E; ++e) logits[t * c.E + e] = 0.25f;
    const std::vector<float> zero_bias(c.E, 0.0f);
    RoutingParams rp{c.E, c.k, c.renorm, c.scale, c.n_group, c.topk_group};
    for (int tie_case = 0; tie_case < 2; ++tie_case) {
      const std::vector<float>& b = tie_case ? zero_bias : bias;
      std::vector<int32_t> want_ids(T * c.k);
      std::vector<float> want_w(T * c.k);
      ASSERT_TRUE(cpu_.SelectExperts(ConstMatrixView(logits.data(), T, c.E, c.E), b.data(), rp,
                                     want_ids.data(), want_w.data())
                      .ok());
      DeviceArray<float> dl(gpu_.get(), logits), db(gpu_.get(), b), dw(gpu_.get(), Poison(T * c.k));
      DeviceArray<int32_t> di(gpu_.get(), std::vector<int32_t>(T * c.k, -7));
      ASSERT_TRUE(
          gpu_->SelectExperts(dl.View(T, c.E, c.E), db.data(), rp, di.data(), dw.data()).ok());
      const auto ids = di.ToHost();
      const auto w = dw.ToHost();
      for (int64_t i = 0; i < T * c.k; ++i) {
        ASSERT_EQ(ids[i], want_ids[i]) << "E=" << c.E << " k=" << c.k << " slot " << i;
        ASSERT_TRUE(SameBits(w[i], want_w[i]))
            << "slot " << i << ": " << w[i] << " vs " << want_w[i];
      }
      if (tie_case) {
        for (int j = 0; j < c.k; ++j) EXPECT_EQ(ids[j], j) << "ties go to the lower index";
      }
    }
  }
}

// Random grouped assignments: each of M rows picks up to `k` distinct experts of E (some rows
// none), grouped by expert with rows ascending, as GroupByExpert builds them.
ExpertAssignments RandomAssignments(int64_t M, int E, int k, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<std::pair<int32_t, float>>> per_expert(E);
  std::uniform_real_distribution<float> gate(0.05f, 1.5f);
  std::uniform_int_distribution<int> count(0, k);
  std::vector<int> experts(E);
  std::iota(experts.begin(), experts.end(), 0);
  for (int64_t r = 0; r < M; ++r) {
    std::shuffle(experts.begin(), experts.end(), rng);
    const int n = (M == 1 || r % 7 != 3) ? std::max(1, count(rng)) : 0;  // some rows unused
    for (int j = 0; j < n; ++j)
      per_expert[experts[j]].push_back({static_cast<int32_t>(r), gate(rng)});
  }
  ExpertAssignments asg;
  asg.offsets.push_back(0);
  for (int e = 0; e < E; ++e) {
    for (auto& [r, g] : per_expert[e]) {
      asg.rows.push_back(r);
      asg.gates.push_back(g);
    }
    asg.offsets.push_back(static_cast<int32_t>(asg.rows.size()));
  }
  return asg;
}

struct ExpertCase {
  WeightFormat format;
  int64_t in, hidden;
};

TEST_F(CudaBackendTest, ExpertMlpMatchesCpuAndIsDeterministic) {
  const ExpertCase cases[] = {{WeightFormat::kBF16, 96, 64},
                              {WeightFormat::kMXFP4, 320, 256},
                              {WeightFormat::kFP8Block128, 96, 64},
                              {WeightFormat::kFP8Block128, 200, 136},
                              {WeightFormat::kBF16, 100, 72}};
  const int E = 5;
  for (const ExpertCase& c : cases) {
    std::vector<std::unique_ptr<RandomWeight>> owned;
    std::vector<MlpWeights> host;
    for (int e = 0; e < E; ++e) {
      MlpWeights mw;
      owned.push_back(std::make_unique<RandomWeight>(c.format, c.hidden, c.in, 100 + e));
      mw.gate = owned.back()->view;
      owned.push_back(std::make_unique<RandomWeight>(c.format, c.hidden, c.in, 200 + e));
      mw.up = owned.back()->view;
      owned.push_back(std::make_unique<RandomWeight>(c.format, c.in, c.hidden, 300 + e));
      mw.down = owned.back()->view;
      host.push_back(mw);
    }
    for (auto& [variant, backend] : Variants()) {
      std::vector<MlpWeights> dev;
      for (const MlpWeights& h : host) {
        MlpWeights d;
        d.gate = *backend->PrepareWeight(h.gate);
        d.up = *backend->PrepareWeight(h.up);
        d.down = *backend->PrepareWeight(h.down);
        dev.push_back(d);
      }
      for (Activation kind : {Activation::kSiTU, Activation::kSiLU}) {
        ActivationParams act;
        act.kind = kind;
        for (Precision p : kPrecisions) {
          for (int64_t M : {1, 3, 257}) {
            const auto asg = RandomAssignments(M, E, 3, static_cast<uint32_t>(M * 31 + c.in));
            const auto x =
                RandomActivations(M, c.in, static_cast<uint32_t>(M + 17), p == Precision::kBF16);
            std::vector<double> want(M * c.in);
            ASSERT_TRUE(cpu_.ExpertMlp(ConstMatrixView(x.data(), M, c.in, c.in), asg, host, act,
                                       PartialView(want.data(), M, c.in, c.in), p)
                            .ok());
            DeviceArray<float> dx(backend, x);
            std::vector<double> nan(M * c.in, std::nan(""));
            DeviceArray<double> dy(backend, nan), dy2(backend, nan);
            ASSERT_TRUE(
                backend->ExpertMlp(dx.View(M, c.in, c.in), asg, dev, act, dy.View(M, c.in, c.in), p)
                    .ok());
            ASSERT_TRUE(
                backend
                    ->ExpertMlp(dx.View(M, c.in, c.in), asg, dev, act, dy2.View(M, c.in, c.in), p)
                    .ok());
            const auto got = dy.ToHost(), again = dy2.ToHost();
            if (p == Precision::kBF16) {  // rows in bf16 storage, as a rank receives them
              std::vector<uint16_t> bits(x.size());
              for (size_t i = 0; i < x.size(); ++i) bits[i] = FloatToBf16Bits(x[i]);
              DeviceArray<uint16_t> dbits(backend, bits);
              DeviceArray<double> dy3(backend, nan);
              ASSERT_TRUE(
                  backend
                      ->ExpertMlp(ActivationView(dbits.data(), Precision::kBF16, M, c.in, c.in),
                                  asg, dev, act, dy3.View(M, c.in, c.in), p)
                      .ok());
              const auto from_bf16 = dy3.ToHost();
              for (size_t i = 0; i < got.size(); ++i)
                ASSERT_TRUE(SameBits(from_bf16[i], got[i])) << "bf16 rows differ at " << i;
            }
            const std::string where = std::string(WeightFormatName(c.format)) + " " + variant +
                                      " " + Name(p) + " M=" + std::to_string(M) +
                                      (kind == Activation::kSiTU ? " situ" : " silu");
            int64_t same = 0;
            for (size_t i = 0; i < got.size(); ++i) {
              ASSERT_FALSE(std::isnan(got[i])) << where << " element " << i << " not written";
              ASSERT_TRUE(SameBits(got[i], again[i])) << where << " not deterministic at " << i;
              same += SameBits(got[i], want[i]);
            }
            const double err = RelL2(got, want);
            if (p == Precision::kBF16) {
              EXPECT_LE(err, 4e-3) << where;
              EXPECT_GE(same, 0.8 * got.size()) << where;
            } else {
              EXPECT_LE(err, 1e-5) << where;
            }
          }
        }
      }
    }
  }
}

TEST_F(CudaBackendTest, ExpertMlpWithoutAssignmentsZeroesTheOutput) {
  RandomWeight g(WeightFormat::kBF16, 16, 32, 1), u(WeightFormat::kBF16, 16, 32, 2),
      d(WeightFormat::kBF16, 32, 16, 3);
  MlpWeights w{*gpu_->PrepareWeight(g.view), *gpu_->PrepareWeight(u.view),
               *gpu_->PrepareWeight(d.view)};
  std::vector<MlpWeights> experts = {w, w};
  ExpertAssignments asg;
  asg.offsets = {0, 0, 0};
  DeviceArray<float> dx(gpu_.get(), std::vector<float>(4 * 32, 1.0f));
  DeviceArray<double> dy(gpu_.get(), std::vector<double>(4 * 32, 5.0));
  ASSERT_TRUE(gpu_->ExpertMlp(dx.View(4, 32, 32), asg, experts, ActivationParams{},
                              dy.View(4, 32, 32), Precision::kBF16)
                  .ok());
  for (double v : dy.ToHost()) ASSERT_EQ(v, 0.0);
}

}  // namespace
}  // namespace moe

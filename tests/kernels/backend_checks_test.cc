// Backend's argument checks run before any backend's implementation (NVI, kernels/backend.h):
// a recording backend shows that a bad call never reaches Do<Op>, and that a good one does;
// the CPU backend gives the same errors. The CUDA backend gets them from the same code.
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"

namespace moe {
namespace {

// Counts the implementation calls that got through the checks.
class RecordingBackend final : public Backend {
 public:
  int calls = 0;
  std::string name() const override { return "recording"; }
  MemorySpace space() const override { return MemorySpace::kHost; }
  absl::StatusOr<std::unique_ptr<DeviceBuffer>> Allocate(size_t) override {
    return absl::UnimplementedError("");
  }
  absl::Status CopyToBackend(void*, const void*, size_t) override { return absl::OkStatus(); }
  absl::Status CopyToHost(void*, const void*, size_t) override { return absl::OkStatus(); }
  absl::Status Synchronize() override { return absl::OkStatus(); }

 private:
  absl::StatusOr<WeightMatrix> DoPrepareWeight(const WeightMatrix& w) override {
    ++calls;
    return w;
  }
  absl::StatusOr<WeightVector> DoPrepareVector(const WeightVector& v) override {
    ++calls;
    return v;
  }
  absl::Status Called() {
    ++calls;
    return absl::OkStatus();
  }
  absl::Status DoLinear(ConstMatrixView, const WeightMatrix&, MatrixView, Precision) override {
    return Called();
  }
  absl::Status DoSelectExperts(ConstMatrixView, const float*, const RoutingParams&, int32_t*,
                               float*) override {
    return Called();
  }
  absl::Status DoGluActivation(ConstMatrixView, ConstMatrixView, const ActivationParams&,
                               MatrixView, Precision) override {
    return Called();
  }
  absl::Status DoExpertMlp(ActivationView, const ExpertAssignments&, absl::Span<const MlpWeights>,
                           const ActivationParams&, PartialView, Precision) override {
    return Called();
  }
  absl::Status DoRmsNorm(ConstMatrixView, const WeightVector&, float, MatrixView,
                         Precision) override {
    return Called();
  }
  absl::Status DoAdd(ConstMatrixView, ConstMatrixView, MatrixView, Precision) override {
    return Called();
  }
  absl::Status DoRound(MatrixView, Precision) override { return Called(); }
  absl::Status DoRoundPartials(ConstPartialView, MatrixView, Precision) override {
    return Called();
  }
  absl::Status DoGatherRows(ConstMatrixView, absl::Span<const int32_t>,
                            MutableActivationView) override {
    return Called();
  }
  absl::Status DoScatterAddRows(ConstPartialView, absl::Span<const int32_t>, PartialView) override {
    return Called();
  }
  absl::Status DoZero(PartialView) override { return Called(); }
};

void ExpectRejected(const absl::Status& s, const std::string& text) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(text), absl::string_view::npos) << s;
}

// Every op, once with bad arguments and once with good ones, on `backend`; `calls` (when not
// null) counts the implementation calls and must see only the good ones.
void CheckEveryOp(Backend& backend, const int* calls) {
  std::vector<float> a(4 * 8, 0.5f), b(4 * 8, 0.25f), c(4 * 8), logits(3 * 8, 0.1f);
  std::vector<double> partial(4 * 8, 1.0), sums(5 * 8, 0.0);
  std::vector<uint16_t> w_bits(6 * 8, 0x3f80), norm(8, 0x3f80);  // bf16 ones
  const MatrixView x(a.data(), 4, 8, 8), y(c.data(), 4, 8, 8);
  const ConstMatrixView other(b.data(), 4, 8, 8);
  WeightMatrix w;
  w.rows = 6;
  w.cols = 8;
  w.data = w_bits.data();
  std::vector<float> linear_out(4 * 6);
  const int before = calls ? *calls : 0;
  int good = 0;

  ExpectRejected(backend.Linear(x, w, MatrixView(linear_out.data(), 4, 5, 5), Precision::kFP32),
                 "Linear: output [4, 5] != [4, 6]");
  ExpectRejected(backend.Linear(MatrixView(a.data(), 4, 8, 3), w,
                                MatrixView(linear_out.data(), 4, 6, 6), Precision::kFP32),
                 "Linear: x has stride 3 < cols 8");
  EXPECT_TRUE(backend.Linear(x, w, MatrixView(linear_out.data(), 4, 6, 6), Precision::kFP32).ok());
  ++good;

  // The check the CUDA backend had lost: group-limited routing that cannot fill top_k.
  RoutingParams routing{8, 5, true, 1.0f, 4, 2};  // 2 kept groups of 2 experts: 4 < top_k 5
  std::vector<int32_t> ids(3 * 5);
  std::vector<float> weights(3 * 5);
  ExpectRejected(backend.SelectExperts(MatrixView(logits.data(), 3, 8, 8), nullptr, routing,
                                       ids.data(), weights.data()),
                 "SelectExperts: top_k 5 exceeds the experts of the 2 kept groups");
  routing.top_k = 9;
  ExpectRejected(backend.SelectExperts(MatrixView(logits.data(), 3, 8, 8), nullptr, routing,
                                       ids.data(), weights.data()),
                 "top_k 9 outside [1, 8]");
  routing.top_k = 4;
  EXPECT_TRUE(backend
                  .SelectExperts(MatrixView(logits.data(), 3, 8, 8), nullptr, routing, ids.data(),
                                 weights.data())
                  .ok());
  ++good;

  ExpectRejected(backend.GluActivation(x, MatrixView(b.data(), 4, 7, 8), ActivationParams{}, y,
                                       Precision::kBF16),
                 "GluActivation: shape [4, 8] vs [4, 7]");
  ExpectRejected(backend.RmsNorm(x, WeightVector{norm.data(), 7, MemorySpace::kHost}, 1e-6f, y,
                                 Precision::kBF16),
                 "RmsNorm: weight size 7 != 8");
  EXPECT_TRUE(
      backend
          .RmsNorm(x, WeightVector{norm.data(), 8, MemorySpace::kHost}, 1e-6f, y, Precision::kBF16)
          .ok());
  ++good;
  ExpectRejected(backend.Add(x, ConstMatrixView(b.data(), 3, 8, 8), y, Precision::kBF16),
                 "Add: shape [4, 8] vs [3, 8]");
  EXPECT_TRUE(backend.Add(x, other, y, Precision::kBF16).ok());
  ++good;
  ExpectRejected(backend.RoundPartials(ConstPartialView(partial.data(), 4, 8, 8),
                                       MatrixView(c.data(), 4, 7, 7), Precision::kBF16),
                 "RoundPartials: shape");
  ExpectRejected(backend.Round(MatrixView(nullptr, 2, 2, 2), Precision::kBF16),
                 "Round: y has no data");

  const std::vector<int32_t> bad_rows = {0, 4}, rows = {3, 0};
  ExpectRejected(backend.GatherRows(x, bad_rows, MatrixView(c.data(), 2, 8, 8)),
                 "GatherRows: row 4 out of range");
  EXPECT_TRUE(backend.GatherRows(x, rows, MatrixView(c.data(), 2, 8, 8)).ok());
  ++good;
  ExpectRejected(
      backend.ScatterAddRows(ConstPartialView(partial.data(), 2, 8, 8), std::vector<int32_t>{0, 5},
                             PartialView(sums.data(), 5, 8, 8)),
      "ScatterAddRows: row 5 out of range");
  ExpectRejected(backend.ScatterAddRows(ConstPartialView(partial.data(), 2, 8, 8),
                                        std::vector<int32_t>{1}, PartialView(sums.data(), 5, 8, 8)),
                 "ScatterAddRows: partial shape does not match the row list");

  // ExpertMlp: one expert whose weights do not fit the input width, malformed CSR.
  WeightMatrix gate = w, down = w;
  down.rows = 8;
  down.cols = 6;
  std::vector<MlpWeights> experts = {{gate, gate, down}};
  ExpertAssignments assignments;
  assignments.offsets = {0, 2};
  assignments.rows = {0, 7};
  assignments.gates = {0.5f, 0.5f};
  ExpectRejected(backend.ExpertMlp(x, assignments, experts, ActivationParams{},
                                   PartialView(partial.data(), 4, 8, 8), Precision::kBF16),
                 "ExpertMlp: assignment row 7 out of range");
  assignments.rows = {0, 2};
  assignments.gates = {0.5f};
  ExpectRejected(backend.ExpertMlp(x, assignments, experts, ActivationParams{},
                                   PartialView(partial.data(), 4, 8, 8), Precision::kBF16),
                 "ExpertMlp: malformed assignments");
  experts[0].down.rows = 7;
  assignments.gates = {0.5f, 0.5f};
  ExpectRejected(backend.ExpertMlp(x, assignments, experts, ActivationParams{},
                                   PartialView(partial.data(), 4, 8, 8), Precision::kBF16),
                 "ExpertMlp: expert 0 shapes do not match input width 8");
  experts[0].down.rows = 8;
  // An fp32 step's rows are not bf16 values: bf16 storage would have rounded them.
  const std::vector<uint16_t> bf16_rows(4 * 8, 0x3f80);
  ExpectRejected(backend.ExpertMlp(ActivationView(bf16_rows.data(), Precision::kBF16, 4, 8, 8),
                                   assignments, experts, ActivationParams{},
                                   PartialView(partial.data(), 4, 8, 8), Precision::kFP32),
                 "ExpertMlp: bf16 rows in an fp32 step");
  EXPECT_TRUE(backend
                  .ExpertMlp(ActivationView(bf16_rows.data(), Precision::kBF16, 4, 8, 8),
                             assignments, experts, ActivationParams{},
                             PartialView(partial.data(), 4, 8, 8), Precision::kBF16)
                  .ok());
  ++good;
  EXPECT_TRUE(backend
                  .ExpertMlp(x, assignments, experts, ActivationParams{},
                             PartialView(partial.data(), 4, 8, 8), Precision::kBF16)
                  .ok());
  ++good;
  if (calls != nullptr) {
    EXPECT_EQ(*calls - before, good) << "only the good calls got through";
  }
}

TEST(BackendChecksTest, BadArgumentsNeverReachTheImplementation) {
  RecordingBackend backend;
  CheckEveryOp(backend, &backend.calls);
}

// Weights are checked once, in front of every backend: MXFP4 scales outside [2, 252] and empty
// vectors never reach an implementation.
TEST(BackendChecksTest, PreparedWeightsAreCheckedForEveryBackend) {
  RecordingBackend backend;
  std::vector<uint8_t> nibbles(2 * 16, 0x21), scales(2, 127);
  WeightMatrix w{WeightFormat::kMXFP4, 2, 32, nibbles.data(), scales.data(), MemorySpace::kHost};
  ASSERT_TRUE(backend.PrepareWeight(w).ok());
  EXPECT_EQ(backend.calls, 1);
  for (uint8_t bad : {uint8_t{0}, uint8_t{1}, uint8_t{253}, uint8_t{255}}) {
    scales[1] = bad;
    const absl::StatusOr<WeightMatrix> refused = backend.PrepareWeight(w);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << int{bad};
    EXPECT_NE(refused.status().message().find("supported: [2, 252]"), std::string::npos);
  }
  w.cols = 31;  // MXFP4 needs whole blocks of 32
  EXPECT_FALSE(backend.PrepareWeight(w).ok());
  EXPECT_EQ(backend.PrepareVector(WeightVector{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend.calls, 1);
  CpuBackend cpu(CpuBackendOptions{1, ""});  // the same refusals from a real backend
  EXPECT_EQ(cpu.PrepareWeight(w).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(BackendChecksTest, TheCpuBackendGivesTheSameErrors) {
  CpuBackend backend(CpuBackendOptions{1, ""});
  CheckEveryOp(backend, nullptr);
}

}  // namespace
}  // namespace moe

// The step wire format a rank decodes (transport/step_codec.h).
#include "transport/step_codec.h"

#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace moe {
namespace {

using moe::v1::internal::StepRequest;

StepRequest Step(int32_t rows, int32_t width, bool bf16) {
  std::vector<float> values(static_cast<size_t>(rows) * width);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.25f * static_cast<float>(i % 11) - 1;
  StepRequest step;
  step.set_step_id(7);
  step.set_layer(2);
  step.set_num_rows(rows);
  step.set_width(width);
  step.set_precision(bf16 ? moe::v1::internal::PRECISION_BF16 : moe::v1::internal::PRECISION_FP32);
  const ActivationRows host = ActivationRows::FromFloats(bf16 ? Precision::kBF16 : Precision::kFP32,
                                                         values.data(), rows, width);
  EncodeRows(ActivationView(host), step.mutable_rows());
  for (int32_t r = 0; r <= rows; ++r) step.add_row_offsets(r);
  for (int32_t r = 0; r < rows; ++r) {
    step.add_local_experts(r % 3);
    step.add_gates(0.5f);
  }
  return step;
}

TEST(StepCodecTest, DecodesRowsAndAssignments) {
  for (bool bf16 : {true, false}) {
    ActivationRows host;
    ReceivedStep out;
    ASSERT_TRUE(DecodeStepRequest(Step(3, 5, bf16), &host, &out).ok());
    EXPECT_EQ(out.step_id, 7u);
    EXPECT_EQ(out.layer, 2);
    EXPECT_EQ(out.precision, bf16 ? Precision::kBF16 : Precision::kFP32);
    ASSERT_EQ(out.rows.rows, 3);
    ASSERT_EQ(out.rows.cols, 5);
    // The rows stay in the wire's dtype (bf16 bits in a bf16 step: no fp32 copy).
    EXPECT_EQ(out.rows.data, host.data());
    EXPECT_EQ(out.rows.dtype, out.precision);
    EXPECT_EQ(host.precision(), out.precision);
    EXPECT_EQ(host.Value(2 * 5 + 4), 0.25f * (14 % 11) - 1);  // exact in bf16 too
    const float last = bf16 ? Bf16BitsToFloat(out.rows.Bf16Row(2)[4]) : out.rows.Fp32Row(2)[4];
    EXPECT_EQ(last, 0.25f * (14 % 11) - 1);
    EXPECT_EQ(out.assignments.offsets, (std::vector<int32_t>{0, 1, 2, 3}));
    EXPECT_EQ(out.assignments.local_experts, (std::vector<int32_t>{0, 1, 2}));
  }
}

// Rows are encoded as stored, dense: a strided view's padding is not sent.
TEST(StepCodecTest, EncodesStridedRowsDenseAsStored) {
  const std::vector<uint16_t> bf16 = {0x3f80, 0x4000, 0xdead, 0xc040, 0x3e80, 0xbeef};
  std::string wire;
  EncodeRows(ActivationView(bf16.data(), Precision::kBF16, 2, 2, 3), &wire);
  const std::vector<uint16_t> dense = {0x3f80, 0x4000, 0xc040, 0x3e80};
  ASSERT_EQ(wire.size(), dense.size() * 2);
  EXPECT_EQ(std::memcmp(wire.data(), dense.data(), wire.size()), 0);
  const std::vector<float> fp32 = {1.5f, -2.0f, 99.0f, 0.125f, 3.0f, 77.0f};
  EncodeRows(ActivationView(fp32.data(), Precision::kFP32, 2, 2, 3), &wire);
  const std::vector<float> dense32 = {1.5f, -2.0f, 0.125f, 3.0f};
  ASSERT_EQ(wire.size(), dense32.size() * 4);
  EXPECT_EQ(std::memcmp(wire.data(), dense32.data(), wire.size()), 0);
}

TEST(StepCodecTest, BadShapeOrByteCountIsRefused) {
  ActivationRows host;
  ReceivedStep out;
  StepRequest step = Step(2, 4, true);
  step.mutable_rows()->pop_back();
  EXPECT_EQ(DecodeStepRequest(step, &host, &out).message(), "step rows: 15 bytes for [2, 4]");
  step = Step(2, 4, true);
  step.set_width(0);
  EXPECT_EQ(DecodeStepRequest(step, &host, &out).message(), "bad step shape");
}

// Found by tests/fuzz (step target): the rows buffer was sized from the shape before the bytes
// were counted, so a message of a few bytes could ask for 2^62 floats.
TEST(StepCodecTest, HugeShapeIsRefusedBeforeAllocating) {
  StepRequest step = Step(1, 4, true);
  step.set_num_rows(2147483647);
  step.set_width(2147483647);
  ActivationRows host;
  ReceivedStep out;
  const absl::Status s = DecodeStepRequest(step, &host, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "step rows: 8 bytes for [2147483647, 2147483647]");
  EXPECT_TRUE(host.empty());
}

}  // namespace
}  // namespace moe

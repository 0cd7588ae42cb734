// transport/step_codec.cc: what a rank decodes from a gateway's step message, and the grouping
// of the rows' experts that ExpertShard::Compute does next.
#include <cstdint>
#include <vector>

#include "model/dispatch.h"
#include "moe/v1/internal.pb.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/quiet_protobuf.h"
#include "transport/step_codec.h"

namespace {
constexpr int kLocalExperts = 8;  // a rank's shard of one layer
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const QuietProtobuf quiet;
  moe::v1::internal::GatewayToRank message;
  if (!message.ParseFromArray(data, static_cast<int>(size)) || !message.has_step()) return 0;
  moe::ActivationRows host_rows;
  moe::ReceivedStep step;
  const absl::Status decoded = moe::DecodeStepRequest(message.step(), &host_rows, &step);
  if (!decoded.ok()) {
    FUZZ_CHECK_CODE(decoded, absl::StatusCode::kInvalidArgument);
    return 0;
  }
  FUZZ_CHECK(step.rows.rows >= 0 && step.rows.cols > 0);
  FUZZ_CHECK(host_rows.rows() == step.rows.rows && host_rows.cols() == step.rows.cols);
  FUZZ_CHECK(host_rows.precision() == step.precision && step.rows.dtype == step.precision);
  // As ExpertShard::Compute: one assignment per row, then the experts' CSR.
  if (step.assignments.num_rows() != step.rows.rows) return 0;
  const absl::StatusOr<moe::ExpertAssignments> grouped =
      moe::GroupByExpert(step.assignments, kLocalExperts);
  if (!grouped.ok()) {
    FUZZ_CHECK_CODE(grouped.status(), absl::StatusCode::kInvalidArgument);
    return 0;
  }
  FUZZ_CHECK(grouped->offsets.size() == kLocalExperts + 1);
  FUZZ_CHECK(grouped->offsets.back() ==
             static_cast<int64_t>(step.assignments.local_experts.size()));
  for (int32_t row : grouped->rows) FUZZ_CHECK(row >= 0 && row < step.rows.rows);
  return 0;
}

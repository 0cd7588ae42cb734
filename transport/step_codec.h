// The gRPC transport's step wire format (moe.v1.internal.StepRequest), apart from the streams
// so that a rank's decoding of what it is sent can be tested and fuzzed without one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "moe/v1/internal.pb.h"
#include "transport/transport.h"

namespace moe {

// Encodes a backend's rows for the wire: bf16 or fp32, little-endian.
void EncodeRows(ConstMatrixView rows, Precision p, std::string* out);

// Decodes `step` into `out` (all but wire_bytes); its rows land in `host_rows` in the wire's
// dtype (copied, not converted), which `out.rows` then views. InvalidArgument for a bad shape or
// a byte count that does not match it.
absl::Status DecodeStepRequest(const moe::v1::internal::StepRequest& step,
                               ActivationRows* host_rows, ReceivedStep* out);

}  // namespace moe

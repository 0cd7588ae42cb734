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

// Host rows for the wire, as they are stored (bf16 bits or fp32), dense and little-endian.
void EncodeRows(ActivationView rows, std::string* out);

// Decodes `step` into `out` (all but wire_bytes); its rows land in `host_rows` in the wire's
// dtype (copied, not converted), which `out.rows` then views. InvalidArgument for a bad shape or
// a byte count that does not match it.
absl::Status DecodeStepRequest(const moe::v1::internal::StepRequest& step,
                               ActivationRows* host_rows, ReceivedStep* out);

}  // namespace moe

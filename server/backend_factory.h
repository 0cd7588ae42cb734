// Picks the compute backend of a service process from its flags: "cpu" always, "cuda" when
// the build has the CUDA backend (kernels/cuda) and the machine a device.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"

namespace moe {

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const std::string& kind, int device,
                                                       const CpuBackendOptions& cpu);
// Whether this build can run `kind` ("cpu", "cuda") and `transport` ("grpc", "nccl").
bool BackendBuilt(const std::string& kind);
bool TransportBuilt(const std::string& transport);

}  // namespace moe

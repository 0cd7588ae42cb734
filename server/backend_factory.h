// The compute backend and the step transport of a service process, as named values: "cpu"
// always, "cuda" when the build has the CUDA backend (kernels/cuda) and the machine a device;
// transport "grpc" always, "nccl" with the CUDA plugin. Their names are also the wire's
// (RegisterRequest.backend and .transports, RegisterResponse.transport).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"

namespace moe {

enum class BackendKind { kCpu, kCuda };
enum class TransportKind { kGrpc, kNccl };

const char* BackendName(BackendKind kind);
const char* TransportName(TransportKind kind);
// For Flags::Choice: --backend, --transport.
std::vector<std::pair<std::string, BackendKind>> BackendChoices();
std::vector<std::pair<std::string, TransportKind>> TransportChoices();
// A transport named on the wire; UNIMPLEMENTED for a name this build does not know.
absl::StatusOr<TransportKind> ParseTransport(absl::string_view name);

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(BackendKind kind, int device,
                                                       const CpuBackendOptions& cpu);
// Whether this build can run `transport`.
bool TransportBuilt(TransportKind transport);

}  // namespace moe

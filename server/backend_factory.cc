#include "server/backend_factory.h"

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "transport/cuda_plugin.h"

namespace moe {

bool BackendBuilt(const std::string& kind) {
  return kind == "cpu" || (kind == "cuda" && LoadCudaPlugin().ok());
}

bool TransportBuilt(const std::string& transport) {
  return transport == "grpc" || (transport == "nccl" && LoadCudaPlugin().ok());
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const std::string& kind, int device,
                                                       const CpuBackendOptions& cpu) {
  if (kind == "cpu") {
    ASSIGN_OR_RETURN(std::unique_ptr<CpuBackend> backend, CpuBackend::Create(cpu));
    return std::unique_ptr<Backend>(std::move(backend));
  }
  if (kind == "cuda") {
    ASSIGN_OR_RETURN(const CudaPluginApi* plugin, LoadCudaPlugin());
    return plugin->create_backend(device);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown backend '", kind, "' (cpu, cuda)"));
}

}  // namespace moe

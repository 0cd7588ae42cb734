#include "server/backend_factory.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "transport/cuda_plugin.h"

namespace moe {

const char* BackendName(BackendKind kind) { return kind == BackendKind::kCpu ? "cpu" : "cuda"; }

const char* TransportName(TransportKind kind) {
  return kind == TransportKind::kGrpc ? "grpc" : "nccl";
}

std::vector<std::pair<std::string, BackendKind>> BackendChoices() {
  return {{"cpu", BackendKind::kCpu}, {"cuda", BackendKind::kCuda}};
}

std::vector<std::pair<std::string, TransportKind>> TransportChoices() {
  return {{"grpc", TransportKind::kGrpc}, {"nccl", TransportKind::kNccl}};
}

absl::StatusOr<TransportKind> ParseTransport(absl::string_view name) {
  for (const auto& [choice, kind] : TransportChoices())
    if (name == choice) return kind;
  return absl::UnimplementedError(
      absl::StrCat("unknown transport '", absl::CEscape(name.substr(0, 32)), "'"));
}

bool TransportBuilt(TransportKind transport) {
  return transport == TransportKind::kGrpc || LoadCudaPlugin().ok();
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(BackendKind kind, int device,
                                                       const CpuBackendOptions& cpu) {
  if (kind == BackendKind::kCpu) {
    ASSIGN_OR_RETURN(std::unique_ptr<CpuBackend> backend, CpuBackend::Create(cpu));
    return std::unique_ptr<Backend>(std::move(backend));
  }
  ASSIGN_OR_RETURN(const CudaPluginApi* plugin, LoadCudaPlugin());
  return plugin->create_backend(device);
}

}  // namespace moe

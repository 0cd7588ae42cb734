#include "server/backend_factory.h"

#include "absl/strings/str_cat.h"

#if defined(MOE_HAVE_CUDA)
#include "kernels/cuda/cuda_backend.h"
#endif

namespace moe {

bool BackendBuilt(const std::string& kind) {
#if defined(MOE_HAVE_CUDA)
  if (kind == "cuda") return true;
#endif
  return kind == "cpu";
}

bool TransportBuilt(const std::string& transport) {
#if defined(MOE_HAVE_NCCL_TRANSPORT)
  if (transport == "nccl") return true;
#endif
  return transport == "grpc";
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const std::string& kind, int device,
                                                       const CpuBackendOptions& cpu) {
  if (kind == "cpu") return std::unique_ptr<Backend>(std::make_unique<CpuBackend>(cpu));
  if (kind == "cuda") {
#if defined(MOE_HAVE_CUDA)
    return CreateCudaBackend(device);
#else
    return absl::UnimplementedError("this build has no CUDA backend (configure with the CUDA toolkit present)");
#endif
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown backend '", kind, "' (cpu, cuda)"));
}

}  // namespace moe

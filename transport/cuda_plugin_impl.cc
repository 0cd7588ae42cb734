// libmoe_cuda_plugin.so: the CudaPluginApi table of transport/cuda_plugin.h.
#include "transport/cuda_plugin.h"

#include "core/status.h"
#include "kernels/cuda/cuda_backend.h"
#include "transport/nccl_transport.h"

namespace moe {
namespace {

absl::StatusOr<std::unique_ptr<Backend>> CreateBackendImpl(int device) {
  return CreateCudaBackend(device);
}

absl::StatusOr<std::unique_ptr<GatewayTransport>> CreateGatewayImpl(const NcclGatewaySetup& setup) {
  NcclGatewayOptions options;
  options.num_ranks = setup.num_ranks;
  options.unique_id = setup.unique_id;
  options.backend = static_cast<CudaBackend*>(setup.backend);
  options.init_timeout = setup.init_timeout;
  ASSIGN_OR_RETURN(auto transport, NcclGatewayTransport::Create(options));
  return std::unique_ptr<GatewayTransport>(std::move(transport));
}

absl::StatusOr<NcclRankSession> CreateRankImpl(const NcclRankSetup& setup) {
  NcclRankOptions options;
  options.rank = setup.rank;
  options.num_ranks = setup.num_ranks;
  options.unique_id = setup.unique_id;
  options.backend = static_cast<CudaBackend*>(setup.backend);
  ASSIGN_OR_RETURN(std::unique_ptr<NcclRankTransport> transport,
                   NcclRankTransport::Create(options));
  NcclRankTransport* raw = transport.get();
  NcclRankSession session;
  session.cancel = [raw] { raw->Cancel(); };
  session.transport = std::move(transport);
  return session;
}

const CudaPluginApi kApi = {kCudaPluginAbi, &CreateBackendImpl, &NewNcclUniqueId,
                            &CreateGatewayImpl, &CreateRankImpl};

}  // namespace
}  // namespace moe

extern "C" __attribute__((visibility("default"))) const moe::CudaPluginApi* moe_cuda_plugin_api() {
  return &moe::kApi;
}

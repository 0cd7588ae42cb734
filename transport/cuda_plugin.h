// The CUDA backend and the NCCL transport as a loadable plugin (libmoe_cuda_plugin.so).
//
// NOTES: linking cuBLAS and NCCL into the service binaries puts their thread-local storage
// (~120 KB, cuBLASLt alone 94 KB) into every thread's static TLS block, and threads with small
// stacks (civetweb's, under the Prometheus exposer) then fail to start. Loaded with dlopen only
// when --backend cuda asks for it, their TLS is dynamic and CPU-only processes never map them.
// The plugin is built from the same tree with the same toolchain, so the table below passes
// C++ types across the boundary.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "transport/transport.h"

namespace moe {

struct NcclGatewaySetup {
  int num_ranks = 0;
  std::string unique_id;
  Backend* backend = nullptr;  // a backend the plugin created
  absl::Duration init_timeout = absl::Minutes(30);
};

struct NcclRankSetup {
  int rank = 0;
  int num_ranks = 0;
  std::string unique_id;
  Backend* backend = nullptr;
};

struct NcclRankSession {
  std::unique_ptr<RankTransport> transport;
  std::function<void()> cancel;  // from any thread: unblocks Receive
};

constexpr int kCudaPluginAbi = 1;

struct CudaPluginApi {
  int abi = kCudaPluginAbi;
  absl::StatusOr<std::unique_ptr<Backend>> (*create_backend)(int device);
  absl::StatusOr<std::string> (*new_nccl_unique_id)();
  absl::StatusOr<std::unique_ptr<GatewayTransport>> (*create_nccl_gateway)(
      const NcclGatewaySetup& setup);
  absl::StatusOr<NcclRankSession> (*create_nccl_rank)(const NcclRankSetup& setup);
};

// Symbol the plugin exports.
extern "C" const CudaPluginApi* moe_cuda_plugin_api();

// Loads the plugin once: $MOE_CUDA_PLUGIN, else libmoe_cuda_plugin.so next to the executable or
// in ../lib. UNAVAILABLE with the reason when it is not there or does not load.
absl::StatusOr<const CudaPluginApi*> LoadCudaPlugin();

}  // namespace moe

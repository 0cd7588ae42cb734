#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "transport/cuda_plugin.h"

namespace moe {
namespace {

std::string ExecutableDir() {
  char path[4096];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return ".";
  path[n] = '\0';
  std::string dir(path);
  return dir.substr(0, dir.rfind('/'));
}

absl::StatusOr<const CudaPluginApi*> Load() {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("MOE_CUDA_PLUGIN"); env != nullptr && *env)
    candidates.push_back(env);
  const std::string dir = ExecutableDir();
  candidates.push_back(dir + "/libmoe_cuda_plugin.so");
  candidates.push_back(dir + "/../lib/libmoe_cuda_plugin.so");
  std::vector<std::string> errors;
  for (const std::string& path : candidates) {
    if (access(path.c_str(), R_OK) != 0) continue;
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      errors.push_back(dlerror());
      continue;
    }
    using ApiFn = const CudaPluginApi* (*)();
    auto api_fn = reinterpret_cast<ApiFn>(dlsym(handle, "moe_cuda_plugin_api"));
    if (api_fn == nullptr) {
      errors.push_back(absl::StrCat(path, ": no moe_cuda_plugin_api"));
      continue;
    }
    const CudaPluginApi* api = api_fn();
    if (api == nullptr || api->abi != kCudaPluginAbi) {
      errors.push_back(absl::StrCat(path, ": plugin ABI mismatch"));
      continue;
    }
    return api;  // the handle stays open for the process's lifetime
  }
  return absl::UnavailableError(
      absl::StrCat("the CUDA backend plugin (libmoe_cuda_plugin.so) is not available: ",
                   errors.empty() ? absl::StrCat("not found next to ", dir, " or in ", dir,
                                                 "/../lib (build with the CUDA toolkit, or "
                                                 "set MOE_CUDA_PLUGIN)")
                                  : absl::StrJoin(errors, "; ")));
}

}  // namespace

absl::StatusOr<const CudaPluginApi*> LoadCudaPlugin() {
  static std::once_flag once;
  static absl::StatusOr<const CudaPluginApi*>* loaded = nullptr;
  std::call_once(once, [] { loaded = new absl::StatusOr<const CudaPluginApi*>(Load()); });
  return *loaded;
}

}  // namespace moe

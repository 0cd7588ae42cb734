#include "server/metrics/exposer.h"

#include <exception>

#include "absl/strings/str_cat.h"

namespace moe {

absl::StatusOr<std::unique_ptr<prometheus::Exposer>> ServeRegistry(
    const std::shared_ptr<prometheus::Registry>& registry, const std::string& address, int threads,
    int* port) {
  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    exposer = std::make_unique<prometheus::Exposer>(address, threads);
  } catch (const std::exception& e) {  // civetweb reports bind failures by throwing
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", e.what()));
  }
  exposer->RegisterCollectable(registry);
  const auto ports = exposer->GetListeningPorts();
  *port = ports.empty() ? 0 : ports.front();
  return exposer;
}

}  // namespace moe

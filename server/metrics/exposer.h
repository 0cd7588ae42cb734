// Serving a prometheus-cpp registry on /metrics (one place for the exposer's exceptions).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"

namespace moe {

// Listens on `address` ("HOST:PORT", port 0 = any free one) and serves `registry`; `port`
// receives the port actually bound.
absl::StatusOr<std::unique_ptr<prometheus::Exposer>> ServeRegistry(
    const std::shared_ptr<prometheus::Registry>& registry, const std::string& address, int threads,
    int* port);

}  // namespace moe

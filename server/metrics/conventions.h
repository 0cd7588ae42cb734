// What every /metrics endpoint of the project shares: gRPC code names as label values, the
// moe_build_info labels, and the process_* family of the Prometheus client conventions
// (prometheus-cpp has no process collector).
#pragma once

#include <memory>
#include <string>

#include "prometheus/collectable.h"
#include "prometheus/labels.h"

namespace moe {

// "OK", "INVALID_ARGUMENT", "UNAVAILABLE", ... (gRPC and absl codes are the same numbers).
std::string GrpcCodeName(int code);

// {version, commit, backend, kernels}: kernels is the CPU tier in "cpu(TIER, N threads)", else
// the backend's name up to "(" (e.g. "cuda").
prometheus::Labels BuildInfoLabels(const std::string& backend);

// process_cpu_seconds_total, process_resident_memory_bytes, process_virtual_memory_bytes,
// process_open_fds, process_max_fds, process_start_time_seconds, read from /proc at scrape time.
std::shared_ptr<prometheus::Collectable> ProcessCollector();

}  // namespace moe

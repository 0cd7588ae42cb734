#include "server/metrics/conventions.h"

#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_split.h"
#include "core/version.h"
#include "prometheus/metric_family.h"

namespace moe {

std::string GrpcCodeName(int code) {
  if (code < 0 || code > 16) return std::to_string(code);
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

prometheus::Labels BuildInfoLabels(const std::string& backend) {
  std::string kernels = backend.substr(0, backend.find('('));
  if (kernels == "cpu" && backend.size() > 4) {
    const std::string inside = backend.substr(4);
    kernels = inside.substr(0, inside.find_first_of(",)"));
  }
  return {
      {"version", Version()}, {"commit", GitCommit()}, {"backend", backend}, {"kernels", kernels}};
}

namespace {

prometheus::MetricFamily Family(const std::string& name, const std::string& help,
                                prometheus::MetricType type, double value) {
  prometheus::MetricFamily family;
  family.name = name;
  family.help = help;
  family.type = type;
  prometheus::ClientMetric metric;
  if (type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  family.metric.push_back(metric);
  return family;
}

class Process final : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> out;
    // /proc/self/stat: fields after the parenthesized command name; 14 utime, 15 stime,
    // 22 starttime (clock ticks since boot), 23 vsize (bytes), 24 rss (pages).
    std::ifstream stat_file("/proc/self/stat");
    std::string stat((std::istreambuf_iterator<char>(stat_file)), std::istreambuf_iterator<char>());
    const size_t close = stat.rfind(')');
    if (close != std::string::npos) {
      std::vector<std::string> f = absl::StrSplit(stat.substr(close + 2), ' ');
      // f[0] is field 3 (state).
      auto field = [&f](size_t n) { return n - 3 < f.size() ? std::stod(f[n - 3]) : 0.0; };
      const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
      const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
      out.push_back(Family("process_cpu_seconds_total", "User and system CPU time spent, seconds",
                           prometheus::MetricType::Counter, (field(14) + field(15)) / ticks));
      out.push_back(Family("process_virtual_memory_bytes", "Virtual memory size, bytes",
                           prometheus::MetricType::Gauge, field(23)));
      out.push_back(Family("process_resident_memory_bytes", "Resident memory size, bytes",
                           prometheus::MetricType::Gauge, field(24) * page));
      if (const double boot = BootTime(); boot > 0)
        out.push_back(Family("process_start_time_seconds",
                             "Start time of the process since the Unix epoch, seconds",
                             prometheus::MetricType::Gauge, boot + field(22) / ticks));
    }
    std::error_code error;
    double fds = 0;
    for (auto it = std::filesystem::directory_iterator("/proc/self/fd", error);
         !error && it != std::filesystem::directory_iterator(); it.increment(error))
      ++fds;
    out.push_back(
        Family("process_open_fds", "Open file descriptors", prometheus::MetricType::Gauge, fds));
    rlimit limit{};
    if (getrlimit(RLIMIT_NOFILE, &limit) == 0)
      out.push_back(Family("process_max_fds", "Limit of open file descriptors",
                           prometheus::MetricType::Gauge, static_cast<double>(limit.rlim_cur)));
    return out;
  }

 private:
  static double BootTime() {
    std::ifstream in("/proc/stat");
    std::string line;
    while (std::getline(in, line))
      if (line.rfind("btime ", 0) == 0) return std::stod(line.substr(6));
    return 0;
  }
};

}  // namespace

std::shared_ptr<prometheus::Collectable> ProcessCollector() { return std::make_shared<Process>(); }

}  // namespace moe

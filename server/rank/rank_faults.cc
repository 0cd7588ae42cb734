#include "server/rank/rank_faults.h"

#include <cmath>

#include "absl/time/clock.h"

namespace moe {

void AddRankFaultFlags(Flags& flags, RankFaultFlags* faults) {
  flags.Int("debug-step-delay-ms", &faults->step_delay_ms,
            "fault injection: answer every step this many ms late (after the compute turn)");
  flags.Range("debug-step-delay-ms", 0, 3600000);
  flags.Bool("debug-nan-partials", &faults->nan_partials,
             "fault injection: answer every step with NaN partial sums");
}

void InstallRankFaults(const RankFaultFlags& faults, RankOptions* options) {
  if (faults.nan_partials)
    options->after_compute = [](PartialView partial, Backend* backend) {
      if (partial.rows == 0 || partial.cols == 0) return absl::OkStatus();
      const double nan = std::nan("");
      return backend->CopyToBackend(partial.data, &nan, sizeof nan);
    };
  if (faults.step_delay_ms > 0)
    options->before_reply = [delay = absl::Milliseconds(faults.step_delay_ms)] {
      absl::SleepFor(delay);
    };
}

}  // namespace moe

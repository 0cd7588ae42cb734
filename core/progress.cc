#include "core/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_format.h"

namespace moe {

std::string HumanBytes(double bytes) {
  if (bytes >= 1e9) return absl::StrFormat("%.2f GB", bytes / 1e9);
  if (bytes >= 1e6) return absl::StrFormat("%.1f MB", bytes / 1e6);
  return absl::StrFormat("%.0f kB", bytes / 1e3);
}

Progress::Progress(std::string label, int64_t total_bytes, bool enabled)
    : label_(std::move(label)),
      total_(total_bytes),
      enabled_(enabled),
      terminal_(isatty(fileno(stderr)) == 1),
      // A bar can move often; a log gets a line every 5 s.
      interval_(terminal_ ? std::chrono::milliseconds(250) : std::chrono::milliseconds(5000)) {}

double Progress::ratio() const {
  if (total_ <= 0) return done_ > 0 ? 1.0 : 0.0;
  return std::min(1.0, static_cast<double>(done_) / static_cast<double>(total_));
}

void Progress::Add(int64_t bytes, absl::string_view stage) {
  done_ += bytes;
  if (!stage.empty()) stage_ = std::string(stage);
  const auto now = std::chrono::steady_clock::now();
  if (now - last_ < interval_) return;
  last_ = now;
  if (on_ratio) on_ratio(ratio());
  Print(/*final=*/false);
}

void Progress::Finish() {
  if (on_ratio) on_ratio(1.0);
  if (done_ > 0) Print(/*final=*/true);  // nothing to say when all of it was there already
}

void Progress::Print(bool final) {
  if (!enabled_) return;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double rate = seconds > 0 ? static_cast<double>(done_) / seconds : 0;
  std::string text;
  if (final) {
    text = absl::StrFormat("%s: %s in %.1f s (%s/s)", label_, HumanBytes(done_), seconds,
                           HumanBytes(rate));
  } else {
    const double eta = rate > 0 ? std::max<double>(0, total_ - done_) / rate : 0;
    text = absl::StrFormat("%s%s%s: %s of %s (%.0f%%), %s/s, ETA %.0f s", label_,
                           stage_.empty() ? "" : " ", stage_, HumanBytes(done_), HumanBytes(total_),
                           100 * ratio(), HumanBytes(rate), eta);
  }
  if (terminal_) {
    // Redrawn in place; padded so a shorter line wipes a longer one.
    std::fprintf(stderr, "\r%-100s%s", text.c_str(), final ? "\n" : "");
  } else {
    std::fprintf(stderr, "%s\n", text.c_str());
  }
  std::fflush(stderr);
}

}  // namespace moe

// The services' log: one line on stderr per event, written whole and flushed, so a line never
// interleaves with another thread's and a collector reading stderr sees it at once.
#pragma once

#include <cstdio>
#include <string>

#include "absl/strings/str_format.h"

namespace moe {

template <typename... Args>
void LogLine(const absl::FormatSpec<Args...>& format, const Args&... args) {
  std::string line = absl::StrFormat(format, args...);
  line += '\n';
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace moe

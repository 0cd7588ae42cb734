// JSON from files that can come from anywhere (safetensors headers and indexes, config.json).
//
// nlohmann's parser is iterative, but dump() and every walk of a value recurse, so a file of
// a million '[' parses fine and then overflows the stack in the first error message that
// quotes it. Values nested deeper than a limit far above any real file are refused here.
#pragma once

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moe {

// Real checkpoint headers and configs nest 2-5 levels.
constexpr int kMaxJsonDepth = 64;

// InvalidArgument with nlohmann's message, or "nested deeper than 64 levels", for bad text.
absl::StatusOr<nlohmann::json> ParseBoundedJson(absl::string_view text,
                                                int max_depth = kMaxJsonDepth);

}  // namespace moe

// The limits the gateway derives from the k3-mini model (hidden 640, MoE layers 1-2) and its
// default --max-request-tokens: what the public-request fuzzers validate against.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "model/config.h"
#include "server/gateway/request_validation.h"

inline moe::RequestLimits K3MiniLimits() {
  // The committed seed config: the embedded k3-mini model's config.json.
  const char* const path = MOE_SOURCE_DIR "/tests/fuzz/corpus/config/k3-mini.json";
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const absl::StatusOr<moe::MoeConfig> config = moe::ParseMoeConfig(text.str());
  if (!config.ok()) {
    std::fprintf(stderr, "%s: %s\n", path, config.status().ToString().c_str());
    std::abort();
  }
  return moe::RequestLimits{config->hidden_size, /*max_request_tokens=*/4096,
                            config->MoeLayerIndices()};
}

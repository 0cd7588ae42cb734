#include "tests/testing/test_checkpoints.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "model/synthetic.h"

namespace moe::testing {

MoeConfig TestConfig(const std::string& name) {
  if (name == "k3-mini" || name == "k3-mini-skewed") return *SyntheticPreset("k3-mini");
  if (name == "k2-fp8-odd") {
    MoeConfig c = *SyntheticPreset("kimi-k2");
    c.hidden_size = 456;
    c.expert_hidden_size = 200;
    c.routing.num_experts = 24;
    c.routing.top_k = 8;
    c.routing.n_group = 4;
    c.routing.topk_group = 2;
    SetNumMoeLayers(1, &c);
    return c;
  }
  if (name == "k3-mxfp4-full-width") {
    MoeConfig c = *SyntheticPreset("kimi-k3");
    c.routing.num_experts = 32;
    c.routing.top_k = 16;
    return c;
  }
  std::fprintf(stderr, "unknown test model %s\n", name.c_str());
  std::abort();
}

std::string TestCheckpoint(const std::string& name) {
  const std::string cache = absl::StrCat(MOE_BINARY_DIR, "/testdata");
  const std::string dir = absl::StrCat(cache, "/", name, "-seed7");
  std::filesystem::create_directories(cache);
  const int lock = open((dir + ".lock").c_str(), O_CREAT | O_RDWR, 0644);
  flock(lock, LOCK_EX);
  if (!std::filesystem::exists(dir + "/complete")) {
    std::filesystem::remove_all(dir);
    SyntheticOptions options;
    options.seed = 7;
    // Several shards, so sharded loading is always exercised.
    options.max_shard_bytes = name.rfind("k3-mini", 0) == 0 ? (16 << 20) : (int64_t{1} << 30);
    if (name == "k3-mini-skewed") options.router_skew = 0.5f;
    const absl::Status written = WriteSyntheticCheckpoint(dir, TestConfig(name), options);
    if (!written.ok()) {
      std::fprintf(stderr, "writing test checkpoint %s: %s\n", name.c_str(),
                   written.ToString().c_str());
      std::abort();
    }
    std::fclose(std::fopen((dir + "/complete").c_str(), "w"));
  }
  flock(lock, LOCK_UN);
  close(lock);
  return dir;
}

}  // namespace moe::testing

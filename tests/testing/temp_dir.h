// Per-process scratch directories for tests: ctest runs the cases of one executable as
// separate processes in parallel, so fixed names would collide.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>

#include "gtest/gtest.h"

namespace moe::testing {

// An empty directory <TempDir>/<name>_<pid>, created afresh.
inline std::string FreshTestDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/" + name + "_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace moe::testing

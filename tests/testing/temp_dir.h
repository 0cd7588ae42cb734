// Per-process scratch directories for tests: ctest runs the cases of one executable as
// separate processes in parallel, so fixed names would collide.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace moe::testing {

// Removes the directories FreshTestDir made when the test process exits, unless a test failed
// (then they are kept for a look, and named on stderr).
class TestDirCleaner {
 public:
  static TestDirCleaner& Get() {
    static TestDirCleaner cleaner;
    return cleaner;
  }
  void Add(const std::string& dir) {
    std::lock_guard<std::mutex> lock(mu_);
    dirs_.push_back(dir);
  }
  ~TestDirCleaner() {
    const bool failed = ::testing::UnitTest::GetInstance()->Failed();
    for (const std::string& dir : dirs_) {
      if (failed) {
        std::fprintf(stderr, "test failed: keeping %s\n", dir.c_str());
        continue;
      }
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  }

 private:
  std::mutex mu_;
  std::vector<std::string> dirs_;
};

// An empty directory <TempDir>/<name>_<pid>, created afresh and removed at exit.
inline std::string FreshTestDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/" + name + "_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  TestDirCleaner::Get().Add(dir);
  return dir;
}

}  // namespace moe::testing

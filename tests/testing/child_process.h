// Child processes for integration tests: real binaries, logs to files, killed on destruction.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/time/time.h"

namespace moe::testing {

class ChildProcess {
 public:
  // Starts argv[0] (a path) with stdout+stderr appended to `log_path`.
  ChildProcess(std::vector<std::string> argv, std::string log_path);
  ~ChildProcess();  // SIGKILL + reap if still running
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  bool running();
  void Signal(int sig);
  // Waits for exit; returns the wait status, or -1 on timeout.
  int Wait(absl::Duration timeout);
  std::string Log() const;
  // Waits until the log contains `text`; returns the log line containing it, "" on timeout.
  std::string WaitForLog(const std::string& text, absl::Duration timeout) const;

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
  std::string log_path_;
};

std::string BinaryPath(const std::string& name);  // MOE_BINARY_DIR/bin/<name>

// Runs `command` with /bin/sh; returns its stdout (exit status in `exit_code`, as pclose).
std::string Shell(const std::string& command, int* exit_code = nullptr);

}  // namespace moe::testing

#include "tests/testing/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace moe::testing {

std::string BinaryPath(const std::string& name) {
  return absl::StrCat(MOE_BINARY_DIR, "/bin/", name);
}

ChildProcess::ChildProcess(std::vector<std::string> argv, std::string log_path)
    : log_path_(std::move(log_path)) {
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  pid_ = fork();
  if (pid_ == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the test
    const int fd = open(log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    execv(args[0], args.data());
    _exit(127);
  }
}

ChildProcess::~ChildProcess() {
  if (!reaped_ && pid_ > 0) {
    kill(pid_, SIGKILL);
    Wait(absl::Seconds(10));
  }
}

bool ChildProcess::running() {
  if (reaped_) return false;
  int status;
  if (waitpid(pid_, &status, WNOHANG) == pid_) {
    reaped_ = true;
    return false;
  }
  return true;
}

void ChildProcess::Signal(int sig) {
  if (!reaped_) kill(pid_, sig);
}

int ChildProcess::Wait(absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  while (!reaped_) {
    int status;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      reaped_ = true;
      return status;
    }
    if (absl::Now() > end) return -1;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return 0;
}

std::string ChildProcess::Log() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string ChildProcess::WaitForLog(const std::string& text, absl::Duration timeout) const {
  const absl::Time end = absl::Now() + timeout;
  for (;;) {
    const std::string log = Log();
    const size_t pos = log.find(text);
    if (pos != std::string::npos) {
      const size_t begin = log.rfind('\n', pos);
      const size_t stop = log.find('\n', pos);
      return log.substr(begin == std::string::npos ? 0 : begin + 1,
                        (stop == std::string::npos ? log.size() : stop) -
                            (begin == std::string::npos ? 0 : begin + 1));
    }
    if (absl::Now() > end) return "";
    absl::SleepFor(absl::Milliseconds(20));
  }
}

std::string Shell(const std::string& command, int* exit_code) {
  std::string out;
  FILE* p = popen(command.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int rc = pclose(p);
  if (exit_code != nullptr) *exit_code = rc;
  return out;
}

}  // namespace moe::testing

#include "server/cluster/process_group.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

extern char** environ;

namespace moe {

// ---- ChildExit ---------------------------------------------------------------------------

bool ChildExit::exited() const { return WIFEXITED(wait_status); }
int ChildExit::exit_code() const { return WEXITSTATUS(wait_status); }
bool ChildExit::signaled() const { return WIFSIGNALED(wait_status); }
int ChildExit::term_signal() const { return WTERMSIG(wait_status); }

std::string ChildExit::Describe() const {
  if (exited()) return absl::StrCat("exited with code ", exit_code());
  if (signaled()) {
    const char* abbrev = sigabbrev_np(term_signal());
    std::string out = absl::StrCat("killed by signal ", term_signal());
    if (abbrev != nullptr) absl::StrAppend(&out, " (SIG", abbrev, ")");
    if (WCOREDUMP(wait_status)) absl::StrAppend(&out, ", core dumped");
    return out;
  }
  return absl::StrCat("ended with wait status ", wait_status);
}

// ---- stderr ------------------------------------------------------------------------------

void WriteStderrLine(absl::string_view line) {
  static std::mutex* const mu = new std::mutex;
  std::string buffer;
  buffer.reserve(line.size() + 1);
  buffer.append(line.data(), line.size());
  buffer.push_back('\n');
  std::lock_guard<std::mutex> lock(*mu);
  const char* p = buffer.data();
  size_t left = buffer.size();
  while (left > 0) {
    ssize_t n = write(STDERR_FILENO, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // nowhere to report it
    p += n;
    left -= static_cast<size_t>(n);
  }
}

// ---- helpers -----------------------------------------------------------------------------

namespace {

absl::Status ErrnoError(absl::string_view what, int err) {
  return absl::InternalError(absl::StrCat(what, ": ", strerror(err)));
}

// argv[0] as given when it holds a '/', else the first executable match in PATH.
std::string ResolveProgram(const std::string& program) {
  if (program.find('/') != std::string::npos) return program;
  const char* path = getenv("PATH");
  for (absl::string_view dir : absl::StrSplit(path != nullptr ? path : "/usr/bin:/bin", ':')) {
    std::string candidate = absl::StrCat(dir.empty() ? "." : dir, "/", program);
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return program;  // exec reports ENOENT
}

int OpenPidfd(pid_t pid) {
#ifdef SYS_pidfd_open
  long fd = syscall(SYS_pidfd_open, pid, 0);
  if (fd >= 0) {
    fcntl(static_cast<int>(fd), F_SETFD, FD_CLOEXEC);
    return static_cast<int>(fd);
  }
#endif
  return -1;  // older kernel or seccomp: the monitor falls back to polling waitpid
}

void CloseFd(int& fd) {
  if (fd >= 0) close(fd);
  fd = -1;
}

// The forked child, up to exec. Only async-signal-safe calls: the parent has other threads.
[[noreturn]] void ExecChild(const char* path, char* const* argv, int out_fd, int null_fd,
                            int error_fd, pid_t parent, bool new_process_group,
                            int parent_death_signal) {
  int err = 0;
  if (new_process_group && setpgid(0, 0) != 0) err = errno;
  if (err == 0 && parent_death_signal != 0) {
    if (prctl(PR_SET_PDEATHSIG, parent_death_signal) != 0) err = errno;
    // NOTES: the parent may have died before prctl; then nobody would ever signal us.
    if (err == 0 && getppid() != parent) _exit(127);
  }
  if (err == 0 && (dup2(null_fd, STDIN_FILENO) < 0 || dup2(out_fd, STDOUT_FILENO) < 0 ||
                   dup2(out_fd, STDERR_FILENO) < 0)) {
    err = errno;
  }
  if (err == 0) {
    // Signal mask and ignored signals survive exec: give the program a clean slate (the
    // supervisor blocks SIGINT/SIGTERM for its signalfd and ignores SIGPIPE).
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; ++sig) sigaction(sig, &dfl, nullptr);  // fails on KILL/STOP
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execve(path, argv, environ);
    err = errno;
  }
  ssize_t ignored = write(error_fd, &err, sizeof err);
  (void)ignored;
  _exit(127);
}

}  // namespace

// ---- ProcessGroup ------------------------------------------------------------------------

struct ProcessGroup::Child {
  std::string name;
  pid_t pid = -1;
  // Monitor thread only after Start publishes the child.
  int out_fd = -1;      // read end of the child's stdout+stderr pipe
  int pidfd = -1;       // readable when the child exits; -1 if unsupported
  std::string partial;  // output after the last newline
  // Guarded by mu_.
  bool reaped = false;
  bool signalled = false;
};

ProcessGroup::ProcessGroup() : ProcessGroup(Options()) {}

ProcessGroup::ProcessGroup(Options options) : options_(std::move(options)) {
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) {
    // Without the eventfd the monitor still works, polling on a short timeout.
    WriteStderrLine(absl::StrCat("ProcessGroup: eventfd: ", strerror(errno)));
  }
  monitor_ = std::thread([this] { MonitorLoop(); });
}

ProcessGroup::~ProcessGroup() {
  if (running() > 0) StopAll(absl::Seconds(10));
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_ = true;
  }
  Wake();
  monitor_.join();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& child : children_) {
    CloseFd(child->out_fd);
    CloseFd(child->pidfd);
  }
  CloseFd(wake_fd_);
}

absl::StatusOr<pid_t> ProcessGroup::Start(const std::string& name,
                                          const std::vector<std::string>& argv) {
  if (argv.empty()) return absl::InvalidArgumentError(absl::StrCat(name, ": empty argv"));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      return absl::FailedPreconditionError(absl::StrCat(name, ": the group is stopping"));
    }
  }
  // Everything the child needs is prepared before fork: after it, only async-signal-safe
  // calls are allowed.
  const std::string path = ResolveProgram(argv[0]);
  std::vector<char*> cargv;
  cargv.reserve(argv.size() + 1);
  for (const std::string& arg : argv) cargv.push_back(const_cast<char*>(arg.c_str()));
  cargv.push_back(nullptr);

  int out_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0) return ErrnoError("pipe2", errno);
  int error_pipe[2];
  if (pipe2(error_pipe, O_CLOEXEC) != 0) {
    const int err = errno;
    close(out_pipe[0]);
    close(out_pipe[1]);
    return ErrnoError("pipe2", err);
  }
  int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (null_fd < 0) {
    const int err = errno;
    for (int fd : {out_pipe[0], out_pipe[1], error_pipe[0], error_pipe[1]}) close(fd);
    return ErrnoError("open /dev/null", err);
  }

  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    ExecChild(path.c_str(), cargv.data(), out_pipe[1], null_fd, error_pipe[1], parent,
              options_.new_process_group, options_.parent_death_signal);
  }
  const int fork_errno = errno;
  close(out_pipe[1]);
  close(error_pipe[1]);
  close(null_fd);
  if (pid < 0) {
    close(out_pipe[0]);
    close(error_pipe[0]);
    return ErrnoError(absl::StrCat(name, ": fork"), fork_errno);
  }

  // The error pipe closes on a successful exec (O_CLOEXEC) or carries the child's errno.
  int child_errno = 0;
  ssize_t n;
  do {
    n = read(error_pipe[0], &child_errno, sizeof child_errno);
  } while (n < 0 && errno == EINTR);
  close(error_pipe[0]);
  if (n > 0) {
    close(out_pipe[0]);
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    return absl::FailedPreconditionError(
        absl::StrCat(name, ": cannot execute ", path, ": ", strerror(child_errno)));
  }

  fcntl(out_pipe[0], F_SETFL, fcntl(out_pipe[0], F_GETFL) | O_NONBLOCK);
  auto child = std::make_unique<Child>();
  child->name = name;
  child->pid = pid;
  child->out_fd = out_pipe[0];
  child->pidfd = OpenPidfd(pid);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      // StopAll began while this child was starting: it missed the SIGTERM.
      child->signalled = true;
      if (!options_.new_process_group || kill(-pid, SIGTERM) != 0) kill(pid, SIGTERM);
    }
    children_.push_back(std::move(child));
    ++running_;
  }
  Wake();
  return pid;
}

void ProcessGroup::SignalAll(int sig) {
  SignalWhere(sig, [](const Child&) { return true; });
}

void ProcessGroup::Signal(pid_t pid, int sig) {
  SignalWhere(sig, [pid](const Child& child) { return child.pid == pid; });
}

void ProcessGroup::SignalWhere(int sig, const std::function<bool(const Child&)>& which) {
  std::lock_guard<std::mutex> lock(mu_);
  // NOTES: signalling under mu_, which reaping also holds, means a pid is never signalled
  // after it was reaped (and possibly reused).
  for (auto& child : children_) {
    if (child->reaped || !which(*child)) continue;
    if (sig != 0) child->signalled = true;
    if (options_.new_process_group && kill(-child->pid, sig) == 0) continue;
    kill(child->pid, sig);
  }
}

namespace {

// cv.wait_until(lock, deadline, done), for absl deadlines (InfiniteFuture included).
template <typename Predicate>
bool WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, absl::Time deadline,
               Predicate done) {
  if (deadline == absl::InfiniteFuture()) {
    cv.wait(lock, done);
    return true;
  }
  return cv.wait_until(lock, absl::ToChronoTime(deadline), done);
}

}  // namespace

absl::optional<ChildExit> ProcessGroup::WaitForExit(pid_t pid, absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  auto find = [this, pid]() -> const ChildExit* {  // mu_ held
    for (const ChildExit& e : exits_)
      if (e.pid == pid) return &e;
    return nullptr;
  };
  WaitUntil(exited_, lock, deadline, [&find] { return find() != nullptr; });
  const ChildExit* exit = find();
  if (exit == nullptr) return absl::nullopt;
  return *exit;
}

bool ProcessGroup::WaitAll(absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  return WaitUntil(exited_, lock, deadline, [this] { return running_ == 0; });
}

std::vector<std::string> ProcessGroup::StopAll(absl::Duration grace) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  std::vector<std::string> killed;
  SignalAll(SIGTERM);
  if (WaitAll(absl::Now() + grace)) return killed;
  killed = running_names();
  SignalAll(SIGKILL);
  WaitAll();
  return killed;
}

int ProcessGroup::running() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_;
}

std::vector<std::string> ProcessGroup::running_names() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> names;
  for (const auto& child : children_)
    if (!child->reaped) names.push_back(child->name);
  return names;
}

std::vector<ChildExit> ProcessGroup::exits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return exits_;
}

void ProcessGroup::Wake() {
  if (wake_fd_ < 0) return;
  const uint64_t one = 1;
  ssize_t ignored = write(wake_fd_, &one, sizeof one);
  (void)ignored;
}

void ProcessGroup::EmitLine(const Child& child, absl::string_view line) {
  // An overlong line goes out in pieces of max_line_bytes.
  do {
    const absl::string_view piece = line.substr(0, line_limit());
    line.remove_prefix(piece.size());
    if (options_.on_line) {
      options_.on_line(child.name, piece);
    } else {
      WriteStderrLine(absl::StrCat("[", child.name, "] ", piece));
    }
  } while (!line.empty());
}

void ProcessGroup::DrainOutput(Child& child, size_t max_bytes) {
  char buffer[16384];
  size_t total = 0;
  while (child.out_fd >= 0 && total < max_bytes) {
    const ssize_t n = read(child.out_fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {  // EOF (or a read error, treated alike): the last line may lack its newline
      if (!child.partial.empty()) EmitLine(child, child.partial);
      child.partial.clear();
      CloseFd(child.out_fd);
      return;
    }
    total += static_cast<size_t>(n);
    child.partial.append(buffer, static_cast<size_t>(n));
    size_t begin = 0;
    for (size_t nl; (nl = child.partial.find('\n', begin)) != std::string::npos; begin = nl + 1) {
      EmitLine(child, absl::string_view(child.partial).substr(begin, nl - begin));
    }
    child.partial.erase(0, begin);
    // The whole pieces of an overlong unfinished line need not wait for its newline.
    const size_t whole = child.partial.size() - child.partial.size() % line_limit();
    if (whole > 0) {
      EmitLine(child, absl::string_view(child.partial).substr(0, whole));
      child.partial.erase(0, whole);
    }
  }
}

void ProcessGroup::MonitorLoop() {
  constexpr size_t kReadSlice = 64 * 1024;  // per child per round, so none starves the others
  // After a child exits: at least a full pipe (what it wrote before exiting), but bounded in
  // case its own children keep the pipe open and keep writing.
  constexpr size_t kDrainLimit = 4 << 20;
  std::vector<pollfd> fds;
  std::vector<Child*> fd_owner;  // nullptr for the wake fd
  std::vector<bool> fd_is_output;
  for (;;) {
    std::vector<Child*> children;
    bool shutdown;
    {
      std::lock_guard<std::mutex> lock(mu_);
      shutdown = shutdown_;
      for (auto& child : children_) children.push_back(child.get());
    }
    if (shutdown) {
      // Everything was reaped (the destructor stops the group first): forward what is left.
      for (Child* child : children) {
        DrainOutput(*child, kDrainLimit);
        if (!child->partial.empty()) EmitLine(*child, child->partial);
        child->partial.clear();
      }
      return;
    }

    fds.clear();
    fd_owner.clear();
    fd_is_output.clear();
    auto watch = [&](int fd, Child* owner, bool is_output) {
      fds.push_back({fd, POLLIN, 0});
      fd_owner.push_back(owner);
      fd_is_output.push_back(is_output);
    };
    if (wake_fd_ >= 0) watch(wake_fd_, nullptr, false);
    bool need_timeout = wake_fd_ < 0;
    for (Child* child : children) {
      if (child->out_fd >= 0) watch(child->out_fd, child, true);
      if (child->pidfd >= 0) {
        watch(child->pidfd, child, false);
      } else {
        std::lock_guard<std::mutex> lock(mu_);
        if (!child->reaped) need_timeout = true;  // no pidfd: poll waitpid
      }
    }
    const int ready = poll(fds.data(), fds.size(), need_timeout ? 50 : -1);
    if (ready < 0 && errno != EINTR) {
      WriteStderrLine(absl::StrCat("ProcessGroup: poll: ", strerror(errno)));
      absl::SleepFor(absl::Milliseconds(50));
    }

    if (wake_fd_ >= 0) {
      uint64_t count;
      ssize_t ignored = read(wake_fd_, &count, sizeof count);
      (void)ignored;
    }
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fd_is_output[i] && fds[i].revents != 0) DrainOutput(*fd_owner[i], kReadSlice);
    }

    // Reap. waitpid runs under mu_ so that SignalAll never signals a reaped pid.
    std::vector<std::pair<Child*, ChildExit>> reaped;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (Child* child : children) {
        if (child->reaped) continue;
        int status = 0;
        const pid_t r = waitpid(child->pid, &status, WNOHANG);
        if (r == 0 || (r < 0 && errno == EINTR)) continue;
        // r < 0 (ECHILD): someone else reaped it (SIGCHLD ignored?); report an unknown end.
        child->reaped = true;
        ChildExit exit;
        exit.name = child->name;
        exit.pid = child->pid;
        exit.wait_status = r > 0 ? status : 0;
        exit.signalled_by_group = child->signalled;
        reaped.emplace_back(child, std::move(exit));
      }
    }
    for (auto& [child, exit] : reaped) {
      CloseFd(child->pidfd);
      // What the child wrote before exiting comes before the report of its exit. The pipe may
      // stay open in its own children; then only what is there now is forwarded.
      DrainOutput(*child, kDrainLimit);
      {
        std::lock_guard<std::mutex> lock(mu_);
        exits_.push_back(exit);
        --running_;
      }
      exited_.notify_all();
      if (options_.on_exit) options_.on_exit(exit);
    }
  }
}

}  // namespace moe

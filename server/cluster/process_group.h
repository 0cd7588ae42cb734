// A supervisor for a small group of child processes (moe-cluster's gateway and ranks).
//
// Each child runs with stdin on /dev/null and stdout+stderr on one pipe. One monitor thread
// per group reads every pipe and reaps every child:
//   - output is split into lines and handed to `on_line` one complete line at a time
//     (default: "[name] line\n" to stderr in a single write, see WriteStderrLine), so lines
//     of different children never interleave mid-line;
//   - a child's exit is reported (`on_exit`, exits(), WaitForExit) only after what it wrote
//     before exiting has been forwarded.
//
// Children get PR_SET_PDEATHSIG, so they are signalled when the thread that started them
// dies (NOTES: the kernel ties it to the forking *thread*, not the process: call Start from
// a thread that lives as long as the children, e.g. main). By default each child leads its
// own process group and signals go to the whole group, so a shell script's children stop
// with it and a terminal's Ctrl-C reaches only the supervisor, which decides what to do.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/optional.h"

namespace moe {

// How a child ended, as reported by waitpid.
struct ChildExit {
  std::string name;
  pid_t pid = -1;
  int wait_status = 0;  // raw waitpid status
  // True when the group had signalled the child (SignalAll / StopAll) before it ended.
  bool signalled_by_group = false;

  bool exited() const;      // ended by exit(); see exit_code()
  int exit_code() const;    // valid when exited()
  bool signaled() const;    // ended by a signal; see term_signal()
  int term_signal() const;  // valid when signaled()
  bool success() const { return exited() && exit_code() == 0; }
  // "exited with code 3", "killed by signal 9 (SIGKILL)", "killed by signal 11 (SIGSEGV), core
  // dumped".
  std::string Describe() const;
};

// Writes `line` plus a newline to stderr in one write(2), serialized with every other caller
// in this process, so supervisor messages and forwarded child lines never interleave.
void WriteStderrLine(absl::string_view line);

class ProcessGroup {
 public:
  struct Options {
    // Receives each output line of each child, without its newline. Called on the monitor
    // thread, one line at a time, in the order each child wrote them. Default:
    // WriteStderrLine("[name] line").
    std::function<void(const std::string& name, absl::string_view line)> on_line;
    // Called on the monitor thread after a child has been reaped (and its output up to then
    // forwarded). Must not call StopAll/WaitAll/WaitForExit (they wait for the monitor thread).
    std::function<void(const ChildExit&)> on_exit;
    // Each child leads a new process group; signals go to the whole group.
    bool new_process_group = true;
    // PR_SET_PDEATHSIG for each child; 0 = none.
    int parent_death_signal = 15;  // SIGTERM
    // A longer line is forwarded in pieces of this size (> 0), as soon as each piece is there.
    size_t max_line_bytes = 64 * 1024;
  };

  ProcessGroup();
  explicit ProcessGroup(Options options);
  // Stops every child still running (StopAll with a 10 s grace period), forwards what is left
  // in the pipes, and joins the monitor thread.
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  // Starts argv[0] (a path, or a name looked up in PATH) with argv, under `name` (the output
  // prefix and the name in exit reports; names need not be unique). Returns the pid once the
  // program has been exec'd; an exec failure (missing file, not executable) is an error and
  // leaves no child behind. Fails after StopAll has begun.
  absl::StatusOr<pid_t> Start(const std::string& name, const std::vector<std::string>& argv);

  // Sends `sig` to every child not yet reaped (to its process group when new_process_group)
  // and marks them signalled_by_group (for sig != 0).
  void SignalAll(int sig);
  // The same for one child (no-op once it has been reaped).
  void Signal(pid_t pid, int sig);

  // Blocks until the child `pid` has been reaped or `deadline` passes.
  absl::optional<ChildExit> WaitForExit(pid_t pid, absl::Time deadline = absl::InfiniteFuture());
  // Blocks until every child started so far has been reaped or `deadline` passes; true if all
  // were reaped.
  bool WaitAll(absl::Time deadline = absl::InfiniteFuture());
  // SIGTERM to every running child, up to `grace` for them to exit, then SIGKILL to the
  // stragglers and wait until all are reaped. Returns the names of the children that had to be
  // killed. No Start is accepted once this begins.
  std::vector<std::string> StopAll(absl::Duration grace);

  // Children started and not yet reaped.
  int running() const;
  // Names of the children started and not yet reaped, in start order.
  std::vector<std::string> running_names() const;
  // Every reaped child, in reaping order.
  std::vector<ChildExit> exits() const;

 private:
  struct Child;

  void MonitorLoop();
  void SignalWhere(int sig, const std::function<bool(const Child&)>& which);
  // Reads what `child` has in its pipe (non-blocking) and forwards complete lines; on EOF
  // flushes the partial last line and closes the pipe. Monitor thread only.
  void DrainOutput(Child& child, size_t max_bytes);
  void EmitLine(const Child& child, absl::string_view line);
  size_t line_limit() const { return options_.max_line_bytes > 0 ? options_.max_line_bytes : 1; }
  void Wake();

  const Options options_;
  int wake_fd_ = -1;  // eventfd: wakes the monitor thread out of poll
  std::thread monitor_;

  // NOTES: std::mutex, not absl::Mutex: Debian's Abseil is not built with ThreadSanitizer,
  // which then cannot see absl::Mutex's synchronization and reports false races.
  mutable std::mutex mu_;
  std::condition_variable exited_;  // signalled when a child joins exits_
  // Guarded by mu_:
  std::vector<std::unique_ptr<Child>> children_;
  std::vector<ChildExit> exits_;
  int running_ = 0;
  bool stopping_ = false;
  bool shutdown_ = false;
};

}  // namespace moe

#include "server/cluster/process_group.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

// Collects every forwarded line, per child name. (std::mutex: TSan cannot see into Debian's
// uninstrumented absl::Mutex.)
class LineLog {
 public:
  ProcessGroup::Options Options() {
    ProcessGroup::Options options;
    options.on_line = [this](const std::string& name, absl::string_view line) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        lines_[name].emplace_back(line);
      }
      cv_.notify_all();
    };
    return options;
  }
  std::vector<std::string> Lines(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    return lines_[name];
  }
  // Waits until `name` has printed `line`.
  bool WaitForLine(const std::string& name, const std::string& line,
                   absl::Duration timeout = absl::Seconds(10)) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, absl::ToChronoMilliseconds(timeout), [&] {
      for (const auto& l : lines_[name])
        if (l == line) return true;
      return false;
    });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<std::string>> lines_;
};

std::vector<std::string> Sh(const std::string& script) { return {"/bin/sh", "-c", script}; }

// True when `pid` is no longer our child: reaped, no zombie left.
bool Reaped(pid_t pid) {
  int status;
  return waitpid(pid, &status, WNOHANG) == -1 && errno == ECHILD;
}

TEST(ProcessGroupTest, PartialWritesBecomeWholeLines) {
  LineLog log;
  {
    ProcessGroup group(log.Options());
    // Pieces of lines across separate writes, an empty line, and no newline at the end.
    ASSERT_TRUE(group
                    .Start("a", Sh("printf 'hel'; sleep 0.05; printf 'lo\\nwor'; sleep 0.05; "
                                   "printf 'ld\\n\\nlast'"))
                    .ok());
    ASSERT_TRUE(group.WaitAll(absl::Now() + absl::Seconds(10)));
  }
  EXPECT_EQ(log.Lines("a"), (std::vector<std::string>{"hello", "world", "", "last"}));
}

TEST(ProcessGroupTest, LotsOfOutputFromManyChildrenStaysOrderedAndComplete) {
  LineLog log;
  constexpr int kChildren = 4, kLines = 3000;
  {
    ProcessGroup group(log.Options());
    for (int c = 0; c < kChildren; ++c) {
      // Lines of varying length (up to ~200 bytes), stdout and stderr mixed.
      const std::string script =
          absl::StrCat("i=0; pad=''; while [ $i -lt ", kLines,
                       " ]; do pad=\"${pad}x\"; [ ${#pad} -gt 200 ] && pad=''; "
                       "if [ $((i % 7)) -eq 0 ]; then echo \"c",
                       c,
                       " $i $pad\" >&2; "
                       "else echo \"c",
                       c, " $i $pad\"; fi; i=$((i+1)); done");
      ASSERT_TRUE(group.Start(absl::StrCat("child ", c), Sh(script)).ok());
    }
    ASSERT_TRUE(group.WaitAll(absl::Now() + absl::Seconds(60)));
    for (const ChildExit& exit : group.exits()) EXPECT_TRUE(exit.success()) << exit.Describe();
  }
  for (int c = 0; c < kChildren; ++c) {
    const std::vector<std::string> lines = log.Lines(absl::StrCat("child ", c));
    ASSERT_EQ(lines.size(), static_cast<size_t>(kLines)) << c;
    for (int i = 0; i < kLines; ++i) {
      const std::vector<std::string> parts = absl::StrSplit(lines[i], ' ');
      ASSERT_EQ(parts.size(), 3u) << lines[i];
      EXPECT_EQ(parts[0], absl::StrCat("c", c));
      EXPECT_EQ(parts[1], absl::StrCat(i));
      EXPECT_EQ(parts[2].size(), static_cast<size_t>((i + 1) % 201)) << lines[i];
    }
  }
}

TEST(ProcessGroupTest, DefaultSinkWritesWholePrefixedLinesToStderr) {
  // Point fd 2 at a file while two chatty children write through the default sink.
  char path[] = "/tmp/process_group_stderr_XXXXXX";
  const int file = mkstemp(path);
  ASSERT_GE(file, 0);
  const int saved = dup(STDERR_FILENO);
  ASSERT_GE(saved, 0);
  ASSERT_EQ(dup2(file, STDERR_FILENO), STDERR_FILENO);
  constexpr int kLines = 2000;
  {
    ProcessGroup group;
    for (const char* name : {"gateway", "rank 0"}) {
      ASSERT_TRUE(group
                      .Start(name, Sh(absl::StrCat("i=0; while [ $i -lt ", kLines,
                                                   " ]; do echo \"line $i of ", name,
                                                   " ..........................\"; i=$((i+1)); "
                                                   "done")))
                      .ok());
    }
    group.WaitAll(absl::Now() + absl::Seconds(60));
    WriteStderrLine("supervisor line");
  }
  dup2(saved, STDERR_FILENO);
  close(saved);

  std::string text;
  char buffer[65536];
  ssize_t n;
  lseek(file, 0, SEEK_SET);
  while ((n = read(file, buffer, sizeof buffer)) > 0) text.append(buffer, static_cast<size_t>(n));
  close(file);
  unlink(path);

  std::map<std::string, int> next;  // per prefix: the next expected line number
  int supervisor = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (line == "supervisor line") {
      ++supervisor;
      continue;
    }
    bool matched = false;
    for (const std::string name : {"gateway", "rank 0"}) {
      const std::string expected = absl::StrCat("[", name, "] line ", next[name], " of ", name,
                                                " ..........................");
      if (line == expected) {
        ++next[name];
        matched = true;
        break;
      }
    }
    ASSERT_TRUE(matched) << "unexpected line: " << line;
  }
  EXPECT_EQ(next["gateway"], kLines);
  EXPECT_EQ(next["rank 0"], kLines);
  EXPECT_EQ(supervisor, 1);
}

TEST(ProcessGroupTest, OverlongLineIsForwardedInPieces) {
  LineLog log;
  ProcessGroup::Options options = log.Options();
  options.max_line_bytes = 1000;
  {
    ProcessGroup group(options);
    // Written through a pipe in pieces of whatever size, and in one write with its newline.
    ASSERT_TRUE(
        group.Start("pieces", Sh("head -c 2500 /dev/zero | tr '\\0' y; echo; echo end")).ok());
    ASSERT_TRUE(group
                    .Start("one write", Sh("s=$(head -c 2500 /dev/zero | tr '\\0' y); "
                                           "printf '%s\\nend\\n' \"$s\""))
                    .ok());
    ASSERT_TRUE(group.WaitAll(absl::Now() + absl::Seconds(10)));
  }
  const std::vector<std::string> expected = {std::string(1000, 'y'), std::string(1000, 'y'),
                                             std::string(500, 'y'), "end"};
  EXPECT_EQ(log.Lines("pieces"), expected);
  EXPECT_EQ(log.Lines("one write"), expected);
}

TEST(ProcessGroupTest, ReportsExitCodesAndSignals) {
  LineLog log;
  ProcessGroup group(log.Options());
  absl::StatusOr<pid_t> ok = group.Start("ok", Sh("exit 0"));
  absl::StatusOr<pid_t> three = group.Start("three", Sh("exit 3"));
  absl::StatusOr<pid_t> killed = group.Start("killed", Sh("kill -KILL $$"));
  absl::StatusOr<pid_t> segv = group.Start("segv", Sh("kill -SEGV $$"));
  ASSERT_TRUE(ok.ok() && three.ok() && killed.ok() && segv.ok());
  ASSERT_TRUE(group.WaitAll(absl::Now() + absl::Seconds(10)));
  EXPECT_EQ(group.running(), 0);
  EXPECT_EQ(group.exits().size(), 4u);

  auto exit_of = [&](pid_t pid) {
    absl::optional<ChildExit> exit = group.WaitForExit(pid, absl::Now());
    EXPECT_TRUE(exit.has_value());
    return exit.value_or(ChildExit());
  };
  ChildExit e = exit_of(*ok);
  EXPECT_EQ(e.name, "ok");
  EXPECT_TRUE(e.success());
  EXPECT_EQ(e.Describe(), "exited with code 0");
  e = exit_of(*three);
  EXPECT_TRUE(e.exited());
  EXPECT_EQ(e.exit_code(), 3);
  EXPECT_EQ(e.Describe(), "exited with code 3");
  EXPECT_FALSE(e.signalled_by_group);
  e = exit_of(*killed);
  EXPECT_TRUE(e.signaled());
  EXPECT_EQ(e.term_signal(), SIGKILL);
  EXPECT_EQ(e.Describe(), "killed by signal 9 (SIGKILL)");
  e = exit_of(*segv);
  EXPECT_EQ(e.term_signal(), SIGSEGV);
  EXPECT_EQ(e.Describe().rfind("killed by signal 11 (SIGSEGV)", 0), 0u) << e.Describe();
  for (pid_t pid : {*ok, *three, *killed, *segv}) EXPECT_TRUE(Reaped(pid)) << pid;
}

TEST(ProcessGroupTest, ExitIsReportedAfterTheChildsOutput) {
  std::atomic<size_t> lines_at_exit{0};
  std::atomic<bool> exit_reported{false};
  LineLog log;
  ProcessGroup::Options options = log.Options();
  options.on_exit = [&](const ChildExit&) {
    lines_at_exit = log.Lines("chatty").size();
    exit_reported = true;
  };
  ProcessGroup group(options);
  absl::StatusOr<pid_t> pid =
      group.Start("chatty", Sh("i=0; while [ $i -lt 5000 ]; do echo $i; i=$((i+1)); done"));
  ASSERT_TRUE(pid.ok());
  ASSERT_TRUE(group.WaitForExit(*pid, absl::Now() + absl::Seconds(30)).has_value());
  EXPECT_EQ(log.Lines("chatty").size(), 5000u);
  for (int i = 0; i < 1000 && !exit_reported; ++i) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_TRUE(exit_reported);
  EXPECT_EQ(lines_at_exit.load(), 5000u);
}

TEST(ProcessGroupTest, StopAllEscalatesToSigkillForAChildThatTrapsTerm) {
  LineLog log;
  ProcessGroup group(log.Options());
  absl::StatusOr<pid_t> polite = group.Start("polite", Sh("echo up; exec sleep 100"));
  absl::StatusOr<pid_t> stubborn =
      group.Start("stubborn", Sh("trap 'echo got TERM' TERM; echo up; while :; do sleep 0.05; "
                                 "done"));
  ASSERT_TRUE(polite.ok() && stubborn.ok());
  ASSERT_TRUE(log.WaitForLine("polite", "up"));
  ASSERT_TRUE(log.WaitForLine("stubborn", "up"));

  const absl::Time start = absl::Now();
  const std::vector<std::string> killed = group.StopAll(absl::Milliseconds(500));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(killed, std::vector<std::string>{"stubborn"});
  EXPECT_GE(took, absl::Milliseconds(500));
  EXPECT_LT(took, absl::Seconds(5));
  EXPECT_EQ(group.running(), 0);

  absl::optional<ChildExit> p = group.WaitForExit(*polite, absl::Now());
  absl::optional<ChildExit> s = group.WaitForExit(*stubborn, absl::Now());
  ASSERT_TRUE(p.has_value() && s.has_value());
  EXPECT_EQ(p->term_signal(), SIGTERM);
  EXPECT_TRUE(p->signalled_by_group);
  EXPECT_EQ(s->term_signal(), SIGKILL);
  EXPECT_TRUE(s->signalled_by_group);
  EXPECT_TRUE(log.WaitForLine("stubborn", "got TERM"));
  EXPECT_TRUE(Reaped(*polite));
  EXPECT_TRUE(Reaped(*stubborn));
  // A stopped group starts nothing more.
  EXPECT_FALSE(group.Start("late", Sh("exit 0")).ok());
}

TEST(ProcessGroupTest, SignalsReachTheWholeProcessGroup) {
  // The shell waits on a foreground `sleep`; without the process group, SIGTERM would leave
  // the sleep running and holding the pipe.
  LineLog log;
  ProcessGroup group(log.Options());
  absl::StatusOr<pid_t> pid = group.Start("sh", Sh("echo $$; sleep 100; echo not reached"));
  ASSERT_TRUE(pid.ok());
  ASSERT_TRUE(log.WaitForLine("sh", absl::StrCat(*pid)));
  const absl::Time start = absl::Now();
  EXPECT_TRUE(group.StopAll(absl::Seconds(10)).empty());
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(ProcessGroupTest, DestructorStopsRunningChildren) {
  pid_t pid;
  {
    LineLog log;
    ProcessGroup group(log.Options());
    absl::StatusOr<pid_t> started = group.Start("sleeper", Sh("exec sleep 100"));
    ASSERT_TRUE(started.ok());
    pid = *started;
  }
  EXPECT_TRUE(Reaped(pid));
}

TEST(ProcessGroupTest, ExecFailureIsAnErrorAndLeavesNoChild) {
  LineLog log;
  ProcessGroup group(log.Options());
  absl::StatusOr<pid_t> pid = group.Start("missing", {"/nonexistent/moe-gateway", "--x"});
  ASSERT_FALSE(pid.ok());
  EXPECT_NE(pid.status().message().find("No such file"), std::string::npos)
      << pid.status().message();
  EXPECT_EQ(group.running(), 0);
  EXPECT_TRUE(group.exits().empty());
  EXPECT_FALSE(group.Start("empty", {}).ok());
  // PATH lookup for a bare name.
  absl::StatusOr<pid_t> sh = group.Start("sh", {"sh", "-c", "exit 4"});
  ASSERT_TRUE(sh.ok()) << sh.status();
  absl::optional<ChildExit> exit = group.WaitForExit(*sh, absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(exit.has_value());
  EXPECT_EQ(exit->exit_code(), 4);
}

TEST(ProcessGroupTest, ChildrenGetStdinFromDevNullAndACleanSignalState) {
  LineLog log;
  ProcessGroup group(log.Options());
  // Block SIGTERM here: the child must not inherit the mask.
  sigset_t term, old;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &term, &old);
  absl::StatusOr<pid_t> pid = group.Start(
      "c", Sh("if read x; then echo got-input; else echo eof; fi; grep -E '^Sig(Blk|Ign)' "
              "/proc/self/status"));
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  ASSERT_TRUE(pid.ok());
  ASSERT_TRUE(group.WaitForExit(*pid, absl::Now() + absl::Seconds(10)).has_value());
  const std::vector<std::string> lines = log.Lines("c");
  ASSERT_GE(lines.size(), 2u);
  EXPECT_EQ(lines[0], "eof");
  // grep's own mask: nothing blocked or ignored was inherited.
  for (const std::string& line : lines) {
    if (line.rfind("SigBlk:", 0) == 0) {
      EXPECT_EQ(line, "SigBlk:\t0000000000000000");
    }
  }
}

TEST(ProcessGroupTest, ChildDiesWithTheThreadThatStartedIt) {
  // PR_SET_PDEATHSIG follows the starting thread: a child started from a short-lived thread
  // gets SIGTERM when that thread ends.
  LineLog log;
  ProcessGroup group(log.Options());
  absl::StatusOr<pid_t> pid = absl::InternalError("not started");
  std::thread starter([&] { pid = group.Start("orphan", Sh("exec sleep 100")); });
  starter.join();
  ASSERT_TRUE(pid.ok()) << pid.status();
  absl::optional<ChildExit> exit = group.WaitForExit(*pid, absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(exit.has_value());
  EXPECT_EQ(exit->term_signal(), SIGTERM);
  EXPECT_FALSE(exit->signalled_by_group);
}

TEST(ProcessGroupTest, ExitOfAChildWhoseChildKeepsThePipeOpenIsStillReported) {
  LineLog log;
  const absl::Time start = absl::Now();
  {
    ProcessGroup group(log.Options());
    absl::StatusOr<pid_t> pid = group.Start("parent", Sh("sleep 2 & echo bye; exit 5"));
    ASSERT_TRUE(pid.ok());
    absl::optional<ChildExit> exit = group.WaitForExit(*pid, absl::Now() + absl::Seconds(10));
    ASSERT_TRUE(exit.has_value());
    EXPECT_EQ(exit->exit_code(), 5);
    EXPECT_EQ(log.Lines("parent"), std::vector<std::string>{"bye"});
  }
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(1500));  // did not wait for the sleep
}

}  // namespace
}  // namespace moe

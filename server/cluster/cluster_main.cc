// moe-cluster: starts moe-gateway and N moe-rank processes on this host, forwards their output
// (prefixed "[gateway] ", "[rank i] ") to stderr, prints one line to stdout once the gateway's
// health check says SERVING, and stops everything on SIGINT/SIGTERM or when any child dies.
//
// Exit codes: 0 after a requested stop, 1 when a child exited on its own, the cluster was not
// ready in time, or a program could not be started; 2 for usage errors.
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/flags.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "security/credentials.h"
#include "server/cluster/process_group.h"

namespace moe {
namespace {

constexpr char kUsage[] =
    "moe-cluster --checkpoint DIR --ranks N [flags] [-- extra moe-gateway flags...]\n"
    "\n"
    "Starts moe-gateway (or --gateways G of them over the one rank pool) and N moe-rank\n"
    "processes on this host (development and demos), forwards their output to stderr prefixed\n"
    "[gateway] (or [gateway g]) / [rank i], prints\n"
    "  moe-cluster: ready on HOST:PORT (N ranks)   (G > 1: HOST:PORT,HOST:PORT+1,...)\n"
    "to stdout once every gateway reports SERVING, and stops them all on SIGINT/SIGTERM: the\n"
    "gateways first (they drain the calls in flight), then the ranks. A rank (gateway) that\n"
    "dies stops the cluster, or with --restart-ranks (--restart-gateways) is started again\n"
    "(backoff 1 s doubling to 30 s). Ports: gateway g listens on --port + g and the control\n"
    "port + g; with --metrics-port M, gateway g on M+g and rank i on M+G+i (0: any free port\n"
    "for each, as moe-gateway and moe-rank take --metrics-port 0).\n"
    "Ranks authenticate with a cluster token: --cluster-token-file, or one made for this run\n"
    "(random, in a 0700 temporary directory, removed at exit). --tls-* files go to the gateway\n"
    "(its identity, and with --tls-ca mTLS) and to the ranks (trust); under mTLS the ranks\n"
    "present --rank-tls-cert/--rank-tls-key (a certificate naming the rank identity).";

struct ClusterOptions {
  std::string checkpoint;
  int ranks = 0;
  int port = 50051;
  int control_port = 0;            // 0: port + 1
  int metrics_port = -1;           // -1: no metrics; 0: any free port each; M: M, M+1+i
  std::string cluster_token_file;  // "": one is made for the run
  TlsFiles tls;
  std::string rank_cert, rank_key;  // the ranks' client certificate (mTLS)
  std::string host = "127.0.0.1";
  int threads_per_rank = 0;  // 0: the rank's default
  std::string bin_dir;
  double ready_timeout_s = 600;
  double stop_timeout_s = 10;
  double drain_timeout_s = 30;  // passed to the gateway
  bool restart_ranks = false;
  int gateways = 1;  // gateway g: --port + g, control --control-port + g
  bool restart_gateways = false;
  std::vector<std::string> gateway_extra;  // after `--`
};

void Log(absl::string_view message) { WriteStderrLine(absl::StrCat("moe-cluster: ", message)); }

// "host:port", bracketing IPv6 literals.
std::string HostPort(absl::string_view host, int port) {
  if (host.find(':') != absl::string_view::npos && !host.empty() && host.front() != '[') {
    return absl::StrCat("[", host, "]:", port);
  }
  return absl::StrCat(host, ":", port);
}

// The address the ranks and the health probe connect to: a wildcard listen address is reached
// through the loopback.
std::string ConnectHost(const std::string& host) {
  if (host == "0.0.0.0" || host.empty()) return "127.0.0.1";
  if (host == "::" || host == "[::]") return "::1";
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    return host.substr(1, host.size() - 2);
  }
  return host;
}

std::string ExecutableDir() {
  char path[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof path - 1);
  if (n <= 0) return ".";
  std::string exe(path, static_cast<size_t>(n));
  const size_t slash = exe.rfind('/');
  return slash == std::string::npos ? "." : exe.substr(0, slash);
}

// True when something accepts TCP connections on host:port (waits at most 200 ms).
bool PortAcceptsConnections(const std::string& host, int port) {
  addrinfo hints;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* addresses = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &addresses) != 0) {
    return false;
  }
  bool connected = false;
  for (addrinfo* a = addresses; a != nullptr && !connected; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
      connected = true;
    } else if (errno == EINPROGRESS) {
      pollfd p = {fd, POLLOUT, 0};
      int err = 0;
      socklen_t len = sizeof err;
      connected = poll(&p, 1, 200) == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 &&
                  err == 0;
    }
    close(fd);
  }
  freeaddrinfo(addresses);
  return connected;
}

// Polls grpc.health.v1.Health/Check (service "") on its own thread until SERVING, then sets
// `ready` and signals `ready_fd` (an eventfd).
class HealthProbe {
 public:
  HealthProbe(std::string target, TlsFiles tls, int ready_fd, std::atomic<bool>* ready)
      : target_(std::move(target)),
        tls_(std::move(tls)),
        ready_fd_(ready_fd),
        ready_(ready),
        thread_([this] { Loop(); }) {}
  ~HealthProbe() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      if (call_ != nullptr) call_->TryCancel();
    }
    stop_cv_.notify_all();
    thread_.join();
  }

  // What the last check returned ("NOT_SERVING", "gRPC code 14: ...").
  std::string last_result() const {
    std::lock_guard<std::mutex> lock(mu_);
    return last_result_;
  }

 private:
  void Loop() {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_ENABLE_HTTP_PROXY, 0);  // http_proxy must not catch a local address
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    AddTlsChannelArgs(tls_, &args);
    auto credentials = ChannelCredentials(tls_);  // checked in Main
    auto stub = grpc::health::v1::Health::NewStub(grpc::CreateCustomChannel(
        target_, credentials.ok() ? *credentials : grpc::InsecureChannelCredentials(), args));
    for (;;) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) return;
        call_ = &context;
      }
      grpc::health::v1::HealthCheckRequest request;  // service "": the whole server
      grpc::health::v1::HealthCheckResponse response;
      const grpc::Status status = stub->Check(&context, request, &response);
      {
        std::lock_guard<std::mutex> lock(mu_);
        call_ = nullptr;
        last_result_ =
            status.ok()
                ? grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status())
                : absl::StrCat("gRPC code ", status.error_code(), ": ", status.error_message());
      }
      if (status.ok() && response.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
        *ready_ = true;
        const uint64_t one = 1;
        ssize_t ignored = write(ready_fd_, &one, sizeof one);
        (void)ignored;
        return;
      }
      std::unique_lock<std::mutex> lock(mu_);
      if (stop_cv_.wait_for(lock, std::chrono::milliseconds(200), [this] { return stop_; })) return;
    }
  }

  const std::string target_;
  const TlsFiles tls_;
  const int ready_fd_;
  std::atomic<bool>* const ready_;
  // NOTES: std::mutex, not absl::Mutex, which ThreadSanitizer cannot see into (Debian's
  // Abseil is not instrumented).
  mutable std::mutex mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;                          // guarded by mu_
  grpc::ClientContext* call_ = nullptr;        // guarded by mu_: the check in flight
  std::string last_result_ = "no answer yet";  // guarded by mu_
  std::thread thread_;                         // last: starts after the members it uses
};

class Cluster {
 public:
  // `signal_fd` delivers SIGINT/SIGTERM (blocked in every thread).
  Cluster(ClusterOptions options, int signal_fd)
      : options_(std::move(options)),
        signal_fd_(signal_fd),
        exit_fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)),
        ready_fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)),
        group_(GroupOptions(exit_fd_)) {}
  ~Cluster() {
    probes_.clear();
    close(exit_fd_);
    close(ready_fd_);
  }

  int Run();

 private:
  enum class Event { kDeadline, kStopSignal, kChildExit, kReady };

  static ProcessGroup::Options GroupOptions(int exit_fd) {
    ProcessGroup::Options options;
    options.on_exit = [exit_fd](const ChildExit&) {
      const uint64_t one = 1;
      ssize_t ignored = write(exit_fd, &one, sizeof one);
      (void)ignored;
    };
    return options;
  }

  // Waits for the next event, or `deadline`.
  Event Wait(absl::Time deadline);
  // Logs the exits not yet logged; returns true if any happened before a stop was requested.
  bool ReportExits();
  // Returns the pid, or -1 (logged) when the child could not start.
  pid_t StartChild(const std::string& name, const std::vector<std::string>& argv);
  // Children to restart whose backoff has passed: started again. False if one could not start.
  bool RestartDue();
  absl::Time NextRestart() const;
  // A health probe of every gateway not yet seen SERVING (none exists while children fork).
  void StartProbes();
  bool AllReady() const;
  // SIGTERM to the gateway, up to --drain-timeout-s + --stop-timeout-s for it to drain and
  // exit; then SIGTERM to the ranks, up to --stop-timeout-s; a second signal cuts either wait
  // short. SIGKILL to the rest, reap all. Returns `exit_code`.
  int StopAll(int exit_code);
  // Waits until none of `pids` runs, `deadline` passes or a stop signal arrives (false).
  bool WaitForExits(const std::vector<pid_t>& pids, absl::Time deadline);

  struct Child {
    std::string name;  // "gateway", "gateway 1", "rank 3": the log prefix
    bool gateway = false;
    std::vector<std::string> argv;
    pid_t pid = -1;
    absl::Time started;
    absl::Duration backoff = absl::Seconds(1);
    absl::Time restart_at = absl::InfiniteFuture();  // pending restart
  };

  const ClusterOptions options_;
  const int signal_fd_;
  const int exit_fd_;
  const int ready_fd_;
  ProcessGroup group_;
  std::vector<std::unique_ptr<HealthProbe>> probes_;  // index: gateway (null once ready)
  std::unique_ptr<std::atomic<bool>[]> gateway_ready_;
  std::vector<std::string> connect_addresses_;  // the gateways' public ports, for the probes
  size_t exits_seen_ = 0;
  bool stopping_ = false;
  std::vector<Child> gateways_, ranks_;
};

Cluster::Event Cluster::Wait(absl::Time deadline) {
  for (;;) {
    pollfd fds[3] = {{signal_fd_, POLLIN, 0}, {exit_fd_, POLLIN, 0}, {ready_fd_, POLLIN, 0}};
    const absl::Duration left = deadline - absl::Now();
    int timeout_ms = -1;
    if (deadline != absl::InfiniteFuture()) {
      timeout_ms = static_cast<int>(std::min<int64_t>(
          INT_MAX, std::max<int64_t>(
                       0, absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))))));
    }
    const int n = poll(fds, 3, timeout_ms);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (absl::Now() >= deadline) return Event::kDeadline;
      continue;
    }
    if (fds[0].revents != 0) {
      signalfd_siginfo info;
      if (read(signal_fd_, &info, sizeof info) == static_cast<ssize_t>(sizeof info)) {
        const char* abbrev = sigabbrev_np(static_cast<int>(info.ssi_signo));
        Log(absl::StrCat("received SIG", abbrev != nullptr ? abbrev : "?",
                         stopping_ ? "" : ", stopping"));
        return Event::kStopSignal;
      }
    }
    uint64_t count;
    if (fds[1].revents != 0 && read(exit_fd_, &count, sizeof count) > 0) return Event::kChildExit;
    if (fds[2].revents != 0 && read(ready_fd_, &count, sizeof count) > 0) return Event::kReady;
  }
}

bool Cluster::ReportExits() {
  const std::vector<ChildExit> exits = group_.exits();
  bool unexpected = false;
  for (; exits_seen_ < exits.size(); ++exits_seen_) {
    const ChildExit& exit = exits[exits_seen_];
    if (stopping_) {
      Log(absl::StrCat(exit.name, " (pid ", exit.pid, ") ", exit.Describe()));
      continue;
    }
    auto find = [&](std::vector<Child>& children) {
      auto it = std::find_if(children.begin(), children.end(),
                             [&](const Child& c) { return c.pid == exit.pid; });
      return it == children.end() ? nullptr : &*it;
    };
    Child* child = nullptr;
    if (options_.restart_ranks) child = find(ranks_);
    if (options_.restart_gateways && child == nullptr) child = find(gateways_);
    if (child != nullptr) {
      // A child that ran a while had a fault, not a crash loop: its backoff starts over.
      if (absl::Now() - child->started > absl::Seconds(60)) child->backoff = absl::Seconds(1);
      child->pid = -1;
      child->restart_at = absl::Now() + child->backoff;
      Log(absl::StrCat(exit.name, " (pid ", exit.pid, ") ", exit.Describe(), "; restarting in ",
                       absl::FormatDuration(child->backoff),
                       child->gateway ? " (--restart-gateways)" : " (--restart-ranks)"));
      child->backoff = std::min(child->backoff * 2, absl::Seconds(30));
    } else {
      Log(absl::StrCat(exit.name, " (pid ", exit.pid, ") ", exit.Describe(),
                       " unexpectedly; stopping the cluster"));
      unexpected = true;
    }
  }
  return unexpected;
}

pid_t Cluster::StartChild(const std::string& name, const std::vector<std::string>& argv) {
  Log(absl::StrCat("starting ", name, ": ", absl::StrJoin(argv, " ")));
  absl::StatusOr<pid_t> pid = group_.Start(name, argv);
  if (!pid.ok()) {
    Log(std::string(pid.status().message()));
    return -1;
  }
  return *pid;
}

absl::Time Cluster::NextRestart() const {
  absl::Time next = absl::InfiniteFuture();
  for (const auto* children : {&gateways_, &ranks_})
    for (const Child& child : *children) next = std::min(next, child.restart_at);
  return next;
}

bool Cluster::RestartDue() {
  for (auto* children : {&gateways_, &ranks_}) {
    for (Child& child : *children) {
      if (child.restart_at > absl::Now()) continue;
      child.restart_at = absl::InfiniteFuture();
      // NOTES: no gRPC object may live across a fork (the health probes go meanwhile).
      probes_.clear();
      child.pid = StartChild(child.name, child.argv);
      if (child.pid < 0) return false;
      child.started = absl::Now();
    }
  }
  return true;
}

void Cluster::StartProbes() {
  probes_.resize(gateways_.size());
  for (size_t g = 0; g < gateways_.size(); ++g)
    if (!gateway_ready_[g] && probes_[g] == nullptr)
      probes_[g] = std::make_unique<HealthProbe>(connect_addresses_[g], options_.tls, ready_fd_,
                                                 &gateway_ready_[g]);
}

bool Cluster::AllReady() const {
  for (size_t g = 0; g < gateways_.size(); ++g)
    if (!gateway_ready_[g]) return false;
  return true;
}

bool Cluster::WaitForExits(const std::vector<pid_t>& pids, absl::Time deadline) {
  auto running = [&] {
    const std::vector<ChildExit> exits = group_.exits();
    for (pid_t pid : pids) {
      if (pid < 0) continue;
      if (std::none_of(exits.begin(), exits.end(),
                       [pid](const ChildExit& e) { return e.pid == pid; }))
        return true;
    }
    return false;
  };
  while (running()) {
    const Event event = Wait(deadline);
    ReportExits();
    if (event == Event::kDeadline) return true;
    if (event == Event::kStopSignal) {
      Log("second signal: killing the rest now");
      return false;
    }
  }
  // The last exits may have been reaped between the event that woke us and running()'s look.
  ReportExits();
  return true;
}

int Cluster::StopAll(int exit_code) {
  stopping_ = true;
  probes_.clear();
  // The gateways first: they drain the calls in flight, which need the ranks.
  bool patient = true;
  std::vector<pid_t> gateways;
  for (const Child& gateway : gateways_) {
    if (gateway.pid <= 0) continue;
    group_.Signal(gateway.pid, SIGTERM);
    gateways.push_back(gateway.pid);
  }
  if (!gateways.empty())
    patient = WaitForExits(
        gateways, absl::Now() + absl::Seconds(options_.drain_timeout_s + options_.stop_timeout_s));
  if (patient) {
    group_.SignalAll(SIGTERM);
    std::vector<pid_t> all = gateways;
    for (const Child& rank : ranks_) all.push_back(rank.pid);
    WaitForExits(all, absl::Now() + absl::Seconds(options_.stop_timeout_s));
  }
  const std::vector<std::string> stragglers = group_.running_names();
  if (!stragglers.empty()) {
    Log(absl::StrCat("sending SIGKILL to ", absl::StrJoin(stragglers, ", ")));
    group_.SignalAll(SIGKILL);
    group_.WaitAll();
    ReportExits();
  }
  Log("all processes stopped");
  return exit_code;
}

int Cluster::Run() {
  if (exit_fd_ < 0 || ready_fd_ < 0) {
    Log(absl::StrCat("eventfd: ", strerror(errno)));
    return 1;
  }
  const absl::Time ready_deadline = absl::Now() + absl::Seconds(options_.ready_timeout_s);
  auto not_ready = [&](absl::string_view what) {
    Log(absl::StrCat("not ready after ", options_.ready_timeout_s, " s (--ready-timeout-s): ", what,
                     "; stopping"));
    return StopAll(1);
  };
  auto tls_flags = [&](std::vector<std::string>& argv, const std::string& cert,
                       const std::string& key) {
    for (const auto& [flag, value] : {std::pair{"--tls-cert", cert}, std::pair{"--tls-key", key},
                                      std::pair{"--tls-ca", options_.tls.ca}})
      if (!value.empty()) argv.insert(argv.end(), {flag, value});
  };

  // Gateways first; the ranks once they accept connections.
  const int G = options_.gateways;
  gateway_ready_ = std::make_unique<std::atomic<bool>[]>(G);
  std::vector<std::string> control_addresses, public_addresses;
  for (int g = 0; g < G; ++g) {
    Child child;
    child.name = G == 1 ? "gateway" : absl::StrCat("gateway ", g);
    child.gateway = true;
    child.argv = {
        options_.bin_dir + "/moe-gateway", "--checkpoint", options_.checkpoint,           "--port",
        std::to_string(options_.port + g), "--ranks",      std::to_string(options_.ranks)};
    if (options_.metrics_port >= 0) {
      const int port = options_.metrics_port > 0 ? options_.metrics_port + g : 0;
      child.argv.insert(child.argv.end(), {"--metrics-port", std::to_string(port)});
    }
    child.argv.insert(child.argv.end(), {"--host", options_.host, "--drain-timeout-s",
                                         absl::StrCat(options_.drain_timeout_s), "--control-port",
                                         std::to_string(options_.control_port + g),
                                         "--cluster-token-file", options_.cluster_token_file});
    tls_flags(child.argv, options_.tls.cert, options_.tls.key);
    child.argv.insert(child.argv.end(), options_.gateway_extra.begin(),
                      options_.gateway_extra.end());
    child.started = absl::Now();
    child.pid = StartChild(child.name, child.argv);
    gateways_.push_back(std::move(child));
    if (gateways_.back().pid < 0) return StopAll(1);
    connect_addresses_.push_back(HostPort(ConnectHost(options_.host), options_.port + g));
    control_addresses.push_back(HostPort(ConnectHost(options_.host), options_.control_port + g));
    public_addresses.push_back(HostPort(options_.host, options_.port + g));
  }

  for (int g = 0; g < G; ++g) {
    while (!PortAcceptsConnections(ConnectHost(options_.host), options_.port + g)) {
      if (absl::Now() >= ready_deadline) {
        return not_ready(
            absl::StrCat("gateway ", g, " does not accept connections on ", connect_addresses_[g]));
      }
      switch (Wait(std::min(ready_deadline, absl::Now() + absl::Milliseconds(100)))) {
        case Event::kStopSignal:
          return StopAll(0);
        case Event::kChildExit:
          if (ReportExits()) return StopAll(1);
          break;
        default:
          break;
      }
    }
  }

  for (int i = 0; i < options_.ranks; ++i) {
    Child child;
    child.name = absl::StrCat("rank ", i);
    child.argv = {options_.bin_dir + "/moe-rank",
                  "--gateway",
                  absl::StrJoin(control_addresses, ","),
                  "--rank",
                  std::to_string(i),
                  "--cluster-token-file",
                  options_.cluster_token_file};
    tls_flags(child.argv, options_.rank_cert, options_.rank_key);
    if (!options_.tls.server_name.empty())
      child.argv.insert(child.argv.end(), {"--tls-server-name", options_.tls.server_name});
    if (options_.threads_per_rank > 0) {
      child.argv.insert(child.argv.end(), {"--threads", std::to_string(options_.threads_per_rank)});
    }
    if (options_.metrics_port >= 0) {
      // 0 stays 0 (every process picks a free port and logs it), as moe-gateway and moe-rank.
      const int port = options_.metrics_port > 0 ? options_.metrics_port + G + i : 0;
      child.argv.insert(child.argv.end(),
                        {"--metrics-port", std::to_string(port), "--metrics-host", options_.host});
    }
    child.started = absl::Now();
    child.pid = StartChild(child.name, child.argv);
    ranks_.push_back(std::move(child));
    if (ranks_.back().pid < 0) return StopAll(1);
  }

  // NOTES: the probes start after the last fork, so no gRPC thread exists while forking.
  StartProbes();
  bool ready = false;
  for (;;) {
    const absl::Time next_restart = NextRestart();
    switch (Wait(std::min(ready ? absl::InfiniteFuture() : ready_deadline, next_restart))) {
      case Event::kReady:
        if (ready || !AllReady()) break;
        ready = true;
        probes_.clear();
        if (G == 1) {
          std::printf("moe-cluster: ready on %s (%d rank%s)\n", public_addresses[0].c_str(),
                      options_.ranks, options_.ranks == 1 ? "" : "s");
        } else {
          std::printf("moe-cluster: ready on %s (%d ranks, %d gateways)\n",
                      absl::StrJoin(public_addresses, ",").c_str(), options_.ranks, G);
        }
        std::fflush(stdout);
        break;
      case Event::kStopSignal:
        return StopAll(0);
      case Event::kChildExit:
        if (ReportExits()) return StopAll(1);
        break;
      case Event::kDeadline:
        if (absl::Now() >= next_restart) {
          if (!RestartDue()) return StopAll(1);
          if (!ready) StartProbes();
          break;
        }
        std::string last;
        for (size_t g = 0; g < probes_.size(); ++g)
          if (probes_[g] != nullptr)
            absl::StrAppend(&last, last.empty() ? "" : "; ",
                            G == 1 ? "" : absl::StrCat(connect_addresses_[g], ": "),
                            probes_[g]->last_result());
        return not_ready(absl::StrCat("gateway health check: ", last));
    }
  }
}

// A 0700 directory holding a 0600 file of 32 random bytes in hex; returns the directory.
absl::StatusOr<std::string> MakeTokenDir() {
  const char* tmp = getenv("TMPDIR");
  std::string pattern =
      absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/moe-cluster-XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr)
    return absl::InternalError(absl::StrCat("mkdtemp ", pattern, ": ", strerror(errno)));
  unsigned char bytes[32];
  const int random = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  const bool got = random >= 0 && read(random, bytes, sizeof bytes) == sizeof bytes;
  if (random >= 0) close(random);
  if (!got) {
    rmdir(pattern.c_str());
    return absl::InternalError("cannot read /dev/urandom for the cluster token");
  }
  std::string token;
  for (unsigned char b : bytes) absl::StrAppend(&token, absl::Hex(b, absl::kZeroPad2));
  const std::string path = pattern + "/cluster-token";
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  const bool written =
      fd >= 0 && write(fd, token.data(), token.size()) == static_cast<ssize_t>(token.size());
  if (fd >= 0) close(fd);
  if (!written) {
    unlink(path.c_str());
    rmdir(pattern.c_str());
    return absl::InternalError(absl::StrCat("cannot write ", path));
  }
  return pattern;
}

void DefineFlags(Flags& flags, ClusterOptions& options) {
  flags.String("checkpoint", &options.checkpoint, "checkpoint directory, passed to moe-gateway");
  flags.Int("ranks", &options.ranks, "number of moe-rank processes");
  flags.Range("ranks", 1, 4096);
  flags.Int("port", &options.port, "gateway gRPC port (gateway g: --port + g)");
  flags.Range("port", 1, 65535);
  flags.Int("gateways", &options.gateways,
            "moe-gateway processes over the one rank pool; every rank serves all of them");
  flags.Range("gateways", 1, 64);
  flags.Int("control-port", &options.control_port,
            "gateway control port the ranks register on (gateway g: + g; 0: --port + --gateways)");
  flags.Range("control-port", 0, 65535);
  flags.String("cluster-token-file", &options.cluster_token_file,
               "cluster token for the gateway and the ranks (default: a random one for this run)");
  flags.String("tls-cert", &options.tls.cert,
               "PEM certificate: the gateway's identity, and the "
               "ranks' under mTLS (so valid for both uses)");
  flags.String("tls-key", &options.tls.key, "PEM private key of --tls-cert");
  flags.String("tls-ca", &options.tls.ca,
               "PEM CA bundle that signed --tls-cert: trust for ranks and health probe, and "
               "mTLS on the gateway");
  flags.String("tls-server-name", &options.tls.server_name,
               "name in --tls-cert to verify when it does not name the --host address");
  flags.String("rank-tls-cert", &options.rank_cert,
               "PEM client certificate of the ranks under mTLS (scripts/make-certs.sh's rank.pem: "
               "the gateway admits only certificates naming the rank identity)");
  flags.String("rank-tls-key", &options.rank_key, "PEM private key of --rank-tls-cert");
  flags.Int("metrics-port", &options.metrics_port,
            "Prometheus port M of the gateway (gateway g: M+g); rank i gets M+G+i with G "
            "gateways (-1 = off; 0 = any free port for each, as moe-gateway and moe-rank take it)");
  flags.Range("metrics-port", -1, 65535);
  flags.String("host", &options.host, "gateway listen address");
  flags.Int("threads-per-rank", &options.threads_per_rank,
            "--threads for each rank (0: the rank's default)");
  flags.Range("threads-per-rank", 0, 4096);
  flags.String("bin-dir", &options.bin_dir,
               "directory of moe-gateway and moe-rank (default: moe-cluster's own)");
  flags.Double("ready-timeout-s", &options.ready_timeout_s,
               "give up (exit 1) when the gateway is not SERVING after this long");
  flags.Double("stop-timeout-s", &options.stop_timeout_s,
               "on stop, SIGKILL what has not exited this long after SIGTERM");
  flags.Double("drain-timeout-s", &options.drain_timeout_s,
               "on stop, how long the gateway may finish the calls in flight (its "
               "--drain-timeout-s); the ranks stop after it");
  flags.Bool("restart-ranks", &options.restart_ranks,
             "start a rank that dies again (backoff 1 s doubling to 30 s) instead of stopping");
  flags.Bool("restart-gateways", &options.restart_gateways,
             "start a gateway that dies again (backoff as --restart-ranks) instead of stopping");
}

int Main(int argc, char** argv) {
  // Everything after `--` goes to the gateway untouched.
  int flag_end = argc;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--") {
      flag_end = i;
      break;
    }
  }
  ClusterOptions options;
  Flags flags(kUsage);
  DefineFlags(flags, options);
  flags.Require("checkpoint");
  flags.Require("ranks");
  flags.AllowPositional();  // refused below with a hint: gateway flags go after --
  flags.ParseOrExit(flag_end, argv);
  options.gateway_extra.assign(argv + std::min(flag_end + 1, argc), argv + argc);

  auto usage_error = [](absl::string_view message) {
    std::fprintf(stderr, "moe-cluster: %s (see --help)\n", std::string(message).c_str());
    return 2;
  };
  if (!flags.positional().empty()) {
    return usage_error(absl::StrCat("unexpected argument '", flags.positional()[0],
                                    "' (gateway flags go after --)"));
  }
  if (options.ranks < 1) return usage_error("--ranks must be at least 1");
  if (options.port < 1 || options.port > 65535) return usage_error("--port must be in 1..65535");
  const int G = options.gateways;
  if (options.port + G - 1 > 65535) return usage_error("--port + --gateways must stay <= 65535");
  if (options.control_port == 0) options.control_port = options.port + G;
  // Every port this cluster listens on: each gateway's public and control port, and with a fixed
  // --metrics-port the gateways' and ranks' metrics ports.
  struct Range {
    int first, last;
    std::string what;
  };
  std::vector<Range> ranges = {
      {options.port, options.port + G - 1, "--port"},
      {options.control_port, options.control_port + G - 1, "the control ports"}};
  if (options.metrics_port > 0)
    ranges.push_back(
        {options.metrics_port, options.metrics_port + G + options.ranks - 1, "--metrics-port"});
  for (size_t a = 0; a < ranges.size(); ++a) {
    if (ranges[a].first < 1 || ranges[a].last > 65535)
      return usage_error(absl::StrCat(ranges[a].what, ": ports ", ranges[a].first, "..",
                                      ranges[a].last, " must lie in 1..65535"));
    for (size_t b = 0; b < a; ++b)
      if (ranges[a].first <= ranges[b].last && ranges[b].first <= ranges[a].last)
        return usage_error(absl::StrCat(ranges[a].what, ": ports ", ranges[a].first, "..",
                                        ranges[a].last, " overlap ", ranges[b].what, " (",
                                        ranges[b].first, "..", ranges[b].last,
                                        "; set --control-port or --metrics-port)"));
  }
  if (!options.tls.cert.empty() && options.tls.ca.empty())
    return usage_error("--tls-cert needs --tls-ca: the ranks must trust the gateway's certificate");
  if (absl::Status s = CheckTlsFiles(options.tls, /*server=*/true); !s.ok())
    return usage_error(s.message());
  if (!options.tls.ca.empty() && (options.rank_cert.empty() || options.rank_key.empty()))
    return usage_error(
        "--tls-ca makes the control port mTLS: give the ranks their certificate with "
        "--rank-tls-cert and --rank-tls-key (scripts/make-certs.sh's rank.pem and rank.key)");
  if (options.tls.ca.empty() && !(options.rank_cert.empty() && options.rank_key.empty()))
    return usage_error("--rank-tls-cert/--rank-tls-key need --tls-ca (mTLS)");
  if (options.threads_per_rank < 0) return usage_error("--threads-per-rank must be >= 0");
  if (!(options.ready_timeout_s > 0)) return usage_error("--ready-timeout-s must be > 0");
  if (!(options.stop_timeout_s >= 0)) return usage_error("--stop-timeout-s must be >= 0");
  if (!(options.drain_timeout_s >= 0)) return usage_error("--drain-timeout-s must be >= 0");

  if (options.bin_dir.empty()) options.bin_dir = ExecutableDir();
  // A token for this run: every process on the host could otherwise register as a rank.
  std::string token_dir;
  if (options.cluster_token_file.empty()) {
    absl::StatusOr<std::string> dir = MakeTokenDir();
    if (!dir.ok()) {
      Log(std::string(dir.status().message()));
      return 1;
    }
    token_dir = *dir;
    options.cluster_token_file = token_dir + "/cluster-token";
  }
  struct RemoveTokenDir {
    std::string dir;
    ~RemoveTokenDir() {
      if (dir.empty()) return;
      unlink((dir + "/cluster-token").c_str());
      rmdir(dir.c_str());
    }
  } remove_token_dir{token_dir};
  for (const char* program : {"moe-gateway", "moe-rank"}) {
    const std::string path = absl::StrCat(options.bin_dir, "/", program);
    if (access(path.c_str(), X_OK) != 0) {
      Log(absl::StrCat("no executable ", path, " (build it, or pass --bin-dir)"));
      return 1;
    }
  }

  // Signals arrive through a signalfd: blocked here, before any thread exists, so every thread
  // inherits the mask. The children get a clean mask (ProcessGroup).
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a closed stdout/stderr must not kill the supervisor
  const int signal_fd = signalfd(-1, &stop_signals, SFD_CLOEXEC | SFD_NONBLOCK);
  if (signal_fd < 0) {
    Log(absl::StrCat("signalfd: ", strerror(errno)));
    return 1;
  }
  int code;
  {
    Cluster cluster(std::move(options), signal_fd);
    code = cluster.Run();
  }
  close(signal_fd);
  return code;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) { return moe::Main(argc, argv); }

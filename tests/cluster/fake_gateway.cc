// A stand-in for moe-gateway in moe-cluster's tests: takes the gateway's flags, serves
// grpc.health.v1 (NOT_SERVING, then SERVING after --serve-after-ms), and exits 0 on SIGTERM.
// Test-only flags make it misbehave: never serve, exit early, ignore SIGTERM.
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/flags.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

class FakeHealth final : public grpc::health::v1::Health::Service {
 public:
  grpc::Status Check(grpc::ServerContext*, const HealthCheckRequest* request,
                     HealthCheckResponse* response) override {
    if (!request->service().empty()) return grpc::Status(grpc::StatusCode::NOT_FOUND, "");
    response->set_status(serving_.load() ? HealthCheckResponse::SERVING
                                         : HealthCheckResponse::NOT_SERVING);
    return grpc::Status::OK;
  }
  void SetServing() { serving_.store(true); }

 private:
  std::atomic<bool> serving_{false};
};

// Waits for SIGINT/SIGTERM (blocked) for up to `ms` (< 0: forever); returns the signal or 0.
int WaitSignal(const sigset_t& set, int64_t ms) {
  if (ms < 0) {
    int sig = 0;
    sigwait(&set, &sig);
    return sig;
  }
  timespec timeout = {static_cast<time_t>(ms / 1000), static_cast<long>(ms % 1000) * 1000000};
  const int sig = sigtimedwait(&set, nullptr, &timeout);
  return sig > 0 ? sig : 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string checkpoint, host = "127.0.0.1";
  int port = 0, ranks = 0, metrics_port = 0, exit_code = -1;
  int64_t serve_after_ms = 500;
  bool never_serve = false, ignore_term = false;
  moe::Flags flags("fake moe-gateway for tests/cluster");
  flags.String("checkpoint", &checkpoint, "ignored");
  flags.Int("port", &port, "gRPC port");
  flags.Int("ranks", &ranks, "ignored");
  flags.Int("metrics-port", &metrics_port, "ignored");
  flags.String("host", &host, "listen address");
  flags.Int("serve-after-ms", &serve_after_ms, "NOT_SERVING for this long, then SERVING");
  flags.Bool("never-serve", &never_serve, "stay NOT_SERVING");
  flags.Int("exit-code", &exit_code, "exit with this code at once (>= 0)");
  flags.Bool("ignore-term", &ignore_term, "ignore SIGTERM (only SIGKILL ends it)");
  double drain_timeout_s = 0;
  int drain_ms = 0;
  flags.Double("drain-timeout-s", &drain_timeout_s, "ignored (moe-cluster passes it)");
  flags.Int("drain-ms", &drain_ms, "after the stop signal, 'drain' this long before exiting");
  int control_port = 0;
  std::string token_file, tls_cert, tls_key, tls_ca;
  flags.Int("control-port", &control_port, "ignored (moe-cluster passes it)");
  flags.String("cluster-token-file", &token_file, "ignored (moe-cluster passes it)");
  flags.String("tls-cert", &tls_cert, "ignored");
  flags.String("tls-key", &tls_key, "ignored");
  flags.String("tls-ca", &tls_ca, "ignored");
  flags.Require("checkpoint");
  flags.Require("port");
  flags.Require("ranks");
  flags.ParseOrExit(argc, argv);

  std::string line = "fake gateway argv:";
  for (int i = 1; i < argc; ++i) absl::StrAppend(&line, " ", argv[i]);
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
  if (exit_code >= 0) {
    std::fprintf(stderr, "fake gateway: exiting with code %d\n", exit_code);
    return exit_code;
  }

  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  if (!ignore_term) sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);  // before gRPC starts threads
  if (ignore_term) signal(SIGTERM, SIG_IGN);

  FakeHealth health;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat(host, ":", port), grpc::InsecureServerCredentials());
  builder.RegisterService(&health);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    std::fprintf(stderr, "fake gateway: cannot listen on %s:%d\n", host.c_str(), port);
    return 1;
  }
  std::printf("fake gateway: listening on %s:%d\n", host.c_str(), port);
  std::fflush(stdout);

  int sig = 0;
  if (!never_serve) {
    sig = WaitSignal(set, serve_after_ms);
    if (sig == 0) {
      health.SetServing();
      std::printf("fake gateway: SERVING\n");
      std::fflush(stdout);
    }
  }
  if (sig == 0) sig = WaitSignal(set, -1);
  std::printf("fake gateway: signal %d, shutting down\n", sig);
  std::fflush(stdout);
  if (drain_ms > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(drain_ms));
    std::printf("fake gateway: drained\n");
    std::fflush(stdout);
  }
  server->Shutdown();
  return 0;
}

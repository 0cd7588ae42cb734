// Fake NCCL of the CPU emulator: see include/nccl.h. Unix-domain sockets in the abstract
// namespace; the process that created the unique id listens, its member of the highest rank
// (the gateway, NCCL rank R, in this project) accepts, and every other member connects to it,
// from another process or from a thread of the same one (the communicator is a star around
// that member, enough for the gateway <-> rank exchange). Grouped operations run on the stream's
// worker thread with non-blocking sockets and poll, so sends and receives of one group progress
// together.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "nccl.h"

namespace {

std::mutex g_listen_mu;
std::map<std::string, int> g_listeners;  // ids created by this process -> listening socket
std::atomic<int> g_next_id{0};

struct CommState {
  int rank = 0, world = 0;
  std::vector<int> fds;  // by peer rank; -1: no connection
  std::atomic<int> state{ncclInProgress};
  std::atomic<bool> aborted{false};
  std::thread init;
  std::mutex error_mu;
  std::string error;

  void Fail(ncclResult_t r, const std::string& what) {
    {
      std::lock_guard<std::mutex> lock(error_mu);
      if (error.empty()) error = what;
    }
    state = r;
  }
  void Shutdown() {
    aborted = true;
    for (int fd : fds)
      if (fd >= 0) shutdown(fd, SHUT_RDWR);
    if (init.joinable()) init.join();
  }
  ~CommState() {
    for (int fd : fds)
      if (fd >= 0) close(fd);
  }
};

sockaddr_un Address(const std::string& name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  a.sun_path[0] = '\0';  // abstract namespace
  std::memcpy(a.sun_path + 1, name.data(), name.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return a;
}

std::string IdName(const ncclUniqueId& id) {
  return std::string(id.internal + 1, strnlen(id.internal + 1, sizeof(id.internal) - 1));
}

bool WriteAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = send(fd, c, n, MSG_NOSIGNAL);
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = read(fd, c, n);
    if (r <= 0) return false;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

void Connect(CommState* st, std::string name, bool hub) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  if (hub) {
    int listener;
    {
      std::lock_guard<std::mutex> lock(g_listen_mu);
      listener = g_listeners[name];
    }
    for (int joined = 0; joined < st->world - 1;) {
      if (st->aborted || std::chrono::steady_clock::now() > deadline)
        return st->Fail(ncclSystemError, "init: not every member joined");
      pollfd p{listener, POLLIN, 0};
      if (poll(&p, 1, 50) <= 0) continue;
      const int c = accept(listener, nullptr, nullptr);
      if (c < 0) continue;
      int peer = -1;
      if (!ReadAll(c, &peer, sizeof(peer)) || peer < 0 || peer >= st->world || st->fds[peer] >= 0 ||
          !WriteAll(c, &st->rank, sizeof(st->rank))) {
        close(c);
        return st->Fail(ncclInvalidUsage, "init: bad or duplicate member rank");
      }
      st->fds[peer] = c;
      ++joined;
    }
  } else {
    int fd = -1;
    while (true) {
      if (st->aborted || std::chrono::steady_clock::now() > deadline)
        return st->Fail(ncclSystemError, "init: cannot reach the member that created the id");
      fd = socket(AF_UNIX, SOCK_STREAM, 0);
      socklen_t len;
      const sockaddr_un a = Address(name, &len);
      if (connect(fd, reinterpret_cast<const sockaddr*>(&a), len) == 0) break;
      close(fd);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    int hub_rank = -1;
    if (!WriteAll(fd, &st->rank, sizeof(st->rank)) || !ReadAll(fd, &hub_rank, sizeof(hub_rank)) ||
        hub_rank < 0 || hub_rank >= st->world) {
      close(fd);
      return st->Fail(ncclSystemError, "init: handshake failed");
    }
    st->fds[hub_rank] = fd;
  }
  for (int fd : st->fds)
    if (fd >= 0) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  st->state = ncclSuccess;
}

struct Op {
  bool send;
  char* buf;
  size_t bytes;
  int peer;
};

// Runs one group's operations to completion (or to the first error) on the stream's thread.
void Progress(const std::shared_ptr<CommState>& st, std::vector<Op> ops) {
  std::vector<size_t> done(ops.size(), 0);
  while (true) {
    if (st->aborted) return;
    if (st->state != ncclSuccess) return;
    // Per peer and direction, the first unfinished operation (NCCL's in-order matching).
    std::vector<pollfd> pfds;
    std::vector<int> which;
    std::map<std::pair<int, bool>, bool> taken;
    bool all = true;
    for (size_t i = 0; i < ops.size(); ++i) {
      if (done[i] == ops[i].bytes && ops[i].bytes > 0) continue;
      if (ops[i].bytes == 0) continue;
      all = false;
      const auto key = std::make_pair(ops[i].peer, ops[i].send);
      if (taken[key]) continue;
      taken[key] = true;
      pfds.push_back({st->fds[ops[i].peer], static_cast<short>(ops[i].send ? POLLOUT : POLLIN), 0});
      which.push_back(static_cast<int>(i));
    }
    if (all) return;
    if (poll(pfds.data(), pfds.size(), 100) <= 0) continue;
    for (size_t j = 0; j < pfds.size(); ++j) {
      if (pfds[j].revents == 0) continue;
      Op& op = ops[which[j]];
      size_t& d = done[which[j]];
      const ssize_t n = op.send ? send(pfds[j].fd, op.buf + d, op.bytes - d, MSG_NOSIGNAL)
                                : read(pfds[j].fd, op.buf + d, op.bytes - d);
      if (n > 0) {
        d += static_cast<size_t>(n);
      } else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        return st->Fail(ncclRemoteError, "a peer closed the connection");
      }
    }
  }
}

thread_local int g_depth = 0;
struct Pending {
  std::shared_ptr<CommState> st;
  cudaStream_t stream;
  Op op;
};
thread_local std::vector<Pending> g_pending;

void Flush() {
  std::vector<Pending> pending;
  pending.swap(g_pending);
  // One closure per (communicator, stream), in order.
  while (!pending.empty()) {
    auto st = pending.front().st;
    cudaStream_t stream = pending.front().stream;
    std::vector<Op> ops;
    std::vector<Pending> rest;
    for (auto& p : pending) {
      if (p.st == st && p.stream == stream) {
        ops.push_back(p.op);
      } else {
        rest.push_back(p);
      }
    }
    pending.swap(rest);
    emu::OnStream(stream, [st, ops] { Progress(st, ops); });
  }
}

size_t TypeSize(ncclDataType_t t) {
  switch (t) {
    case ncclFloat32:
      return 4;
    case ncclFloat64:
      return 8;
    default:
      return 1;
  }
}

}  // namespace

struct ncclComm {
  std::shared_ptr<CommState> st;
};

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id, 0, sizeof(*id));
  const std::string name =
      "moe-emu-nccl-" + std::to_string(getpid()) + "-" + std::to_string(g_next_id++);
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  socklen_t len;
  const sockaddr_un a = Address(name, &len);
  if (fd < 0 || bind(fd, reinterpret_cast<const sockaddr*>(&a), len) != 0 || listen(fd, 64) != 0)
    return ncclSystemError;
  {
    std::lock_guard<std::mutex> lock(g_listen_mu);
    g_listeners[name] = fd;
  }
  id->internal[0] = 'E';
  std::memcpy(id->internal + 1, name.data(), name.size());
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config) {
  if (nranks <= 0 || rank < 0 || rank >= nranks || id.internal[0] != 'E')
    return ncclInvalidArgument;
  auto st = std::make_shared<CommState>();
  st->rank = rank;
  st->world = nranks;
  st->fds.assign(nranks, -1);
  const std::string name = IdName(id);
  bool hub;
  {
    std::lock_guard<std::mutex> lock(g_listen_mu);
    hub = g_listeners.count(name) > 0 && rank == nranks - 1;
  }
  st->init = std::thread(Connect, st.get(), name, hub);
  *comm = new ncclComm{st};
  if (config != nullptr && config->blocking == 0) return ncclInProgress;
  st->init.join();
  return static_cast<ncclResult_t>(st->state.load());
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  if (comm == nullptr) return ncclInvalidArgument;
  *state = static_cast<ncclResult_t>(comm->st->state.load());
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  return comm == nullptr ? ncclInvalidArgument : ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclInvalidArgument;
  comm->st->Shutdown();
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) { return ncclCommDestroy(comm); }

ncclResult_t ncclGroupStart() {
  ++g_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (g_depth <= 0) return ncclInvalidUsage;
  if (--g_depth == 0) Flush();
  return ncclSuccess;
}

static ncclResult_t Post(bool send, const void* buf, size_t count, ncclDataType_t type, int peer,
                         ncclComm_t comm, cudaStream_t stream) {
  if (comm == nullptr || peer < 0 || peer >= comm->st->world || comm->st->fds[peer] < 0)
    return ncclInvalidArgument;
  g_pending.push_back(
      {comm->st, stream,
       Op{send, const_cast<char*>(static_cast<const char*>(buf)), count * TypeSize(type), peer}});
  if (g_depth == 0) Flush();
  return ncclSuccess;
}

ncclResult_t ncclSend(const void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return Post(true, buf, count, type, peer, comm, stream);
}

ncclResult_t ncclRecv(void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return Post(false, buf, count, type, peer, comm, stream);
}

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error";
    case ncclSystemError:
      return "unhandled system error";
    case ncclInternalError:
      return "internal error";
    case ncclInvalidArgument:
      return "invalid argument";
    case ncclInvalidUsage:
      return "invalid usage";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
  }
  return "unknown result code";
}

const char* ncclGetLastError(ncclComm_t comm) {
  if (comm == nullptr) return "";
  std::lock_guard<std::mutex> lock(comm->st->error_mu);
  thread_local std::string copy;
  copy = comm->st->error;
  return copy.c_str();
}

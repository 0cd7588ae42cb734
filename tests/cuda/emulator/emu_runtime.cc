// The CPU emulator's runtime: kernel launches as fibers, the CUDA runtime and cuBLAS calls the
// backend makes. See tests/cuda/emulator/README.md.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "cublas_v2.h"

// ---- fibers: a minimal x86-64 System V context switch (callee-saved registers + stack) ------
extern "C" void emu_switch(void** from_sp, void* to_sp);
extern "C" void emu_trampoline();
extern "C" void emu_fiber_entry();
asm(R"(
.text
.globl emu_switch
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.globl emu_trampoline
emu_trampoline:
  call emu_fiber_entry
  ud2
)");

namespace emu {

thread_local Block* g_block = nullptr;
thread_local std::function<void()>* g_fn = nullptr;
namespace {

thread_local bool g_used_barrier = false;
std::mutex g_needs_fibers_mu;
std::map<std::string, bool> g_needs_fibers;  // kernel name -> reaches a barrier
thread_local std::vector<char*> g_stacks;
constexpr size_t kStack = 256 * 1024;

void Yield() { emu_switch(&g_block->current->sp, g_block->sched_sp); }

int LiveThreads(const Block& b) {
  int n = 0;
  for (const Fiber& f : b.fibers) n += !f.done;
  return n;
}

int LiveLanes(const Block& b, size_t warp) {
  int n = 0;
  for (size_t i = warp * 32; i < b.fibers.size() && i < warp * 32 + 32; ++i) n += !b.fibers[i].done;
  return n;
}

void Die(const char* what) {
  std::fprintf(stderr, "CUDA emulator: %s\n", what);
  std::abort();
}

void WarpBarrier(int w) {
  Block* b = g_block;
  const int gen = b->warp_generation[w];
  if (++b->warp_arrived[w] == LiveLanes(*b, w)) {
    b->warp_arrived[w] = 0;
    b->warp_generation[w]++;
    return;
  }
  while (b->warp_generation[w] == gen) Yield();
}

}  // namespace

void SyncThreads() {
  g_used_barrier = true;
  Block* b = g_block;
  if (b->current == nullptr || b->current->sp == reinterpret_cast<void*>(1))
    Die("__syncthreads outside a fiber");
  const int gen = b->generation;
  if (++b->arrived == LiveThreads(*b)) {
    b->arrived = 0;
    b->generation++;
    return;
  }
  while (b->generation == gen) Yield();
}

uint64_t WarpExchange(uint64_t v, int lane_mask) {
  g_used_barrier = true;
  Block* b = g_block;
  if (b->current == nullptr || b->current->sp == reinterpret_cast<void*>(1))
    Die("warp shuffle outside a fiber");
  const EmuUint3& t = b->current->tid;
  const int linear = static_cast<int>(t.x + b->block.x * (t.y + b->block.y * t.z));
  const int warp = linear / 32, lane = linear % 32;
  b->slots[warp * 32 + lane] = v;
  WarpBarrier(warp);
  const uint64_t r = b->slots[warp * 32 + ((lane ^ lane_mask) & 31)];
  WarpBarrier(warp);
  return r;
}

void RunKernel(const char* name, dim3 grid, dim3 block, size_t smem, std::function<void()> fn) {
  const unsigned threads = block.x * block.y * block.z;
  if (threads == 0 || threads > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.y > 65535 || grid.z > 65535 || smem > 227 * 1024)
    Die((std::string("invalid launch configuration of ") + name).c_str());
  bool known = false, fibers = true;
  {
    std::lock_guard<std::mutex> lock(g_needs_fibers_mu);
    auto it = g_needs_fibers.find(name);
    known = it != g_needs_fibers.end();
    fibers = !known || it->second;
  }
  g_used_barrier = false;
  Block b;
  g_block = &b;
  b.grid = grid;
  b.block = block;
  b.fibers.resize(threads);
  b.warp_arrived.assign((threads + 31) / 32, 0);
  b.warp_generation.assign((threads + 31) / 32, 0);
  b.slots.assign((threads + 31) / 32 * 32, 0);
  b.dyn_smem.assign(smem + 16, static_cast<char>(0xcd));
  while (g_stacks.size() < threads) g_stacks.push_back(static_cast<char*>(std::malloc(kStack)));
  g_fn = &fn;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        b.bid = {bx, by, bz};
        b.arrived = 0;
        std::fill(b.dyn_smem.begin(), b.dyn_smem.end(), static_cast<char>(0xcd));
        unsigned i = 0;
        for (unsigned z = 0; z < block.z; ++z)
          for (unsigned y = 0; y < block.y; ++y)
            for (unsigned x = 0; x < block.x; ++x, ++i) {
              b.fibers[i].tid = {x, y, z};
              b.fibers[i].done = false;
            }
        if (!fibers) {  // no barrier in this kernel: threads one after the other
          for (Fiber& f : b.fibers) {
            f.sp = reinterpret_cast<void*>(1);  // marks "not a fiber"
            b.current = &f;
            fn();
            f.done = true;
          }
          continue;
        }
        for (unsigned t = 0; t < threads; ++t) {
          const auto top = reinterpret_cast<uintptr_t>(g_stacks[t] + kStack) & ~uintptr_t{15};
          void** sp = reinterpret_cast<void**>(top - 8);
          *sp = reinterpret_cast<void*>(&emu_trampoline);  // `ret` target, then 6 registers
          for (int r = 0; r < 6; ++r) *--sp = nullptr;
          b.fibers[t].sp = sp;
        }
        while (true) {
          bool any = false;
          for (Fiber& f : b.fibers) {
            if (f.done) continue;
            any = true;
            b.current = &f;
            emu_switch(&b.sched_sp, f.sp);
          }
          if (!any) break;
          // Barriers whose remaining members all arrived (the others exited).
          if (b.arrived > 0 && b.arrived == LiveThreads(b)) {
            b.arrived = 0;
            b.generation++;
          }
          for (size_t w = 0; w < b.warp_arrived.size(); ++w)
            if (b.warp_arrived[w] > 0 && b.warp_arrived[w] == LiveLanes(b, w)) {
              b.warp_arrived[w] = 0;
              b.warp_generation[w]++;
            }
        }
      }
  if (fibers && !known) {
    std::lock_guard<std::mutex> lock(g_needs_fibers_mu);
    g_needs_fibers[name] = g_used_barrier;
  }
  g_block = nullptr;
}

// ---- streams: one worker thread each, running queued work in order --------------------------

Stream::Stream() : worker_([this] { Run(); }) {}
Stream::~Stream() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}
void Stream::Enqueue(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(fn));
  }
  cv_.notify_all();
}
bool Stream::Idle() {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.empty() && !busy_;
}
void Stream::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return queue_.empty() && !busy_; });
}
void Stream::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop requested and nothing left
    std::function<void()> fn = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    fn();
    lock.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

namespace {
std::mutex g_streams_mu;
std::map<Stream*, int> g_streams;  // -> the device current when it was created
}  // namespace

// The calling thread's current device (cudaSetDevice), as in CUDA.
thread_local int g_device = 0;

Stream* NewStream() {
  auto* s = new Stream();
  std::lock_guard<std::mutex> lock(g_streams_mu);
  g_streams[s] = g_device;
  return s;
}
void DeleteStream(Stream* s) {
  {
    std::lock_guard<std::mutex> lock(g_streams_mu);
    g_streams.erase(s);
  }
  delete s;  // finishes the queued work first
}
// Waits for the streams of the calling thread's device only: members of one NCCL
// communicator on different emulated devices of one process (the transport conformance
// suite) must not wait for each other's blocked receives, as separate GPUs would not.
void SynchronizeDevice(int which) {
  std::vector<Stream*> all;
  {
    std::lock_guard<std::mutex> lock(g_streams_mu);
    for (const auto& [stream, device] : g_streams)
      if (device == which) all.push_back(stream);
  }
  for (Stream* s : all) s->Wait();
}
void DeviceSynchronize() { SynchronizeDevice(g_device); }
// Runs `fn` on `stream` in order (the null stream: now, on the caller's thread).
void OnStream(void* stream, std::function<void()> fn) {
  if (stream == nullptr) {
    fn();
  } else {
    static_cast<Stream*>(stream)->Enqueue(std::move(fn));
  }
}
void LaunchNamed(const char* name, void* stream, dim3 grid, dim3 block, size_t smem,
                 std::function<void()> fn) {
  std::string n(name);
  OnStream(stream, [n, grid, block, smem, fn = std::move(fn)] {
    RunKernel(n.c_str(), grid, block, smem, fn);
  });
}

// ---- events ---------------------------------------------------------------------------------

struct Event {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0, completed = 0;
  std::chrono::steady_clock::time_point when;  // of the last completion
};

}  // namespace emu

extern "C" void emu_fiber_entry() {
  (*emu::g_fn)();
  emu::g_block->current->done = true;
  void* unused;
  emu_switch(&unused, emu::g_block->sched_sp);
  std::abort();  // never resumed
}

// ---- the runtime: emulated sm_90 devices -----------------------------------------------------
// One device, or MOE_EMU_DEVICES (1..8) of them: they share the process's memory and differ
// only in which streams a device synchronization waits for (cudaFree: the allocating device).
using emu::OnStream;

namespace {
int EmulatedDevices() {
  const char* env = std::getenv("MOE_EMU_DEVICES");
  const int n = env != nullptr ? std::atoi(env) : 1;
  return n >= 1 && n <= 8 ? n : 1;
}
}  // namespace

cudaError_t cudaGetDeviceCount(int* n) {
  *n = EmulatedDevices();
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* d) {
  *d = emu::g_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d >= EmulatedDevices()) return cudaErrorInvalidDevice;
  emu::g_device = d;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d) {
  if (d < 0 || d >= EmulatedDevices()) return cudaErrorInvalidDevice;
  std::snprintf(p->name, sizeof(p->name), "EMULATED sm_90 (CPU)");
  p->major = 9;
  p->minor = 0;
  p->totalGlobalMem = size_t{16} << 30;
  return cudaSuccess;
}
// Device memory: its own mapping, ending at an inaccessible guard page, so that reading or
// writing past the end of an allocation (by more than its 256-byte alignment slack) faults.
namespace {
std::mutex g_alloc_mu;
struct Allocation {
  void* mapping;
  size_t length;
  int device;  // current when allocated: freeing waits for that device's work
};
std::map<void*, Allocation> g_allocations;
}  // namespace

cudaError_t cudaMalloc(void** p, size_t n) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t rounded = (std::max<size_t>(n, 1) + 255) / 256 * 256;
  const size_t data_pages = (rounded + page - 1) / page * page;
  void* base =
      mmap(nullptr, data_pages + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return cudaErrorMemoryAllocation;
  char* guard = static_cast<char*>(base) + data_pages;
  mprotect(guard, page, PROT_NONE);
  *p = guard - rounded;
  std::memset(*p, 0xcd, rounded);  // device memory is not zeroed
  std::lock_guard<std::mutex> lock(g_alloc_mu);
  g_allocations[*p] = {base, data_pages + page, emu::g_device};
  return cudaSuccess;
}
// As on a GPU, freeing waits for the queued work of the device that owns the memory.
cudaError_t cudaFree(void* p) {
  if (p == nullptr) return cudaSuccess;
  int device;
  {
    std::lock_guard<std::mutex> lock(g_alloc_mu);
    auto it = g_allocations.find(p);
    if (it == g_allocations.end()) return cudaErrorInvalidValue;
    device = it->second.device;
  }
  emu::SynchronizeDevice(device);
  std::lock_guard<std::mutex> lock(g_alloc_mu);
  auto it = g_allocations.find(p);
  if (it == g_allocations.end()) return cudaErrorInvalidValue;
  munmap(it->second.mapping, it->second.length);
  g_allocations.erase(it);
  return cudaSuccess;
}
cudaError_t cudaHostAlloc(void** p, size_t n, unsigned) { return cudaMalloc(p, n); }
cudaError_t cudaFreeHost(void* p) { return cudaFree(p); }
cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind) {
  emu::DeviceSynchronize();
  if (n) std::memmove(d, s, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind, cudaStream_t st) {
  OnStream(st, [=] {
    if (n) std::memmove(d, s, n);
  });
  return cudaSuccess;
}
cudaError_t cudaMemcpy2DAsync(void* d, size_t dp, const void* s, size_t sp, size_t w, size_t h,
                              cudaMemcpyKind, cudaStream_t st) {
  if (w > dp || w > sp) return cudaErrorInvalidValue;
  OnStream(st, [=] {
    for (size_t r = 0; r < h; ++r)
      std::memmove(static_cast<char*>(d) + r * dp, static_cast<const char*>(s) + r * sp, w);
  });
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* d, int v, size_t n, cudaStream_t st) {
  OnStream(st, [=] { std::memset(d, v, n); });
  return cudaSuccess;
}
cudaError_t cudaMemset2DAsync(void* d, size_t pitch, int v, size_t w, size_t h, cudaStream_t st) {
  if (w > pitch) return cudaErrorInvalidValue;
  OnStream(st, [=] {
    for (size_t r = 0; r < h; ++r) std::memset(static_cast<char*>(d) + r * pitch, v, w);
  });
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  *s = reinterpret_cast<cudaStream_t>(emu::NewStream());
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (s != nullptr) emu::DeleteStream(reinterpret_cast<emu::Stream*>(s));
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  if (s != nullptr) reinterpret_cast<emu::Stream*>(s)->Wait();
  return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t s) {
  return s == nullptr || reinterpret_cast<emu::Stream*>(s)->Idle() ? cudaSuccess
                                                                   : cudaErrorNotReady;
}
// An event handle owns one reference; queued work that records or waits on the event holds
// another, so destroying an event with work pending is safe (as CUDA promises) without waiting.
namespace {
using EventRef = std::shared_ptr<emu::Event>;
EventRef EventOf(cudaEvent_t e) { return *reinterpret_cast<EventRef*>(e); }
}  // namespace
cudaError_t cudaEventCreate(cudaEvent_t* e) {
  *e = reinterpret_cast<cudaEvent_t>(new EventRef(std::make_shared<emu::Event>()));
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) { return cudaEventCreate(e); }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  EventRef ev = EventOf(e);
  uint64_t target;
  {
    std::lock_guard<std::mutex> lock(ev->mu);
    target = ++ev->recorded;
  }
  OnStream(s, [ev, target] {
    std::lock_guard<std::mutex> lock(ev->mu);
    ev->completed = std::max(ev->completed, target);
    ev->when = std::chrono::steady_clock::now();
    ev->cv.notify_all();
  });
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  EventRef ev = EventOf(e);
  std::unique_lock<std::mutex> lock(ev->mu);
  const uint64_t target = ev->recorded;
  ev->cv.wait(lock, [&] { return ev->completed >= target; });
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  EventRef ev = EventOf(e);
  uint64_t target;
  {
    std::lock_guard<std::mutex> lock(ev->mu);
    target = ev->recorded;
  }
  OnStream(s, [ev, target] {
    std::unique_lock<std::mutex> lock(ev->mu);
    ev->cv.wait(lock, [&] { return ev->completed >= target; });
  });
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete reinterpret_cast<EventRef*>(e);
  return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t stop) {
  EventRef a = EventOf(start), b = EventOf(stop);
  std::lock_guard<std::mutex> la(a->mu);
  std::lock_guard<std::mutex> lb(b->mu);
  if (a->completed == 0 || b->completed == 0) return cudaErrorNotReady;
  *ms = std::chrono::duration<float, std::milli>(b->when - a->when).count();
  return cudaSuccess;
}
cudaError_t cudaGetLastError() { return cudaSuccess; }  // invalid launches abort instead
const char* cudaGetErrorName(cudaError_t) { return "cudaErrorEmulated"; }
const char* cudaGetErrorString(cudaError_t) { return "error in the CUDA emulator"; }

// ---- cuBLAS: the documented column-major definition, fp32 accumulation in k order ------------
struct EmuCublas {
  cudaStream_t stream = nullptr;
};
cublasStatus_t cublasCreate(cublasHandle_t* h) {
  *h = reinterpret_cast<cublasHandle_t>(new EmuCublas());
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy(cublasHandle_t h) {
  delete reinterpret_cast<EmuCublas*>(h);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) {
  reinterpret_cast<EmuCublas*>(h)->stream = s;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetPointerMode(cublasHandle_t, cublasPointerMode_t) {
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t, cublasMath_t) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetWorkspace(cublasHandle_t, void*, size_t) { return CUBLAS_STATUS_SUCCESS; }

static float LoadElement(const void* p, cudaDataType_t t, long long i) {
  if (t == CUDA_R_32F) return static_cast<const float*>(p)[i];
  const uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta,
                                          cublasOperation_t tb, int m, int n, int k,
                                          const void* alpha, const void* A, cudaDataType_t at,
                                          int lda, long long sa, const void* B, cudaDataType_t bt,
                                          int ldb, long long sb, const void* beta, void* C,
                                          cudaDataType_t ct, int ldc, long long sc, int batch,
                                          cublasComputeType_t compute, cublasGemmAlgo_t) {
  if (m < 0 || n < 0 || k < 0 || batch < 0) return CUBLAS_STATUS_INVALID_VALUE;
  if (lda < std::max(1, ta == CUBLAS_OP_N ? m : k)) return CUBLAS_STATUS_INVALID_VALUE;
  if (ldb < std::max(1, tb == CUBLAS_OP_N ? k : n)) return CUBLAS_STATUS_INVALID_VALUE;
  if (ldc < std::max(1, m)) return CUBLAS_STATUS_INVALID_VALUE;
  if (at != bt || (ct == CUDA_R_16BF && at != CUDA_R_16BF)) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (at == CUDA_R_32F && compute != CUBLAS_COMPUTE_32F_PEDANTIC) {
    std::fprintf(stderr, "CUDA emulator: fp32 GEMM must ask for CUBLAS_COMPUTE_32F_PEDANTIC\n");
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  const float a = *static_cast<const float*>(alpha), b = *static_cast<const float*>(beta);
  OnStream(reinterpret_cast<EmuCublas*>(h)->stream, [=] {
    for (int bi = 0; bi < batch; ++bi)
      for (int j = 0; j < n; ++j)
        for (int i = 0; i < m; ++i) {
          float acc = 0;
          for (int l = 0; l < k; ++l) {
            const long long ia = ta == CUBLAS_OP_N ? i + static_cast<long long>(l) * lda
                                                   : l + static_cast<long long>(i) * lda;
            const long long ib = tb == CUBLAS_OP_N ? l + static_cast<long long>(j) * ldb
                                                   : j + static_cast<long long>(l) * ldb;
            acc = std::fma(LoadElement(A, at, bi * sa + ia), LoadElement(B, bt, bi * sb + ib), acc);
          }
          const long long at_c = bi * sc + i + static_cast<long long>(j) * ldc;
          if (ct == CUDA_R_32F) {
            float* c = static_cast<float*>(C) + at_c;
            *c = b == 0 ? a * acc : a * acc + b * *c;
          } else {  // bf16 output, rounded to nearest even
            const float v = b == 0 ? a * acc : a * acc + b * LoadElement(C, CUDA_R_16BF, at_c);
            uint32_t u;
            std::memcpy(&u, &v, 4);
            u += 0x7fffu + ((u >> 16) & 1u);
            static_cast<uint16_t*>(C)[at_c] = static_cast<uint16_t>(u >> 16);
          }
        }
  });
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                            int n, int k, const void* alpha, const void* A, cudaDataType_t at,
                            int lda, const void* B, cudaDataType_t bt, int ldb, const void* beta,
                            void* C, cudaDataType_t ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t algo) {
  return cublasGemmStridedBatchedEx(h, ta, tb, m, n, k, alpha, A, at, lda, 0, B, bt, ldb, 0, beta,
                                    C, ct, ldc, 0, 1, compute, algo);
}

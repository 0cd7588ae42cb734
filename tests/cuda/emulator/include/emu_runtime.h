// A CPU emulator of the CUDA subset the backend uses, so that the CUDA backend's host code
// and kernels run (slowly) on machines without a GPU: tests/cuda/emulator/README.md.
//
// Kernels run one block at a time; each CUDA thread of the block is a fiber with its own
// stack (a minimal x86-64 context switch, no syscalls). __syncthreads and warp shuffles are
// cooperative barriers; kernels that never reach one run their threads in a plain loop after
// the first launch. __shared__ variables are function-level thread_local statics (a stream's
// blocks run one after another on its worker thread). Streams are asynchronous (a worker
// thread each; copies, kernels, cuBLAS and NCCL calls queue on them); events order them.
// Device memory is host memory filled with 0xcd.
#pragma once

#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct EmuUint3 {
  unsigned x, y, z;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};

namespace emu {

struct Fiber {
  void* sp = nullptr;
  EmuUint3 tid{0, 0, 0};
  bool done = false;
};

struct Block {
  EmuUint3 bid{0, 0, 0};
  dim3 grid, block;
  std::vector<Fiber> fibers;
  Fiber* current = nullptr;
  void* sched_sp = nullptr;
  int arrived = 0, generation = 0;  // __syncthreads
  std::vector<int> warp_arrived, warp_generation;
  std::vector<uint64_t> slots;  // shuffle exchange, one per lane
  std::vector<char> dyn_smem;
};

extern thread_local Block* g_block;
void SyncThreads();
uint64_t WarpExchange(uint64_t v, int lane_mask);

// A stream: a worker thread that runs queued work in order.
class Stream {
 public:
  Stream();
  ~Stream();  // runs what is queued, then stops
  void Enqueue(std::function<void()> fn);
  bool Idle();
  void Wait();

 private:
  void Run();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool busy_ = false, stop_ = false;
  std::thread worker_;
};
Stream* NewStream();
void DeleteStream(Stream* s);
void DeviceSynchronize();            // the calling thread's current device
void SynchronizeDevice(int device);  // one device's streams
void OnStream(void* stream, std::function<void()> fn);

void LaunchNamed(const char* name, void* stream, dim3 grid, dim3 block, size_t smem,
                 std::function<void()> fn);
template <typename StreamHandle>
void Launch(const char* name, dim3 grid, dim3 block, size_t smem, StreamHandle stream,
            std::function<void()> fn) {
  LaunchNamed(name, static_cast<void*>(stream), grid, block, smem, std::move(fn));
}
template <typename T>
T* DynamicShared() {
  return reinterpret_cast<T*>(g_block->dyn_smem.data());
}

}  // namespace emu

#define threadIdx (::emu::g_block->current->tid)
#define blockIdx (::emu::g_block->bid)
#define blockDim (::emu::g_block->block)
#define gridDim (::emu::g_block->grid)
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local

inline void __syncthreads() { ::emu::SyncThreads(); }
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int lane_mask) {
  static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = ::emu::WarpExchange(bits, lane_mask);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
template <typename T>
inline T __ldcs(const T* p) {
  return *p;
}
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
using std::isnan;

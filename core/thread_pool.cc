#include "core/thread_pool.h"

#include <algorithm>
#include <chrono>

namespace moe {
namespace {

// How long a thread that is out of work spins before it sleeps on a condition variable.
// Waking a sleeping thread costs ~40 us on the VMs we measured (an empty RunOnAll took
// 39-45 us), as much as a small Linear's whole work; consecutive kernel calls of one layer
// step are closer together than this, so they find the worker still spinning.
constexpr auto kSpin = std::chrono::microseconds(50);

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Spins until done() or kSpin elapsed; returns done().
template <typename Done>
bool SpinUntil(Done done) {
  const auto deadline = std::chrono::steady_clock::now() + kSpin;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      CpuRelax();
    }
    if (std::chrono::steady_clock::now() > deadline) return done();
  }
}

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0)
    num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  num_threads_ = num_threads;
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true, std::memory_order_release);
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;
  for (;;) {
    auto has_work = [&] {
      return stop_.load(std::memory_order_acquire) ||
             generation_.load(std::memory_order_acquire) != seen;
    };
    if (!SpinUntil(has_work)) {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, has_work);
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = generation_.load(std::memory_order_acquire);
    active_.fetch_add(1, std::memory_order_seq_cst);
    if (open_.load(std::memory_order_seq_cst) == seen) {
      (*job_.load(std::memory_order_acquire))(index);
      finished_.fetch_add(1, std::memory_order_acq_rel);
    }
    if (active_.fetch_sub(1, std::memory_order_seq_cst) == 1) {
      // Taking mu_ orders this notify after a waiter's predicate check: no lost wake-up.
      std::lock_guard<std::mutex> lock(mu_);
      done_cv_.notify_one();
    }
  }
}

void ThreadPool::Run(const std::function<void(int)>& job, bool every_thread) {
  std::lock_guard<std::mutex> run_lock(run_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_.store(&job, std::memory_order_release);
    finished_.store(0, std::memory_order_relaxed);
    const uint64_t generation = generation_.load(std::memory_order_relaxed) + 1;
    open_.store(generation, std::memory_order_seq_cst);
    generation_.store(generation, std::memory_order_seq_cst);
  }
  work_cv_.notify_all();  // no system call while every worker is still spinning
  job(0);
  const int workers = num_threads_ - 1;
  auto wait = [&](auto done) {
    if (!SpinUntil(done)) {
      std::unique_lock<std::mutex> lock(mu_);
      done_cv_.wait(lock, done);
    }
  };
  if (every_thread) wait([&] { return finished_.load(std::memory_order_acquire) == workers; });
  open_.store(0, std::memory_order_seq_cst);
  wait([&] { return active_.load(std::memory_order_seq_cst) == 0; });
}

void ThreadPool::RunOnAll(const std::function<void(int)>& fn) {
  if (num_threads_ == 1) {
    fn(0);
    return;
  }
  Run(fn, /*every_thread=*/true);
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn) {
  if (n <= 0) return;
  const int threads = static_cast<int>(std::min<int64_t>(num_threads_, n));
  if (threads == 1) {
    fn(0, n, 0);
    return;
  }
  RunOnAll([&](int t) {
    if (t >= threads) return;
    const int64_t begin = n * t / threads;
    const int64_t end = n * (t + 1) / threads;
    if (begin < end) fn(begin, end, t);
  });
}

void ThreadPool::ParallelChunks(int64_t n, int64_t chunk,
                                const std::function<void(int64_t, int64_t, int)>& fn) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t chunks = (n + chunk - 1) / chunk;
  if (chunks == 1 || num_threads_ == 1) {
    fn(0, n, 0);
    return;
  }
  std::atomic<int64_t> next{0};
  Run(
      [&](int t) {
        for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
             c = next.fetch_add(1, std::memory_order_relaxed))
          fn(c * chunk, std::min(n, (c + 1) * chunk), t);
      },
      /*every_thread=*/false);
}

}  // namespace moe

// A fixed pool of worker threads for data-parallel kernels.
//
// ParallelFor splits [0, n) into one contiguous chunk per thread (the caller runs chunk 0),
// so a kernel's work split is deterministic and its threads touch disjoint memory.
// One ParallelFor runs at a time per pool; concurrent callers are serialized.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moe {

class ThreadPool {
 public:
  // num_threads includes the calling thread; 0 means std::thread::hardware_concurrency().
  explicit ThreadPool(int num_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Runs fn(thread_index) on every thread (thread_index in [0, num_threads)) and waits.
  void RunOnAll(const std::function<void(int)>& fn);

  // Runs fn(begin, end, thread_index) over a static split of [0, n) and waits.
  void ParallelFor(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn);

 private:
  void WorkerLoop(int index);

  int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // serializes RunOnAll callers
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  const std::function<void(int)>* job_ = nullptr;  // written under mu_ before generation_
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace moe

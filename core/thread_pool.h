// A fixed pool of worker threads for data-parallel kernels.
//
// RunOnAll and ParallelFor give every thread its own share (ParallelFor: one contiguous chunk per
// thread, the caller running chunk 0) and wait for all of them. ParallelChunks lets whichever
// threads are running take the chunks, so a worker that is still waking up (~100 us on the VMs
// we measured) neither holds up the call nor leaves its share undone. Threads touch disjoint
// memory either way, and a kernel whose rows do not depend on which thread computes them gives
// the same bits. One call runs at a time per pool; concurrent callers are serialized.
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

  // Runs fn(begin, end, thread_index) over [0, n) cut into chunks of `chunk` (the last one may
  // be shorter), each taken by the first free thread, and waits for the chunks only: a worker
  // that wakes after all were taken does nothing. One chunk runs on the caller, waking nobody.
  // A thread may run several chunks; thread_index is unique among the threads running at once.
  void ParallelChunks(int64_t n, int64_t chunk,
                      const std::function<void(int64_t, int64_t, int)>& fn);

 private:
  // Publishes `job`, runs job(0) on the caller, then waits: for every worker to have run it
  // (every_thread), or only for those that joined before the caller finished its part.
  void Run(const std::function<void(int)>& job, bool every_thread);
  void WorkerLoop(int index);

  int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // serializes callers
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::atomic<const std::function<void(int)>*> job_{nullptr};
  std::atomic<uint64_t> generation_{0};  // bumped per call, after job_ and open_ are set
  // The generation workers may still join (0: none). A worker counts itself in active_ before
  // it checks open_, and the caller closes open_ before it waits for active_ to drain, so once
  // closed no worker can start the job (seq_cst: both orders are seen the same by both).
  std::atomic<uint64_t> open_{0};
  std::atomic<int> active_{0};    // workers between joining a generation and leaving it
  std::atomic<int> finished_{0};  // workers that ran the current job
  std::atomic<bool> stop_{false};
};

}  // namespace moe

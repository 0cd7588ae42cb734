#include "core/thread_pool.h"

#include <atomic>
#include <chrono>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace moe {
namespace {

TEST(ThreadPoolTest, ParallelForCoversRangeExactlyOnce) {
  ThreadPool pool(3);
  for (int64_t n : {1, 2, 3, 7, 1000}) {
    std::vector<int> hits(n, 0);
    pool.ParallelFor(n, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) hits[i]++;
    });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i], 1) << n << " " << i;
  }
}

TEST(ThreadPoolTest, ManyRoundsAndAllThreadsRun) {
  ThreadPool pool(2);
  std::atomic<int> total{0};
  for (int round = 0; round < 2000; ++round) pool.RunOnAll([&](int) { total++; });
  EXPECT_EQ(total.load(), 4000);
}

TEST(ThreadPoolTest, ParallelChunksCoverRangeExactlyOnce) {
  ThreadPool pool(3);
  for (int64_t n : {1, 2, 3, 7, 257, 1000})
    for (int64_t chunk : {1, 2, 5, 64, 2000}) {
      std::vector<std::atomic<int>> hits(n);
      std::atomic<int> calls{0};
      pool.ParallelChunks(n, chunk, [&](int64_t b, int64_t e, int t) {
        EXPECT_GE(t, 0);
        EXPECT_LT(t, 3);
        EXPECT_EQ(b % chunk, 0);  // chunk boundaries, whoever runs them
        EXPECT_TRUE(e - b == chunk || e == n) << b << " " << e;
        calls++;
        for (int64_t i = b; i < e; ++i) hits[i]++;
      });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << n << " " << chunk << " " << i;
      EXPECT_EQ(calls.load(), (n + chunk - 1) / chunk);
    }
}

TEST(ThreadPoolTest, OneChunkRunsOnTheCaller) {
  ThreadPool pool(2);
  const std::thread::id caller = std::this_thread::get_id();
  std::thread::id ran_on;
  pool.ParallelChunks(10, 10, [&](int64_t, int64_t, int t) {
    EXPECT_EQ(t, 0);
    ran_on = std::this_thread::get_id();
  });
  EXPECT_EQ(ran_on, caller);
}

// A worker that is asleep when a call starts may wake after the caller took every chunk: the
// call returns without it, and the worker must neither run the finished job nor miss the next
// RunOnAll (which every thread runs). Sleeping past the pool's spin makes the workers sleep.
TEST(ThreadPoolTest, LateWorkersSkipFinishedChunksAndJoinTheNextCall) {
  ThreadPool pool(4);
  for (int round = 0; round < 200; ++round) {
    if (round % 20 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::atomic<int64_t> sum{0};
    pool.ParallelChunks(100, 7, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) sum += i;
    });
    ASSERT_EQ(sum.load(), 4950);
    std::vector<std::atomic<int>> ran(4);
    pool.RunOnAll([&](int t) { ran[t]++; });
    for (int t = 0; t < 4; ++t) ASSERT_EQ(ran[t].load(), 1) << "round " << round << " thread " << t;
  }
}

// Threads running chunks at the same time have distinct indices (per-thread scratch is safe).
TEST(ThreadPoolTest, ConcurrentChunksHaveDistinctThreadIndices) {
  ThreadPool pool(3);
  std::vector<std::atomic<int>> inside(3);
  std::atomic<bool> clash{false};
  for (int round = 0; round < 50; ++round)
    pool.ParallelChunks(60, 1, [&](int64_t, int64_t, int t) {
      if (inside[t]++ != 0) clash = true;
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      inside[t]--;
    });
  EXPECT_FALSE(clash.load());
}

}  // namespace
}  // namespace moe

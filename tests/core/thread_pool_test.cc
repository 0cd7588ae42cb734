#include "core/thread_pool.h"

#include <atomic>
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

}  // namespace
}  // namespace moe

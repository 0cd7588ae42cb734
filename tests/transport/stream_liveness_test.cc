// StreamLiveness on its own: heartbeat cadence, the watchdog's timing, and its stop rules.
// Timing bounds are loose (2-core CI hosts under load): they tell "about the period" from
// "never" or "many times too often", which is what the stream protocol relies on.
#include "transport/stream_liveness.h"

#include <atomic>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

LivenessOptions Options(int heartbeat_ms, int timeout_ms) {
  return LivenessOptions{absl::Milliseconds(heartbeat_ms), absl::Milliseconds(timeout_ms)};
}

TEST(StreamLivenessTest, HeartbeatsAtTheConfiguredPeriod) {
  std::atomic<int> beats{0};
  std::atomic<int> silences{0};
  {
    StreamLiveness liveness(
        Options(50, 10'000), [&] { ++beats; }, [&] { ++silences; });
    absl::SleepFor(absl::Milliseconds(520));
  }
  // One at once, then one per 50 ms: 11 in 520 ms; a loaded host may lose a few.
  EXPECT_GE(beats.load(), 5);
  EXPECT_LE(beats.load(), 12);
  EXPECT_EQ(silences.load(), 0);
}

TEST(StreamLivenessTest, APeerHeardInTimeIsNeverSilent) {
  std::atomic<int> silences{0};
  StreamLiveness liveness(
      Options(20, 300), [] {}, [&] { ++silences; });
  for (int i = 0; i < 20; ++i) {  // 1 s of a peer talking every 50 ms
    absl::SleepFor(absl::Milliseconds(50));
    liveness.Heard();
  }
  EXPECT_FALSE(liveness.silent());
  EXPECT_EQ(silences.load(), 0);
}

TEST(StreamLivenessTest, ASilentPeerFiresOnceAfterTheTimeoutAndHeartbeatsStop) {
  std::atomic<int> beats{0};
  std::atomic<int> silences{0};
  std::atomic<int64_t> fired_after_ms{-1};
  const absl::Time t0 = absl::Now();
  StreamLiveness liveness(
      Options(20, 300), [&] { ++beats; },
      [&] {
        fired_after_ms = absl::ToInt64Milliseconds(absl::Now() - t0);
        ++silences;
      });
  absl::SleepFor(absl::Milliseconds(900));
  EXPECT_TRUE(liveness.silent());
  EXPECT_EQ(silences.load(), 1);
  EXPECT_GE(fired_after_ms.load(), 300);
  EXPECT_LT(fired_after_ms.load(), 700);
  const int beats_then = beats.load();
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(beats.load(), beats_then) << "no heartbeats to a peer given up on";
  liveness.Heard();  // too late: silence is final
  EXPECT_TRUE(liveness.silent());
}

TEST(StreamLivenessTest, DestroyedBeforeTheTimeoutNeverFires) {
  std::atomic<int> silences{0};
  {
    StreamLiveness liveness(
        Options(10, 200), [] {}, [&] { ++silences; });
  }
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(silences.load(), 0);
}

}  // namespace
}  // namespace moe

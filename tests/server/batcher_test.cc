// The gateway's concurrent core without gRPC (so ThreadSanitizer sees all of it): StepBatcher
// and StepEngine over the loopback transport, whose "ranks" are ExpertShards. Concurrent
// callers on several layers must each get exactly the in-process layer's output for their own
// rows; cancelled, expired and over-limit calls get their codes.
#include <atomic>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "engine/local_layer.h"
#include "engine/step_engine.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "model/checkpoint.h"
#include "server/gateway/step_batcher.h"
#include "tests/testing/test_checkpoints.h"
#include "transport/loopback_transport.h"

namespace moe {
namespace {

class BatcherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    checkpoint_ = std::move(*Checkpoint::Open(testing::TestCheckpoint("k3-mini")));
    placement_ = ExpertPlacement::Contiguous(checkpoint_->config().routing.num_experts, 3);
    transport_ = std::make_unique<LoopbackTransport>(&shard_backend_);
    for (int layer : checkpoint_->layers())
      for (int r = 0; r < placement_.num_ranks(); ++r) {
        auto weights = checkpoint_->LoadExperts(layer, placement_.rank_experts[r]);
        ASSERT_TRUE(weights.ok());
        auto shard = ExpertShard::Create(checkpoint_->config(), *weights, &shard_backend_);
        ASSERT_TRUE(shard.ok());
        transport_->AddShard(r, std::move(*shard));
      }
    membership_ = std::make_unique<Membership>(placement_.num_ranks(), /*up=*/true);
    auto engine =
        StepEngine::Create(*checkpoint_, checkpoint_->layers(), placement_, Precision::kBF16,
                           &backend_, transport_.get(), membership_.get());
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(*engine);
  }

  std::shared_ptr<ForwardCall> Call(int layer, int64_t tokens, uint32_t seed) {
    auto call = std::make_shared<ForwardCall>();
    call->layer = layer;
    call->tokens = tokens;
    std::vector<float> x(tokens * 640);
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& v : x) v = normal(rng);
    call->input = ActivationRows::FromFloats(Precision::kBF16, x.data(), tokens, 640);
    call->want_routing = true;
    return call;
  }

  // The in-process layer's output for a call's rows, as fp32 values.
  std::vector<float> InProcess(int layer, const ActivationRows& rows) {
    auto local = LocalMoeLayer::Load(*checkpoint_, layer, placement_, &reference_backend_);
    EXPECT_TRUE(local.ok());
    const std::vector<float> x = rows.ToFloats();
    std::vector<float> y(x.size());
    EXPECT_TRUE((*local)->Forward(x.data(), x.size() / 640, Precision::kBF16, y.data()).ok());
    return y;
  }

  CpuBackend backend_{CpuBackendOptions{2, ""}};
  CpuBackend reference_backend_{CpuBackendOptions{1, ""}};
  std::unique_ptr<Checkpoint> checkpoint_;
  ExpertPlacement placement_;
  CpuBackend shard_backend_{CpuBackendOptions{1, ""}};
  std::unique_ptr<LoopbackTransport> transport_;
  std::unique_ptr<Membership> membership_;
  std::unique_ptr<StepEngine> engine_;
};

TEST_F(BatcherTest, ConcurrentCallersOnSeveralLayersGetTheirOwnRows) {
  BatcherOptions options;
  options.max_wait = absl::Milliseconds(3);
  options.max_tokens_per_step = 96;
  StepBatcher batcher(engine_.get(), options);
  constexpr int kCallers = 8, kCalls = 6;
  std::vector<std::shared_ptr<ForwardCall>> calls(kCallers * kCalls);
  std::atomic<int> batched{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < kCallers; ++c)
    threads.emplace_back([&, c] {
      for (int i = 0; i < kCalls; ++i) {
        auto call =
            Call(1 + (c + i) % 2, 1 + (c * 7 + i * 5) % 37, static_cast<uint32_t>(100 * c + i));
        calls[c * kCalls + i] = call;
        ASSERT_TRUE(batcher.Submit(call).ok());
        call->done.WaitFor(absl::Seconds(60));
        if (call->step_tokens > call->tokens) batched++;
      }
    });
  for (auto& t : threads) t.join();
  for (const auto& call : calls) {
    ASSERT_TRUE(call->status.ok()) << call->status;
    ASSERT_EQ(call->routing.ids.size(), static_cast<size_t>(call->tokens * 2));
    EXPECT_EQ(call->output.ToFloats(), InProcess(call->layer, call->input))
        << "layer " << call->layer << " tokens " << call->tokens;
  }
  EXPECT_GT(batched.load(), 0) << "some steps should have batched several callers";
}

TEST_F(BatcherTest, CancelledExpiredAndOverLimitCallsGetTheirCodes) {
  BatcherOptions options;
  options.max_wait = absl::Milliseconds(50);
  options.max_queued_tokens = 40;
  StepBatcher batcher(engine_.get(), options);
  auto cancelled = Call(1, 5, 1);
  cancelled->cancelled = true;
  auto expired = Call(1, 5, 2);
  expired->deadline = absl::Now() - absl::Seconds(1);
  auto fine = Call(1, 5, 3);
  ASSERT_TRUE(batcher.Submit(cancelled).ok());
  ASSERT_TRUE(batcher.Submit(expired).ok());
  ASSERT_TRUE(batcher.Submit(fine).ok());
  EXPECT_EQ(batcher.Submit(Call(1, 30, 4)).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(batcher.Submit(Call(9, 1, 5)).code(), absl::StatusCode::kNotFound);
  for (auto* call : {&cancelled, &expired, &fine})
    ASSERT_TRUE((*call)->done.WaitFor(absl::Seconds(60)));
  EXPECT_EQ(cancelled->status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(expired->status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(fine->status.ok()) << fine->status;
  EXPECT_EQ(fine->output.ToFloats(), InProcess(1, fine->input));
}

TEST_F(BatcherTest, RequestsLargerThanAStepAreSplitBitIdentically) {
  BatcherOptions options;
  options.max_wait = absl::Milliseconds(5);
  options.max_tokens_per_step = 64;
  StepBatcher batcher(engine_.get(), options);
  std::vector<std::shared_ptr<ForwardCall>> calls = {
      Call(1, 257, 11), Call(1, 3, 12), Call(2, 130, 13), Call(1, 1, 14), Call(1, 64, 15)};
  for (auto& call : calls) ASSERT_TRUE(batcher.Submit(call).ok());
  for (auto& call : calls) ASSERT_TRUE(call->done.WaitFor(absl::Seconds(60)));
  for (const auto& call : calls) {
    ASSERT_TRUE(call->status.ok()) << call->status;
    EXPECT_LE(call->step_tokens, 64) << call->tokens;
    EXPECT_GE(call->steps, (call->tokens + 63) / 64) << call->tokens;
    ASSERT_EQ(call->routing.ids.size(), static_cast<size_t>(call->tokens * 2));
    Routing want_routing;
    auto local = LocalMoeLayer::Load(*checkpoint_, call->layer, placement_, &reference_backend_);
    ASSERT_TRUE(local.ok());
    const std::vector<float> x = call->input.ToFloats();
    std::vector<float> want(x.size());
    ASSERT_TRUE((*local)
                    ->Forward(x.data(), call->tokens, Precision::kBF16, want.data(), &want_routing)
                    .ok());
    EXPECT_EQ(call->output.ToFloats(), want)
        << "layer " << call->layer << " tokens " << call->tokens;
    // bf16 end to end: the batcher hands back the layer's own bf16 values.
    EXPECT_EQ(call->output.precision(), Precision::kBF16);
    EXPECT_EQ(call->routing.ids, want_routing.ids);
    EXPECT_EQ(call->routing.weights, want_routing.weights);
  }
}

TEST_F(BatcherTest, ASmallCallOvertakesALargeOneAfterAtMostTwoSteps) {
  BatcherOptions options;
  options.max_wait = absl::ZeroDuration();
  options.max_tokens_per_step = 32;
  StepBatcher batcher(engine_.get(), options);
  auto large = Call(1, 640, 21);  // 20 steps of 32
  auto small = Call(1, 1, 22);
  ASSERT_TRUE(batcher.Submit(large).ok());
  absl::SleepFor(absl::Milliseconds(1));  // the large one is running
  ASSERT_TRUE(batcher.Submit(small).ok());
  ASSERT_TRUE(small->done.WaitFor(absl::Seconds(60)));
  ASSERT_TRUE(small->status.ok()) << small->status;
  EXPECT_EQ(small->steps, 1);
  // Round robin: the small call joins the step after the large call's current piece, or the
  // one after; so the large call still has most of its rows to go.
  const bool large_done_then = large->done.WaitFor(absl::ZeroDuration());
  EXPECT_FALSE(large_done_then) << "the small call waited for the whole large one";
  ASSERT_TRUE(large->done.WaitFor(absl::Seconds(60)));
  ASSERT_TRUE(large->status.ok()) << large->status;
  EXPECT_GE(large->steps, 20);
  EXPECT_EQ(small->output.ToFloats(), InProcess(1, small->input));
  EXPECT_EQ(large->output.ToFloats(), InProcess(1, large->input));
}

TEST_F(BatcherTest, ShutdownAnswersQueuedCalls) {
  BatcherOptions options;
  options.max_wait = absl::Seconds(30);  // nothing runs before the shutdown
  options.max_tokens_per_step = 1000;
  auto call = Call(2, 3, 9);
  {
    StepBatcher batcher(engine_.get(), options);
    ASSERT_TRUE(batcher.Submit(call).ok());
  }
  ASSERT_TRUE(call->done.WaitFor(absl::Seconds(10)));
  EXPECT_EQ(call->status.code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace moe

// MoeClient and ForwardStreamSession against a fake moe.v1 server on loopback.
#include "client/moe_client.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "client/gateway_targets.h"
#include "core/numerics.h"
#include "gtest/gtest.h"
#include "proto/tensor_codec.h"
#include "tests/client/fake_moe_service.h"

namespace moe {
namespace {

using fake::FakeMoeServer;
using moe::v1::DType;

// The value `f` takes on the wire as `dtype`.
float OnWire(DType dtype, float f) {
  switch (dtype) {
    case moe::v1::BF16:
      return RoundToBf16(f);
    case moe::v1::FP16:
      return HalfBitsToFloat(FloatToHalfBits(f));
    default:
      return f;
  }
}

// Non-zero values with more mantissa than bf16/fp16 keep, so every rounding shows; `tag`
// makes each caller's input its own.
std::vector<float> Input(int64_t n, float tag = 0) {
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) x[i] = tag + 0.3712593f * static_cast<float>(i + 1) - 2.1f;
  return x;
}

// What the fake answers for `x`, as the client should decode it.
std::vector<float> Expected(const std::vector<float>& x, int layer, DType in, DType out) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i)
    y[i] = OnWire(out, 2.0f * OnWire(in, x[i]) + static_cast<float>(layer));
  return y;
}

class MoeClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = FakeMoeServer::Start();
    ASSERT_NE(server_, nullptr);
    auto client = MoeClient::Connect(server_->target(), ClientOptions{});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  std::unique_ptr<FakeMoeServer> server_;
  std::unique_ptr<MoeClient> client_;
};

TEST_F(MoeClientTest, RoundTripInEveryDtypePair) {
  const int64_t tokens = 3, hidden = FakeMoeServer::kHidden;
  const std::vector<float> x = Input(tokens * hidden);
  for (DType in : {moe::v1::FP32, moe::v1::BF16, moe::v1::FP16}) {
    for (DType out : {moe::v1::DTYPE_UNSPECIFIED, moe::v1::FP32, moe::v1::BF16, moe::v1::FP16}) {
      ForwardOptions options;
      options.dtype = in;
      options.output_dtype = out;
      auto y = client_->Forward(2, {tokens, hidden}, x.data(), options);
      ASSERT_TRUE(y.ok()) << DTypeName(in) << " -> " << DTypeName(out) << ": " << y.status();
      EXPECT_EQ(y->shape, (std::vector<int64_t>{tokens, hidden}));
      const DType effective_out = out == moe::v1::DTYPE_UNSPECIFIED ? in : out;
      const std::vector<float> want = Expected(x, 2, in, effective_out);
      ASSERT_EQ(y->values.size(), want.size());
      for (size_t i = 0; i < want.size(); ++i)
        ASSERT_EQ(y->values[i], want[i]) << DTypeName(in) << " -> " << DTypeName(out) << " @" << i;
      EXPECT_EQ(y->routing.top_k, 0);  // not requested
      EXPECT_EQ(y->timing.queue_us, 7);
      EXPECT_EQ(y->timing.step_us, 100 + tokens);
      EXPECT_EQ(y->timing.step_tokens, tokens);
    }
  }
  // The roundings above are real: bf16 and fp16 disagree with fp32 on this input.
  EXPECT_NE(OnWire(moe::v1::BF16, x[0]), x[0]);
  EXPECT_NE(OnWire(moe::v1::FP16, x[0]), x[0]);
}

TEST_F(MoeClientTest, BatchShapeKeptAndRoutingReturned) {
  const std::vector<int64_t> shape = {2, 3, FakeMoeServer::kHidden};
  const std::vector<float> x = Input(2 * 3 * FakeMoeServer::kHidden);
  ForwardOptions options;
  options.return_routing = true;
  options.request_id = "batch-1";
  auto y = client_->Forward(3, shape, x.data(), options);
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(y->shape, shape);
  EXPECT_EQ(y->values, Expected(x, 3, moe::v1::FP32, moe::v1::FP32));
  EXPECT_EQ(y->request_id, "batch-1");
  ASSERT_EQ(y->routing.top_k, FakeMoeServer::kTopK);
  ASSERT_EQ(y->routing.expert_ids.size(), 6u * FakeMoeServer::kTopK);
  ASSERT_EQ(y->routing.weights.size(), 6u * FakeMoeServer::kTopK);
  for (int t = 0; t < 6; ++t) {
    EXPECT_EQ(y->routing.expert_ids[2 * t], (3 + t) % FakeMoeServer::kExperts);
    EXPECT_EQ(y->routing.expert_ids[2 * t + 1], (3 + t + 17) % FakeMoeServer::kExperts);
    EXPECT_EQ(y->routing.weights[2 * t], 0.75f);
    EXPECT_EQ(y->routing.weights[2 * t + 1], 0.25f);
  }
}

TEST_F(MoeClientTest, ErrorCodesAndMessagesPropagateUnchanged) {
  const std::vector<float> x = Input(FakeMoeServer::kHidden);
  const std::vector<int64_t> shape = {1, FakeMoeServer::kHidden};
  struct Case {
    int layer;
    absl::StatusCode code;
    const char* message;
  };
  for (const Case& c : {
           Case{-1, absl::StatusCode::kInvalidArgument, "layer must be >= 0, got -1"},
           Case{FakeMoeServer::kUnservedLayer, absl::StatusCode::kNotFound,
                "layer 404 is not served (served: 1, 2, 3)"},
           Case{FakeMoeServer::kBusyLayer, absl::StatusCode::kResourceExhausted,
                "queue full: 1 requests waiting, limit 0"},
           Case{FakeMoeServer::kUnavailableLayer, absl::StatusCode::kUnavailable,
                "ranks not ready (0 of 2)"},
       }) {
    auto y = client_->Forward(c.layer, shape, x.data(), ForwardOptions{});
    ASSERT_FALSE(y.ok()) << c.layer;
    EXPECT_EQ(y.status().code(), c.code) << y.status();
    EXPECT_EQ(y.status().message(), c.message);
  }
  // A wrong hidden size is the server's verdict, passed through as is.
  const std::vector<float> narrow = Input(5);
  auto y = client_->Forward(1, {1, 5}, narrow.data(), ForwardOptions{});
  ASSERT_FALSE(y.ok());
  EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(y.status().message(), "hidden_states: hidden size must be 8, got 5");
}

TEST_F(MoeClientTest, LocalArgumentErrors) {
  const std::vector<float> x = Input(8);
  auto negative = client_->Forward(1, {-1, 8}, x.data(), ForwardOptions{});
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  ForwardOptions bad;
  bad.dtype = moe::v1::DTYPE_UNSPECIFIED;
  EXPECT_EQ(client_->Forward(1, {1, 8}, x.data(), bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(server_->total_calls(), 0);  // nothing reached the server
  EXPECT_EQ(MoeClient::Connect("", ClientOptions{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseWireDType("BF16").value(), moe::v1::BF16);
  EXPECT_EQ(ParseWireDType("fp16").value(), moe::v1::FP16);
  EXPECT_EQ(ParseWireDType("int8").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(MoeClientTest, DeadlineExceeded) {
  const std::vector<float> x = Input(FakeMoeServer::kHidden);
  ForwardOptions options;
  options.timeout = absl::Milliseconds(200);
  const auto t0 = std::chrono::steady_clock::now();
  auto y =
      client_->Forward(FakeMoeServer::kSlowLayer, {1, FakeMoeServer::kHidden}, x.data(), options);
  const auto waited = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(y.ok());
  EXPECT_EQ(y.status().code(), absl::StatusCode::kDeadlineExceeded) << y.status();
  EXPECT_LT(waited, std::chrono::seconds(5));
}

TEST_F(MoeClientTest, ModelInfo) {
  auto info = client_->GetModelInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->family(), "kimi_k3");
  EXPECT_EQ(info->hidden_size(), FakeMoeServer::kHidden);
  ASSERT_EQ(info->layers_size(), 3);
  EXPECT_EQ(info->layers(2), 3);
  EXPECT_EQ(info->ranks_size(), 2);
}

TEST(GatewayTargetsTest, AListIsResolvedHereAndNamedByItsFirstGateway) {
  EXPECT_EQ(*GatewayChannelTarget(" gw.example:50051 "), "gw.example:50051");  // gRPC's DNS
  EXPECT_EQ(*GatewayChannelTarget("127.0.0.1:7001, 127.0.0.1:7002"), "ipv4:127.0.0.1:7001,127.0.0.1:7002");
  EXPECT_EQ(GatewayChannelTarget("127.0.0.1:7001,,127.0.0.1:7002").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GatewayChannelTarget("").status().code(), absl::StatusCode::kInvalidArgument);
  // The authority TLS verifies: gRPC's own for one target, the first gateway for a list (the
  // "ipv4:" target would lend it the whole list, which no certificate names).
  EXPECT_EQ(GatewayAuthority("gw.example:50051"), "");
  EXPECT_EQ(GatewayAuthority(" localhost:7001 ,127.0.0.1:7002"), "localhost:7001");
}

TEST(MessageLimitTest, FollowsTheModelWithAFloor) {
  moe::v1::ModelInfo info;
  // K3 at the gateway's defaults: 4096 fp32 rows of 7168, top-16 routing, 1 MiB of framing.
  info.set_max_request_tokens(4096);
  info.set_hidden_size(7168);
  info.set_top_k(16);
  EXPECT_EQ(MessageLimit(info), 4096 * 7168 * 4 + 4096 * 16 * 12 + (1 << 20));
  info.set_max_request_tokens(8192);
  EXPECT_EQ(MessageLimit(info), 8192 * 7168 * 4 + 8192 * 16 * 12 + (1 << 20));
  // A small model (or an empty answer) keeps gRPC's default; absurd limits stop at INT32_MAX.
  info.set_hidden_size(8);
  EXPECT_EQ(MessageLimit(info), kMinMessageBytes);
  EXPECT_EQ(MessageLimit(moe::v1::ModelInfo()), kMinMessageBytes);
  info.set_hidden_size(int64_t{1} << 40);
  info.set_max_request_tokens(int64_t{1} << 40);
  EXPECT_EQ(MessageLimit(info), INT32_MAX);
}

// A response over gRPC's default 4 MiB to a request under it (bf16 in, fp32 out): what a
// default channel fails to receive after the server did the work.
constexpr int64_t kLargeTokens = 160000;  // 2.56 MB in, 5.12 MB out (and routing)

TEST_F(MoeClientTest, MessageLimitSizedFromTheServersModelInfo) {
  EXPECT_EQ(client_->max_message_bytes(), kMinMessageBytes);  // nothing asked yet
  EXPECT_EQ(server_->model_info_calls(), 0);
  server_->SetMaxRequestTokens(int64_t{1} << 18);
  const std::vector<float> x = Input(kLargeTokens * FakeMoeServer::kHidden);
  ForwardOptions options;
  options.dtype = moe::v1::BF16;
  options.output_dtype = moe::v1::FP32;
  options.return_routing = true;
  auto y = client_->Forward(1, {kLargeTokens, FakeMoeServer::kHidden}, x.data(), options);
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(y->values.size(), x.size());
  EXPECT_EQ(y->values.back(), Expected({x.back()}, 1, moe::v1::BF16, moe::v1::FP32)[0]);
  EXPECT_EQ(y->routing.expert_ids.size(), static_cast<size_t>(kLargeTokens * 2));
  // The limit is the one the server's info implies, asked once.
  auto info = client_->GetModelInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(client_->max_message_bytes(), MessageLimit(*info));
  EXPECT_EQ(client_->max_message_bytes(), (1 << 18) * FakeMoeServer::kHidden * 4 +
                                              (1 << 18) * FakeMoeServer::kTopK * 12 + (1 << 20));
  EXPECT_EQ(server_->model_info_calls(), 2);  // the sizing and the call above
  ASSERT_TRUE(client_->Forward(2, {1, FakeMoeServer::kHidden}, x.data(), options).ok());
  auto opened = client_->OpenStream();
  ASSERT_TRUE(opened.ok()) << opened.status();
  auto id = (*opened)->Send(3, {kLargeTokens, FakeMoeServer::kHidden}, x.data(), options);
  ASSERT_TRUE(id.ok()) << id.status();
  auto streamed = (*opened)->Receive(*id, absl::Seconds(60));
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  EXPECT_EQ(streamed->values.size(), x.size());
  EXPECT_TRUE((*opened)->Finish().ok());
  EXPECT_EQ(server_->model_info_calls(), 2);  // not asked again
}

TEST_F(MoeClientTest, MessageLimitNeverBelowTheFloor) {
  // The fake's 1024 rows of 8 need 1.1 MiB: the client keeps gRPC's 4 MiB.
  const std::vector<float> x = Input(FakeMoeServer::kHidden);
  ASSERT_TRUE(client_->Forward(1, {1, FakeMoeServer::kHidden}, x.data(), ForwardOptions{}).ok());
  EXPECT_EQ(server_->model_info_calls(), 1);
  EXPECT_EQ(client_->max_message_bytes(), kMinMessageBytes);
}

TEST_F(MoeClientTest, ExplicitMessageLimitIsKept) {
  server_->SetMaxRequestTokens(int64_t{1} << 18);
  ClientOptions fixed;
  fixed.max_message_bytes = kMinMessageBytes;
  auto client = MoeClient::Connect(server_->target(), fixed);
  ASSERT_TRUE(client.ok()) << client.status();
  const std::vector<float> x = Input(kLargeTokens * FakeMoeServer::kHidden);
  ForwardOptions options;
  options.dtype = moe::v1::BF16;
  options.output_dtype = moe::v1::FP32;
  auto y = (*client)->Forward(1, {kLargeTokens, FakeMoeServer::kHidden}, x.data(), options);
  // The server answered; the client refused the answer, as a default gRPC channel does.
  EXPECT_EQ(y.status().code(), absl::StatusCode::kResourceExhausted) << y.status();
  EXPECT_EQ(server_->calls(1), 1);
  EXPECT_EQ(server_->model_info_calls(), 0);
  EXPECT_EQ((*client)->max_message_bytes(), kMinMessageBytes);
  ClientOptions negative;
  negative.max_message_bytes = -1;
  EXPECT_EQ(MoeClient::Connect(server_->target(), negative).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(MoeClientTest, Health) {
  EXPECT_EQ(client_->IsServing().value(), true);
  EXPECT_EQ(client_->IsServing("moe.v1.MoeService").value(), true);
  EXPECT_EQ(client_->IsServing("no.such.Service").status().code(), absl::StatusCode::kNotFound);
  server_->SetServing(false);
  EXPECT_EQ(client_->IsServing().value(), false);
  // Long enough for a first answer even on a loaded TSan run: the message keeps the last one.
  const absl::Status waited = client_->WaitUntilServing(absl::Seconds(1));
  EXPECT_EQ(waited.code(), absl::StatusCode::kDeadlineExceeded) << waited;
  EXPECT_NE(waited.message().find("NOT_SERVING"), absl::string_view::npos) << waited;

  std::thread flip([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    server_->SetServing(true);
  });
  EXPECT_TRUE(client_->WaitUntilServing(absl::Seconds(10)).ok());
  flip.join();
  EXPECT_EQ(client_->IsServing().value(), true);
}

TEST(MoeClientNoServerTest, UnavailableWhenNothingListens) {
  // A port that was just free: start a server, note its port, stop it.
  std::string target;
  {
    auto server = FakeMoeServer::Start();
    ASSERT_NE(server, nullptr);
    target = server->target();
  }
  auto client = MoeClient::Connect(target, ClientOptions{});
  ASSERT_TRUE(client.ok());
  EXPECT_EQ((*client)->IsServing().status().code(), absl::StatusCode::kUnavailable);
  const std::vector<float> x = Input(FakeMoeServer::kHidden);
  EXPECT_EQ((*client)->Forward(1, {1, 8}, x.data(), ForwardOptions{}).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ((*client)->WaitUntilServing(absl::Milliseconds(300)).code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST_F(MoeClientTest, ConcurrentCallersEachGetTheirOwnResult) {
  constexpr int kCallers = 16, kRounds = 10;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < kCallers; ++c) {
    threads.emplace_back([&, c] {
      const int64_t tokens = 1 + c % 4;
      const std::vector<float> x = Input(tokens * FakeMoeServer::kHidden, 10.0f * c);
      ForwardOptions options;
      options.dtype = c % 2 ? moe::v1::BF16 : moe::v1::FP32;
      options.return_routing = true;
      for (int r = 0; r < kRounds; ++r) {
        const int layer = 1 + (c + r) % 3;
        auto y = client_->Forward(layer, {tokens, FakeMoeServer::kHidden}, x.data(), options);
        if (!y.ok() || y->values != Expected(x, layer, options.dtype, options.dtype) ||
            y->routing.expert_ids.size() != static_cast<size_t>(tokens * 2) ||
            y->routing.expert_ids[0] != layer)
          failures++;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(server_->total_calls(), kCallers * kRounds);
}

TEST_F(MoeClientTest, StreamMatchesOutOfOrderResponsesAndPerRequestErrors) {
  auto opened = client_->OpenStream();
  ASSERT_TRUE(opened.ok()) << opened.status();
  ForwardStreamSession& session = **opened;
  const std::vector<int64_t> shape = {2, FakeMoeServer::kHidden};
  const std::vector<float> xa = Input(16, 1.0f), xb = Input(16, 2.0f), xd = Input(16, 3.0f);

  ForwardOptions options;
  options.request_id = "a";
  ASSERT_EQ(session.Send(FakeMoeServer::kHeldLayer, shape, xa.data(), options).value(), "a");
  // The same id again while "a" is in flight is refused.
  EXPECT_EQ(session.Send(1, shape, xa.data(), options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.request_id = "b";
  ASSERT_EQ(session.Send(1, shape, xb.data(), options).value(), "b");
  options.request_id = "c";
  ASSERT_EQ(session.Send(-7, shape, xb.data(), options).value(), "c");
  options.request_id = "";
  options.return_routing = true;
  auto d = session.Send(2, shape, xd.data(), options);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->empty());

  // "b" overtakes "a", which the server holds back until released.
  auto b = session.Receive("b");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->values, Expected(xb, 1, moe::v1::FP32, moe::v1::FP32));
  EXPECT_EQ(b->request_id, "b");
  auto c = session.Receive("c");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(), "layer must be >= 0, got -7");
  auto dr = session.Receive(*d);
  ASSERT_TRUE(dr.ok()) << dr.status();
  EXPECT_EQ(dr->values, Expected(xd, 2, moe::v1::FP32, moe::v1::FP32));
  EXPECT_EQ(dr->routing.top_k, 2);
  EXPECT_EQ(session.Receive("a", absl::ZeroDuration()).status().code(),
            absl::StatusCode::kDeadlineExceeded);

  server_->ReleaseHeld();
  auto a = session.Receive("a", absl::Seconds(10));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->values, Expected(xa, FakeMoeServer::kHeldLayer, moe::v1::FP32, moe::v1::FP32));
  // Received once; a second Receive has nothing to wait for.
  EXPECT_EQ(session.Receive("a").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(session.Finish().ok());
  EXPECT_EQ(session.Send(1, shape, xa.data(), ForwardOptions{}).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(MoeClientTest, StreamSharedByConcurrentCallers) {
  auto opened = client_->OpenStream();
  ASSERT_TRUE(opened.ok()) << opened.status();
  ForwardStreamSession& session = **opened;
  constexpr int kCallers = 8, kRounds = 10;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < kCallers; ++c) {
    threads.emplace_back([&, c] {
      const std::vector<float> x = Input(FakeMoeServer::kHidden, 5.0f * c);
      for (int r = 0; r < kRounds; ++r) {
        const int layer = 1 + (c + r) % 3;
        auto id = session.Send(layer, {1, FakeMoeServer::kHidden}, x.data(), ForwardOptions{});
        if (!id.ok()) {
          failures++;
          continue;
        }
        auto y = session.Receive(*id, absl::Seconds(30));
        if (!y.ok() || y->values != Expected(x, layer, moe::v1::FP32, moe::v1::FP32)) failures++;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_TRUE(session.Finish().ok());
  EXPECT_EQ(server_->total_calls(), kCallers * kRounds);
}

TEST_F(MoeClientTest, StreamDeadlineEndsPendingReceives) {
  auto opened = client_->OpenStream(absl::Milliseconds(300));
  ASSERT_TRUE(opened.ok());
  const std::vector<float> x = Input(FakeMoeServer::kHidden);
  auto id = (*opened)->Send(FakeMoeServer::kSlowLayer, {1, FakeMoeServer::kHidden}, x.data(),
                            ForwardOptions{});
  // On a slow (sanitizer) run the deadline may pass before the Send: the same verdict.
  const absl::Status status = id.ok() ? (*opened)->Receive(*id).status() : id.status();
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_EQ((*opened)->Finish().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST_F(MoeClientTest, StreamDestroyedWithRequestsInFlight) {
  auto opened = client_->OpenStream();
  ASSERT_TRUE(opened.ok());
  const std::vector<float> x = Input(FakeMoeServer::kHidden);
  ASSERT_TRUE(
      (*opened)
          ->Send(FakeMoeServer::kSlowLayer, {1, FakeMoeServer::kHidden}, x.data(), ForwardOptions{})
          .ok());
  const auto t0 = std::chrono::steady_clock::now();
  opened->reset();  // cancels; must not wait for the slow layer
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

}  // namespace
}  // namespace moe

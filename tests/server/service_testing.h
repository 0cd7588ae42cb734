// What the service tests share: random inputs, one Forward call, the in-process reference.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/local_layer.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "model/checkpoint.h"
#include "moe/v1/moe.grpc.pb.h"
#include "proto/tensor_codec.h"

namespace moe {

inline std::vector<float> RandomInput(int64_t tokens, int64_t hidden, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(tokens * hidden);
  for (float& v : x) v = normal(rng);
  return x;
}

struct CallResult {
  grpc::Status status;
  std::vector<float> output;
  std::vector<int32_t> expert_ids;
};

inline CallResult Call(moe::v1::MoeService::Stub& stub, int layer, const std::vector<float>& x,
                       std::vector<int64_t> shape, absl::Duration timeout = absl::Seconds(60),
                       moe::v1::DType dtype = moe::v1::FP32,
                       grpc::ClientContext* context_in = nullptr) {
  moe::v1::ForwardRequest request;
  request.set_layer(layer);
  request.set_return_routing(true);
  request.set_output_dtype(moe::v1::FP32);
  EXPECT_TRUE(EncodeTensor(x.data(), shape, dtype, request.mutable_hidden_states()).ok());
  grpc::ClientContext local;
  grpc::ClientContext* context = context_in ? context_in : &local;
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  moe::v1::ForwardResponse response;
  CallResult out;
  out.status = stub.Forward(context, request, &response);
  if (out.status.ok()) {
    auto decoded = DecodeTensor(response.output());
    EXPECT_TRUE(decoded.ok());
    EXPECT_EQ(decoded->shape, shape);
    out.output = decoded->values;
    out.expert_ids.assign(response.routing().expert_ids().begin(),
                          response.routing().expert_ids().end());
  }
  return out;
}

// The in-process reference for a checkpoint layer.
class InProcess {
 public:
  InProcess(const std::string& dir, int layer) : backend_(CpuBackendOptions{1, ""}) {
    checkpoint_ = std::move(*Checkpoint::Open(dir));
    layer_ = std::move(*LocalMoeLayer::Load(
        *checkpoint_, layer,
        ExpertPlacement::Contiguous(checkpoint_->config().routing.num_experts, 1), &backend_));
  }
  std::vector<float> Forward(const std::vector<float>& x, Routing* routing = nullptr) {
    std::vector<float> y(x.size());
    EXPECT_TRUE(layer_
                    ->Forward(x.data(), x.size() / checkpoint_->config().hidden_size,
                              Precision::kBF16, y.data(), routing)
                    .ok());
    return y;
  }
  const MoeConfig& config() const { return checkpoint_->config(); }

 private:
  CpuBackend backend_;
  std::unique_ptr<Checkpoint> checkpoint_;
  std::unique_ptr<LocalMoeLayer> layer_;
};

inline double RelL2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

// Callers kept busy on one layer until Stop(): each call sends one of `inputs` ([tokens, H]
// each) and its output must equal `expected` bit for bit. Counts what happened, and the slowest
// call and latency percentiles.
class BusyCallers {
 public:
  BusyCallers(moe::v1::MoeService::Stub& stub, int layer,
              const std::vector<std::vector<float>>& inputs,
              const std::vector<std::vector<float>>& expected, int64_t tokens, int64_t hidden,
              int callers)
      : inputs_(inputs), expected_(expected) {
    for (int c = 0; c < callers; ++c)
      threads_.emplace_back([=, &stub] {
        for (int i = c; !stop_; i += callers) {
          const size_t which = static_cast<size_t>(i) % inputs_.size();
          const absl::Time t0 = absl::Now();
          CallResult r = Call(stub, layer, inputs_[which], {tokens, hidden}, absl::Seconds(20));
          const absl::Duration took = absl::Now() - t0;
          std::lock_guard<std::mutex> lock(mu_);
          samples_.push_back({t0, took});
          if (!r.status.ok()) {
            ++failed_;
            if (first_error_.empty()) first_error_ = r.status.error_message();
          } else if (r.output != expected_[which]) {
            ++wrong_;
          } else {
            ++ok_;
          }
        }
      });
  }
  ~BusyCallers() { Stop(); }
  void Stop() {
    stop_ = true;
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }
  // Waits until `n` calls succeeded (false: `timeout` passed first).
  bool WaitForOk(int n, absl::Duration timeout) const {
    const absl::Time end = absl::Now() + timeout;
    while (ok_ < n) {
      if (absl::Now() > end) return false;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return true;
  }
  int ok() const { return ok_; }
  int failed() const { return failed_; }
  int wrong() const { return wrong_; }
  const std::string& first_error() const { return first_error_; }
  // After Stop(): the q-quantile of the latencies (1.0: the slowest) of the calls that started
  // in [from, to).
  absl::Duration Latency(double q, absl::Time from = absl::InfinitePast(),
                         absl::Time to = absl::InfiniteFuture()) const {
    std::vector<absl::Duration> v;
    for (const Sample& sample : samples_)
      if (sample.start >= from && sample.start < to) v.push_back(sample.took);
    if (v.empty()) return absl::ZeroDuration();
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
  }
  int64_t Calls(absl::Time from, absl::Time to) const {
    int64_t n = 0;
    for (const Sample& sample : samples_) n += sample.start >= from && sample.start < to;
    return n;
  }

 private:
  const std::vector<std::vector<float>>& inputs_;
  const std::vector<std::vector<float>>& expected_;
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::atomic<int> ok_{0}, failed_{0}, wrong_{0};
  std::string first_error_;
  struct Sample {
    absl::Time start;
    absl::Duration took;
  };
  std::vector<Sample> samples_;
};

}  // namespace moe

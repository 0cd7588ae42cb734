#include "tests/client/fake_moe_service.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/health_check_service_interface.h"
#include "proto/tensor_codec.h"

namespace moe {
namespace fake {

class FakeMoeService final : public moe::v1::MoeService::Service {
 public:
  grpc::Status Forward(grpc::ServerContext* context, const moe::v1::ForwardRequest* request,
                       moe::v1::ForwardResponse* response) override {
    return Compute(context, *request, response);
  }

  // Every request runs on its own thread, so the answers leave in completion order.
  grpc::Status ForwardStream(grpc::ServerContext* context,
                             grpc::ServerReaderWriter<moe::v1::ForwardResponse,
                                                      moe::v1::ForwardRequest>* stream) override {
    std::mutex write_mu;
    std::vector<std::thread> workers;
    moe::v1::ForwardRequest request;
    while (stream->Read(&request)) {
      workers.emplace_back([this, context, stream, &write_mu, request] {
        moe::v1::ForwardResponse response;
        const grpc::Status status = Compute(context, request, &response);
        if (!status.ok()) {
          response.Clear();
          response.mutable_error()->set_code(status.error_code());
          response.mutable_error()->set_message(status.error_message());
        }
        response.set_request_id(request.request_id());
        std::lock_guard<std::mutex> lock(write_mu);
        stream->Write(response);
      });
    }
    for (std::thread& t : workers) t.join();
    return grpc::Status::OK;
  }

  grpc::Status GetModelInfo(grpc::ServerContext*, const moe::v1::GetModelInfoRequest*,
                            moe::v1::ModelInfo* info) override {
    model_info_calls_++;
    info->set_family("kimi_k3");
    info->set_model_type("kimi_k3");
    for (int layer : {1, 2, 3}) info->add_layers(layer);
    info->set_hidden_size(FakeMoeServer::kHidden);
    info->set_latent_size(4);
    info->set_expert_hidden_size(6);
    info->set_num_experts(FakeMoeServer::kExperts);
    info->set_top_k(FakeMoeServer::kTopK);
    info->set_num_shared_experts(2);
    info->set_expert_format("mxfp4");
    info->set_dense_format("bf16");
    info->set_precision("bf16");
    info->set_transport("grpc");
    info->set_max_tokens_per_step(4096);
    info->set_max_request_tokens(max_request_tokens_.load());
    info->set_checkpoint("/fake/checkpoint");
    for (int r = 0; r < 2; ++r) {
      moe::v1::RankInfo* rank = info->add_ranks();
      rank->set_rank(r);
      rank->set_address("127.0.0.1");
      rank->set_ready(true);
      rank->set_backend("fake");
      rank->set_weight_bytes(int64_t{3} << 30);
      for (int e = r * 32; e < (r + 1) * 32; ++e) rank->add_experts(e);
    }
    moe::v1::BiasOverride* bias = info->add_bias_overrides();
    bias->set_layer(2);
    bias->set_source("quantile-balancing");
    bias->set_installed_at("2025-01-01T00:00:00Z");
    return grpc::Status::OK;
  }

  void SetMaxRequestTokens(int64_t tokens) { max_request_tokens_ = tokens; }
  int64_t model_info_calls() const { return model_info_calls_; }

  void ReleaseHeld() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }

  int64_t calls(int layer) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = calls_.find(layer);
    return it == calls_.end() ? 0 : it->second;
  }

  int64_t total_calls() const {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t n = 0;
    for (const auto& [layer, count] : calls_) n += count;
    return n;
  }

 private:
  grpc::Status Compute(grpc::ServerContext* context, const moe::v1::ForwardRequest& request,
                       moe::v1::ForwardResponse* response) {
    const int layer = request.layer();
    {
      std::lock_guard<std::mutex> lock(mu_);
      calls_[layer]++;
    }
    if (layer < 0)
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("layer must be >= 0, got ", layer));
    if (layer == FakeMoeServer::kUnservedLayer)
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "layer 404 is not served (served: 1, 2, 3)");
    if (layer == FakeMoeServer::kBusyLayer)
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          "queue full: 1 requests waiting, limit 0");
    if (layer == FakeMoeServer::kUnavailableLayer)
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "ranks not ready (0 of 2)");
    if (layer == FakeMoeServer::kSlowLayer) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (!context->IsCancelled() && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      if (context->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    }
    if (layer == FakeMoeServer::kHeldLayer) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::seconds(10), [this] { return released_; });
    }

    absl::StatusOr<HostTensor> x = DecodeTensor(request.hidden_states(), "hidden_states");
    if (!x.ok())
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(x.status().message()));
    if ((x->shape.size() != 2 && x->shape.size() != 3) || x->shape.back() != FakeMoeServer::kHidden)
      return grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat("hidden_states: hidden size must be ", FakeMoeServer::kHidden, ", got ",
                       x->shape.empty() ? 0 : x->shape.back()));
    std::vector<float> y(x->values.size());
    for (size_t i = 0; i < y.size(); ++i) y[i] = 2.0f * x->values[i] + static_cast<float>(layer);
    const moe::v1::DType out_dtype = request.output_dtype() == moe::v1::DTYPE_UNSPECIFIED
                                         ? request.hidden_states().dtype()
                                         : request.output_dtype();
    absl::Status s = EncodeTensor(y.data(), x->shape, out_dtype, response->mutable_output());
    if (!s.ok()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(s.message()));

    const int64_t tokens = x->num_elements() / FakeMoeServer::kHidden;
    if (request.return_routing()) {
      moe::v1::Routing* routing = response->mutable_routing();
      routing->set_top_k(FakeMoeServer::kTopK);
      for (int64_t t = 0; t < tokens; ++t) {
        routing->add_expert_ids(static_cast<int32_t>((layer + t) % FakeMoeServer::kExperts));
        routing->add_expert_ids(static_cast<int32_t>((layer + t + 17) % FakeMoeServer::kExperts));
        routing->add_weights(0.75f);
        routing->add_weights(0.25f);
      }
    }
    response->set_request_id(request.request_id());
    response->mutable_timing()->set_queue_us(7);
    response->mutable_timing()->set_step_us(100 + tokens);
    response->mutable_timing()->set_step_tokens(static_cast<int32_t>(tokens));
    return grpc::Status::OK;
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool released_ = false;
  std::map<int, int64_t> calls_;
  std::atomic<int64_t> max_request_tokens_{1024};
  std::atomic<int64_t> model_info_calls_{0};
};

std::unique_ptr<FakeMoeServer> FakeMoeServer::Start() {
  std::unique_ptr<FakeMoeServer> fake(new FakeMoeServer());
  fake->service_ = std::make_unique<FakeMoeService>();
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &fake->port_);
  builder.RegisterService(fake->service_.get());
  builder.SetMaxReceiveMessageSize(64 << 20);
  fake->server_ = builder.BuildAndStart();
  if (fake->server_ == nullptr || fake->port_ == 0) {
    std::fprintf(stderr, "FakeMoeServer: cannot start on 127.0.0.1:0\n");
    return nullptr;
  }
  fake->SetServing(true);
  return fake;
}

FakeMoeServer::~FakeMoeServer() {
  if (server_ == nullptr) return;
  ReleaseHeld();
  // Calls still running (the slow layer) are cancelled at the deadline.
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  server_->Wait();
}

void FakeMoeServer::SetServing(bool serving) {
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  health->SetServingStatus(serving);
  health->SetServingStatus("moe.v1.MoeService", serving);
}

void FakeMoeServer::ReleaseHeld() { service_->ReleaseHeld(); }
void FakeMoeServer::SetMaxRequestTokens(int64_t tokens) { service_->SetMaxRequestTokens(tokens); }
int64_t FakeMoeServer::model_info_calls() const { return service_->model_info_calls(); }
int64_t FakeMoeServer::calls(int layer) const { return service_->calls(layer); }
int64_t FakeMoeServer::total_calls() const { return service_->total_calls(); }

}  // namespace fake
}  // namespace moe

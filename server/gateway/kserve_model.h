// The Open Inference Protocol's operations on a gateway, whatever carries them: the gRPC service
// (kserve_service.h) and the HTTP/REST one (kserve_http.h) translate and call these, so both
// answer the same questions the same way, with the same codes, metrics and batching.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "inference/grpc_service.pb.h"
#include "server/gateway/gateway.h"
#include "server/gateway/services.h"

namespace moe {

class KServeModels {
 public:
  explicit KServeModels(Gateway* gateway) : gateway_(gateway) {}

  // Ready and not draining (server readiness).
  bool Serving() const;
  // NOT_FOUND unless `name`/`version` is a model of a served layer; the layer otherwise.
  absl::StatusOr<int> ServedLayer(const std::string& name, const std::string& version) const;
  // A question, not a lookup: an unknown model is not ready (no error, as probes expect).
  bool ModelReady(const std::string& name, const std::string& version) const;

  void ServerMetadata(inference::ServerMetadataResponse* response) const;
  absl::Status ModelMetadata(const std::string& name, const std::string& version,
                             inference::ModelMetadataResponse* response) const;
  absl::Status ModelConfig(const std::string& name, const std::string& version,
                           inference::ModelConfigResponse* response) const;
  // Every served model when `name` is empty.
  absl::Status Statistics(const std::string& name, const std::string& version,
                          inference::ModelStatisticsResponse* response) const;
  void RepositoryIndex(bool ready_only, inference::RepositoryIndexResponse* response) const;

  // One inference: a request slot (drain sees it), the translation, RunForward, the translation
  // back, and the request's metrics.
  absl::Status Infer(const CallerWait& caller, const inference::ModelInferRequest& request,
                     inference::ModelInferResponse* response);
  // A request for `model` refused before Infer (by a front end's own checks of its body),
  // counted in the metrics as Infer counts its refusals; returns `status`.
  absl::Status Refuse(const std::string& model, absl::Status status, absl::Duration latency);

 private:
  Gateway* gateway_;
};

}  // namespace moe

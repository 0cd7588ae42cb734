#include "server/gateway/kserve_http.h"

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "CivetServer.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/status.h"
#include "server/gateway/kserve_json.h"
#include "server/gateway/kserve_model.h"
#include "server/http/civet_listener.h"

namespace moe {
namespace {

// A parsed /v2/... path: the model (and version) it names, and what is asked of it.
struct Route {
  enum Kind {
    kServerMetadata,  // GET  /v2
    kLive,            // GET  /v2/health/live
    kReady,           // GET  /v2/health/ready
    kModelMetadata,   // GET  /v2/models/M[/versions/V]
    kModelReady,      // GET  .../ready
    kInfer,           // POST .../infer
    kConfig,          // GET  .../config
    kStatistics,      // GET  .../stats, or /v2/models/stats for every model
    kRepositoryIndex  // POST /v2/repository/index
  } kind;
  std::string model, version;
  bool post() const { return kind == kInfer || kind == kRepositoryIndex; }
  // Health is open, as on gRPC: probes carry no secrets.
  bool open() const { return kind == kLive || kind == kReady || kind == kModelReady; }
};

std::optional<Route> ParseRoute(absl::string_view path) {
  if (path != "/v2" && !absl::ConsumePrefix(&path, "/v2/")) return std::nullopt;
  if (path == "/v2" || path.empty()) return Route{Route::kServerMetadata, "", ""};
  const std::vector<std::string> parts = absl::StrSplit(path, '/');
  if (parts == std::vector<std::string>{"health", "live"}) return Route{Route::kLive, "", ""};
  if (parts == std::vector<std::string>{"health", "ready"}) return Route{Route::kReady, "", ""};
  if (parts == std::vector<std::string>{"repository", "index"})
    return Route{Route::kRepositoryIndex, "", ""};
  if (parts == std::vector<std::string>{"models", "stats"})
    return Route{Route::kStatistics, "", ""};
  if (parts.size() < 2 || parts[0] != "models" || parts[1].empty()) return std::nullopt;
  Route route{Route::kModelMetadata, parts[1], ""};
  size_t next = 2;
  if (parts.size() >= 4 && parts[2] == "versions") {
    route.version = parts[3];
    next = 4;
  }
  if (parts.size() == next) return route;
  if (parts.size() != next + 1) return std::nullopt;
  const std::string& action = parts[next];
  if (action == "ready")
    route.kind = Route::kModelReady;
  else if (action == "infer")
    route.kind = Route::kInfer;
  else if (action == "config")
    route.kind = Route::kConfig;
  else if (action == "stats")
    route.kind = Route::kStatistics;
  else
    return std::nullopt;
  return route;
}

const char* MethodName(Route::Kind kind) {
  switch (kind) {
    case Route::kServerMetadata:
      return "REST ServerMetadata";
    case Route::kModelMetadata:
      return "REST ModelMetadata";
    case Route::kInfer:
      return "REST ModelInfer";
    case Route::kConfig:
      return "REST ModelConfig";
    case Route::kStatistics:
      return "REST ModelStatistics";
    case Route::kRepositoryIndex:
      return "REST RepositoryIndex";
    default:
      return "REST health";
  }
}

void RespondJson(mg_connection* conn, int code, const std::string& body) {
  RespondHttp(conn, code, "application/json", body);
}

void RespondError(mg_connection* conn, const absl::Status& status) {
  std::vector<std::pair<std::string, std::string>> headers;
  if (status.code() == absl::StatusCode::kUnauthenticated)
    headers.emplace_back("WWW-Authenticate", "Bearer");
  RespondHttp(conn, HttpStatusOf(status.code()), "application/json", RestError(status.message()),
              headers);
}

// The whole body, of the length the headers declared (already checked against the limit).
absl::StatusOr<std::string> ReadBody(mg_connection* conn, int64_t length) {
  std::string body(static_cast<size_t>(length), '\0');
  size_t done = 0;
  while (done < body.size()) {
    const int n = mg_read(conn, body.data() + done, body.size() - done);
    if (n <= 0)
      return absl::InvalidArgumentError(
          absl::StrCat("the body ended after ", done, " of ", length, " bytes"));
    done += static_cast<size_t>(n);
  }
  return body;
}

}  // namespace

class KServeHttpServer::Handler final : public CivetHandler {
 public:
  Handler(Gateway* gateway, int64_t max_body)
      : gateway_(gateway), models_(gateway), max_body_(max_body) {}

  bool handleGet(CivetServer*, mg_connection* conn) override { return Serve(conn, false); }
  bool handlePost(CivetServer*, mg_connection* conn) override { return Serve(conn, true); }
  bool handleHead(CivetServer*, mg_connection* conn) override { return NotAllowed(conn); }
  bool handlePut(CivetServer*, mg_connection* conn) override { return NotAllowed(conn); }
  bool handleDelete(CivetServer*, mg_connection* conn) override { return NotAllowed(conn); }
  bool handleOptions(CivetServer*, mg_connection* conn) override { return NotAllowed(conn); }
  bool handlePatch(CivetServer*, mg_connection* conn) override { return NotAllowed(conn); }

 private:
  bool NotAllowed(mg_connection* conn) {
    RespondHttp(conn, 405, "application/json",
                RestError("the Open Inference Protocol's endpoints take GET or POST"));
    return true;
  }

  bool Serve(mg_connection* conn, bool post) {
    const mg_request_info* info = mg_get_request_info(conn);
    const std::optional<Route> route = ParseRoute(info->local_uri ? info->local_uri : "");
    if (!route.has_value()) {
      RespondError(conn, absl::NotFoundError(
                             "no such endpoint (the Open Inference Protocol's paths are under "
                             "/v2: health/live, health/ready, models/<model>[/infer|/ready|"
                             "/config|/stats], repository/index)"));
      return true;
    }
    if (route->post() != post) {
      RespondHttp(conn, 405, "application/json",
                  RestError(absl::StrCat("this endpoint takes ", route->post() ? "POST" : "GET")),
                  {{"Allow", route->post() ? "POST" : "GET"}});
      return true;
    }
    if (!route->open()) {
      const char* authorization = mg_get_header(conn, "Authorization");
      const std::string peer = absl::StrCat(info->remote_addr, ":", info->remote_port);
      if (absl::Status s = gateway_->access().HttpCaller(authorization ? authorization : "", peer,
                                                         MethodName(route->kind));
          !s.ok()) {
        RespondError(conn, s);
        return true;
      }
    }
    std::string body;
    if (post) {
      // No Content-Length and no Transfer-Encoding is an empty body (RFC 9112 6.3).
      const bool chunked = mg_get_header(conn, "Transfer-Encoding") != nullptr;
      if (info->content_length < 0 && chunked) {
        RespondHttp(conn, 411, "application/json",
                    RestError("a Content-Length is required (no chunked bodies)"));
        return true;
      }
      if (info->content_length > max_body_) {
        RespondHttp(
            conn, 413, "application/json",
            RestError(absl::StrCat("the body is ", info->content_length, " bytes; the limit is ",
                                   max_body_, " (--max-request-bytes)")));
        return true;
      }
      absl::StatusOr<std::string> read = ReadBody(conn, std::max<int64_t>(0, info->content_length));
      if (!read.ok()) {
        RespondError(conn, read.status());
        return true;
      }
      body = *std::move(read);
    }
    Answer(conn, *route, body);
    return true;
  }

  void Answer(mg_connection* conn, const Route& route, const std::string& body) {
    switch (route.kind) {
      case Route::kLive:
        RespondJson(conn, 200, "{\"live\":true}");
        return;
      case Route::kReady: {
        const bool ready = models_.Serving();
        RespondJson(conn, ready ? 200 : 503, ready ? "{\"ready\":true}" : "{\"ready\":false}");
        return;
      }
      case Route::kModelReady: {
        const bool ready = models_.ModelReady(route.model, route.version);
        RespondJson(conn, ready ? 200 : 503, ready ? "{\"ready\":true}" : "{\"ready\":false}");
        return;
      }
      case Route::kServerMetadata: {
        inference::ServerMetadataResponse metadata;
        models_.ServerMetadata(&metadata);
        RespondJson(conn, 200, RestServerMetadata(metadata));
        return;
      }
      case Route::kModelMetadata: {
        inference::ModelMetadataResponse metadata;
        const absl::Status s = models_.ModelMetadata(route.model, route.version, &metadata);
        if (!s.ok()) return RespondError(conn, s);
        RespondJson(conn, 200, RestModelMetadata(metadata));
        return;
      }
      case Route::kConfig: {
        inference::ModelConfigResponse config;
        const absl::Status s = models_.ModelConfig(route.model, route.version, &config);
        if (!s.ok()) return RespondError(conn, s);
        RespondJson(conn, 200, RestModelConfig(config.config()));
        return;
      }
      case Route::kStatistics: {
        inference::ModelStatisticsResponse statistics;
        const absl::Status s = models_.Statistics(route.model, route.version, &statistics);
        if (!s.ok()) return RespondError(conn, s);
        RespondJson(conn, 200, RestStatistics(statistics));
        return;
      }
      case Route::kRepositoryIndex: {
        absl::StatusOr<bool> ready_only = ParseRestRepositoryIndexReadyOnly(body);
        if (!ready_only.ok()) return RespondError(conn, ready_only.status());
        inference::RepositoryIndexResponse index;
        models_.RepositoryIndex(*ready_only, &index);
        RespondJson(conn, 200, RestRepositoryIndex(index));
        return;
      }
      case Route::kInfer:
        return Infer(conn, route, body);
    }
  }

  void Infer(mg_connection* conn, const Route& route, const std::string& body) {
    // The model before the body, as gRPC's ModelInfer answers NOT_FOUND before looking inside.
    if (absl::StatusOr<int> layer = models_.ServedLayer(route.model, route.version); !layer.ok())
      return RespondError(conn, models_.Refuse(route.model, layer.status(), absl::ZeroDuration()));
    std::optional<size_t> json_length;
    if (const char* header = mg_get_header(conn, kInferenceHeaderLength); header != nullptr) {
      size_t length = 0;
      if (!absl::SimpleAtoi(header, &length))
        return RespondError(
            conn, models_.Refuse(route.model,
                                 absl::InvalidArgumentError(
                                     absl::StrCat(kInferenceHeaderLength, " is not a byte count")),
                                 absl::ZeroDuration()));
      json_length = length;
    }
    // A DOM of JSON numbers takes up to ~16x the text: a few decodes at a time bound it.
    decode_mu_.LockWhen(absl::Condition(
        +[](int* decoding) { return *decoding < kMaxJsonDecodes; }, &decoding_));
    ++decoding_;
    decode_mu_.Unlock();
    const absl::Time start = absl::Now();
    absl::StatusOr<inference::ModelInferRequest> request =
        ParseRestInferRequest(route.model, route.version, body, json_length);
    decode_mu_.Lock();
    --decoding_;
    decode_mu_.Unlock();
    if (!request.ok())
      return RespondError(conn, models_.Refuse(route.model, request.status(), absl::Now() - start));
    inference::ModelInferResponse response;
    // No cancellation: civetweb does not tell a handler that its client went away; the step's
    // deadline and the gateway's limits bound what a vanished client costs.
    const absl::Status s = models_.Infer(CallerWait{}, *request, &response);
    if (!s.ok()) return RespondError(conn, s);
    RestBody rest = FormatRestInferResponse(*request, response);
    if (!rest.json_length.has_value()) return RespondJson(conn, 200, rest.body);
    RespondHttp(conn, 200, "application/octet-stream", rest.body,
                {{kInferenceHeaderLength, absl::StrCat(*rest.json_length)}});
  }

  Gateway* gateway_;
  KServeModels models_;
  const int64_t max_body_;
  absl::Mutex decode_mu_;
  int decoding_ = 0;  // guarded by decode_mu_
};

absl::StatusOr<std::unique_ptr<KServeHttpServer>> KServeHttpServer::Start(
    Gateway* gateway, const RestOptions& options) {
  const std::vector<std::string> civet_options = {
      "listening_ports",       options.address,
      "num_threads",           std::to_string(options.threads),
      "request_timeout_ms",    std::to_string(kRequestTimeoutMs),
      "enable_keep_alive",     "yes",
      "keep_alive_timeout_ms", std::to_string(kKeepAliveTimeoutMs)};
  auto server = std::unique_ptr<KServeHttpServer>(new KServeHttpServer());
  server->handler_ = std::make_unique<Handler>(gateway, gateway->RequestLimit());
  ASSIGN_OR_RETURN(server->listener_,
                   CivetListener::Start(civet_options, options.address, "the REST API"));
  server->listener_->server().addHandler("/v2", server->handler_.get());
  return server;
}

KServeHttpServer::~KServeHttpServer() = default;

int KServeHttpServer::port() const { return listener_->port(); }

}  // namespace moe

// Unary methods whose request message is read only once the caller is admitted.
//
// For an ordinary unary method gRPC reads the whole request before the handler runs: a caller
// without a token could make the gateway buffer up to the message limit before being refused.
// Registered as "streamed unary" (the generated WithStreamedUnaryMethod_*), the handler runs on
// the initial metadata alone: the admission check (a token, a rank's proof) comes first, and
// the message is read only after it passed. The transport then holds no more of a refused
// call's message than its flow-control window.
//
// A request that does not parse gets INVALID_ARGUMENT naming the message type (an ordinary unary
// method answers INTERNAL with no message); an oversized one is refused by gRPC itself while it
// is read (RESOURCE_EXHAUSTED).
#pragma once

#include <string>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "server/grpc_status.h"

namespace moe {

// Runs `admit()`; if it passes, reads the request and answers it with `handle(request,
// &response)`.
template <class Request, class Response, class Admit, class Handle>
grpc::Status ReadAfterAdmission(grpc::ServerContext& context,
                                grpc::ServerUnaryStreamer<Request, Response>& stream, Admit&& admit,
                                Handle&& handle) {
  if (grpc::Status s = admit(); !s.ok()) return s;
  Request request;
  if (!stream.Read(&request)) {
    if (context.IsCancelled())
      return ToGrpcStatus(absl::CancelledError("the client cancelled the request"));
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "the request is not a valid ", Request::descriptor()->full_name(), " message")));
  }
  Response response;
  grpc::Status status = handle(request, &response);
  // WriteLast holds the message back and sends it in one batch with the status, as an ordinary
  // unary method does. A plain Write would send headers and message first: a gateway that hangs
  // between the two leaves the call committed (headers received), so the failover client could
  // not retry it on another gateway.
  if (status.ok()) stream.WriteLast(response, grpc::WriteOptions());
  return status;
}

}  // namespace moe

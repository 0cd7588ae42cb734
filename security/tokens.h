// Shared secrets on gRPC calls: `authorization: Bearer <token>` metadata, read from files
// (Kubernetes secrets, `openssl rand -hex 32 > token`) and compared in constant time.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace moe {

// The token in `path`: its content without surrounding whitespace. Errors name the file: it
// cannot be read, is empty, or is longer than 4 KiB (a token, not a document).
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// Equal strings, in time that depends only on the length of `presented`: an attacker who
// times the comparison learns nothing about `expected` but, at most, its length.
bool TokensEqual(absl::string_view presented, absl::string_view expected);

// Adds `authorization: Bearer <token>` to a call (nothing when `token` is empty). Per call, not
// as channel call-credentials, which gRPC refuses to send over plaintext; without TLS the token
// is only as secret as the network.
void AddBearerToken(grpc::ClientContext* context, const std::string& token);

// The value of metadata `key` (lowercase) of an incoming call, "" when absent.
std::string MetadataValue(const grpc::ServerContext& context, absl::string_view key);

// Checks an "authorization" value ("Bearer <token>": gRPC metadata or an HTTP header) against
// `expected` (no check when it is empty). UNAUTHENTICATED, naming `what` ("API token"), when the
// token is missing or wrong.
absl::Status CheckBearer(absl::string_view authorization, const std::string& expected,
                         absl::string_view what);

}  // namespace moe

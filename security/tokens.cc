#include "security/tokens.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace moe {
namespace {
constexpr size_t kMaxTokenBytes = 4096;
constexpr absl::string_view kBearer = "Bearer ";
}  // namespace

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read token file ", path));
  std::string content;
  content.resize(kMaxTokenBytes + 1);
  in.read(content.data(), static_cast<std::streamsize>(content.size()));
  content.resize(static_cast<size_t>(in.gcount()));
  if (content.size() > kMaxTokenBytes)
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", path, " is longer than ", kMaxTokenBytes, " bytes"));
  std::string token(absl::StripAsciiWhitespace(content));
  if (token.empty())
    return absl::InvalidArgumentError(absl::StrCat("token file ", path, " is empty"));
  for (char c : token)
    if (c < 0x21 || c > 0x7e)  // gRPC metadata values must be printable ASCII
      return absl::InvalidArgumentError(absl::StrCat(
          "token file ", path,
          " holds a non-printable or space character (use e.g. `openssl rand -hex 32`)"));
  return token;
}

bool TokensEqual(absl::string_view presented, absl::string_view expected) {
  // Every byte of `presented` is compared (against a zero past the end of `expected`), and
  // differences are OR-ed, never branched on.
  unsigned char diff = presented.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < presented.size(); ++i) {
    const unsigned char e = i < expected.size() ? static_cast<unsigned char>(expected[i]) : 0;
    diff |= static_cast<unsigned char>(static_cast<unsigned char>(presented[i]) ^ e);
  }
  return diff == 0 && !expected.empty();
}

void AddBearerToken(grpc::ClientContext* context, const std::string& token) {
  if (!token.empty()) context->AddMetadata("authorization", absl::StrCat(kBearer, token));
}

std::string MetadataValue(const grpc::ServerContext& context, absl::string_view key) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(grpc::string_ref(key.data(), key.size()));
  if (it == metadata.end()) return "";
  return std::string(it->second.data(), it->second.size());
}

absl::Status CheckBearer(absl::string_view authorization, const std::string& expected,
                         absl::string_view what) {
  if (expected.empty()) return absl::OkStatus();
  const absl::string_view presented =
      absl::StartsWith(authorization, kBearer) ? authorization.substr(kBearer.size()) : "";
  if (presented.empty())
    return absl::UnauthenticatedError(
        absl::StrCat("no ", what, " (authorization: Bearer <token>)"));
  if (!TokensEqual(presented, expected))
    return absl::UnauthenticatedError(absl::StrCat("wrong ", what));
  return absl::OkStatus();
}

}  // namespace moe

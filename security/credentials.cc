#include "security/credentials.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace moe {
namespace {

absl::Status CheckPem(const std::string& path, absl::string_view flag, absl::string_view marker) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(flag, ": cannot read ", path));
  std::stringstream content;
  content << in.rdbuf();
  if (!absl::StrContains(content.str(), marker))
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": ", path, " holds no PEM block with \"", marker, "\""));
  return absl::OkStatus();
}

unsigned ReloadSeconds(const TlsFiles& files) {
  return static_cast<unsigned>(std::clamp<int64_t>(files.reload_s, 1, 86400));
}

}  // namespace

void AddTlsFlags(Flags& flags, TlsFiles* files, bool server) {
  if (server) {
    flags.String("tls-cert", &files->cert, "PEM certificate chain: serve TLS (with --tls-key)");
    flags.String("tls-key", &files->key, "PEM private key of --tls-cert");
    flags.String("tls-ca", &files->ca,
                 "PEM CA bundle: require client certificates signed by it (mTLS)");
  } else {
    flags.Bool("tls", &files->tls, "connect with TLS, trusting the system's roots");
    flags.String("tls-ca", &files->ca, "PEM CA bundle the server's certificate must chain to");
    flags.String("tls-cert", &files->cert, "PEM client certificate (servers that require mTLS)");
    flags.String("tls-key", &files->key, "PEM private key of --tls-cert");
    flags.String("tls-server-name", &files->server_name,
                 "name the server's certificate must carry (default: the target's host)");
  }
  flags.Int("tls-reload-s", &files->reload_s, "how often the TLS files are re-read (rotation)");
}

absl::Status CheckTlsFiles(const TlsFiles& files, bool server) {
  if (files.cert.empty() != files.key.empty())
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  if (server && !files.ca.empty() && files.cert.empty())
    return absl::InvalidArgumentError(
        "--tls-ca on a server needs --tls-cert and --tls-key (its own identity)");
  if (!files.cert.empty()) {
    if (absl::Status s = CheckPem(files.cert, "--tls-cert", "BEGIN CERTIFICATE"); !s.ok()) return s;
    if (absl::Status s = CheckPem(files.key, "--tls-key", "PRIVATE KEY"); !s.ok()) return s;
  }
  if (!files.ca.empty()) {
    if (absl::Status s = CheckPem(files.ca, "--tls-ca", "BEGIN CERTIFICATE"); !s.ok()) return s;
  }
  if (files.reload_s < 1 || files.reload_s > 86400)
    return absl::InvalidArgumentError("--tls-reload-s must be in 1..86400");
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const TlsFiles& files) {
  if (!files.server_enabled()) return grpc::InsecureServerCredentials();
  if (absl::Status s = CheckTlsFiles(files, /*server=*/true); !s.ok()) return s;
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      files.key, files.cert, files.ca, ReloadSeconds(files));
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (files.mutual()) {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const TlsFiles& files) {
  if (!files.channel_enabled()) return grpc::InsecureChannelCredentials();
  if (absl::Status s = CheckTlsFiles(files, /*server=*/false); !s.ok()) return s;
  grpc::experimental::TlsChannelCredentialsOptions options;
  if (!files.ca.empty() || !files.cert.empty()) {
    auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        files.key, files.cert, files.ca, ReloadSeconds(files));
    options.set_certificate_provider(provider);
    if (!files.ca.empty()) options.watch_root_certs();  // else: the system's roots
    if (!files.cert.empty()) options.watch_identity_key_cert_pairs();
  }
  options.set_verify_server_certs(true);
  return grpc::experimental::TlsCredentials(options);
}

void AddTlsChannelArgs(const TlsFiles& files, grpc::ChannelArguments* args) {
  if (files.channel_enabled() && !files.server_name.empty())
    args->SetSslTargetNameOverride(files.server_name);
}

}  // namespace moe

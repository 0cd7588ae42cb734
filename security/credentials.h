// TLS for gRPC servers and channels, from PEM files that are re-read when they change.
//
// A server with `cert` + `key` serves TLS; with `ca` as well it requires client certificates
// signed by that CA (mTLS). A channel with `ca` trusts that CA (else the system's roots) and,
// with `cert` + `key`, presents a client certificate. No files: plaintext.
//
// Rotation: gRPC's FileWatcherCertificateProvider re-reads the files every `reload_s` seconds;
// new handshakes use the new certificates, established connections (rank streams) keep theirs.
// Replace the files atomically (rename, or a symlinked directory as Kubernetes does).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "core/flags.h"
#include "grpcpp/grpcpp.h"

namespace moe {

struct TlsFiles {
  std::string cert;  // PEM certificate chain: this side's identity
  std::string key;   // PEM private key of `cert`
  std::string ca;    // PEM CA bundle: the trust for the peer
  // Channels only: the name the server's certificate must carry, when it differs from the
  // target's host (connecting by IP to a certificate issued for a DNS name).
  std::string server_name;
  bool tls = false;       // channels only: TLS with the system's roots when no file is given
  int64_t reload_s = 10;  // how often the files are re-read

  bool server_enabled() const { return !cert.empty() || !key.empty() || !ca.empty(); }
  bool channel_enabled() const { return tls || !ca.empty() || !cert.empty() || !key.empty(); }
  bool mutual() const { return !ca.empty(); }  // a server requires client certificates
};

// --tls-cert, --tls-key, --tls-ca, --tls-reload-s; on channels also --tls and
// --tls-server-name.
void AddTlsFlags(Flags& flags, TlsFiles* files, bool server);

// Checks the combination (cert and key together; a server needs them for `ca`) and that each
// file reads as the PEM it should be, so a mistake fails at start-up with the file's name
// instead of as failed handshakes later.
absl::Status CheckTlsFiles(const TlsFiles& files, bool server);

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const TlsFiles& files);
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(const TlsFiles& files);
// The channel arguments TLS needs (the server-name override), added to `args`.
void AddTlsChannelArgs(const TlsFiles& files, grpc::ChannelArguments* args);

}  // namespace moe

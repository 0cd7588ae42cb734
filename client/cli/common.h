// What every moe-client command shares: exit codes, the connection flags, inputs, and the
// small text helpers of the reports.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/moe_client.h"
#include "core/flags.h"
#include "core/npy.h"
#include "core/status.h"
#include "security/credentials.h"
#include "security/tokens.h"

namespace moe::cli {

// Exit codes: 1 for an RPC or runtime failure (message on stderr), 2 for a usage error.
int Fail(const absl::Status& status);
int UsageError(const std::string& message);

// How a command reaches the gateway: TLS files and a token file, the same flags everywhere.
struct Connection {
  ClientOptions options;
  std::string token_file;

  void AddFlags(Flags& flags) {
    AddTlsFlags(flags, &options.tls, /*server=*/false);
    flags.String("token-file", &token_file,
                 "send its token as `authorization: Bearer` (the gateway's --api-token-file, or "
                 "--admin-token-file for diagnostics)");
    flags.Int("max-message-bytes", &options.max_message_bytes,
              "largest message either way (0: what the server's GetModelInfo implies, at least "
              "4 MiB)");
    flags.Range("max-message-bytes", 0, INT32_MAX);
  }
  // The options, with the token read; errors are usage errors (exit 2).
  absl::StatusOr<ClientOptions> Resolve() const {
    ClientOptions resolved = options;
    if (absl::Status s = CheckTlsFiles(options.tls, /*server=*/false); !s.ok()) return s;
    if (!token_file.empty()) {
      ASSIGN_OR_RETURN(resolved.token, ReadTokenFile(token_file));
    }
    return resolved;
  }
};

// Connects as `connection` says; a bad flag value returns the usage error's exit code.
absl::StatusOr<std::unique_ptr<MoeClient>> ConnectOrExitCode(const std::string& target,
                                                             const Connection& connection,
                                                             int* exit_code);
// 0 or less: no deadline.
absl::Duration TimeoutFromMs(int64_t ms);
// "1..92", "0..447, 500": id lists as ascending runs.
std::string Ranges(std::vector<int32_t> ids);
std::string Bytes(int64_t bytes);
// Reads an input batch: float16/float32/float64 .npy (float64, numpy's default, is rounded to
// float32 as read, then to the wire dtype), or with `bf16` the bf16 bit patterns of a uint16 or
// 2-byte void array (ml_dtypes.bfloat16 saves as 'V2', which the file cannot tell from any
// other 2-byte type: the caller says so); [T, H] or [B, T, H].
absl::StatusOr<NpyArray> ReadInput(const std::string& path, bool bf16 = false);
// `tokens` x H of N(0,1) values from `seed`, H from the server's GetModelInfo.
absl::StatusOr<NpyArray> RandomInput(MoeClient& client, int64_t tokens, int64_t seed);

// moe-client load (client/cli/load.cc).
int RunLoad(int argc, char** argv);

}  // namespace moe::cli

#include "client/cli/common.h"

#include <algorithm>
#include <cstdio>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/numerics.h"

namespace moe::cli {

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "moe-client: %s\n", status.ToString().c_str());
  return 1;
}

int UsageError(const std::string& message) {
  std::fprintf(stderr, "moe-client: %s (see --help)\n", message.c_str());
  return 2;
}

// Connects as `connection` says; a bad flag value returns the usage error's exit code.
absl::StatusOr<std::unique_ptr<MoeClient>> ConnectOrExitCode(const std::string& target,
                                                             const Connection& connection,
                                                             int* exit_code) {
  absl::StatusOr<ClientOptions> options = connection.Resolve();
  if (!options.ok()) {
    *exit_code = UsageError(std::string(options.status().message()));
    return options.status();
  }
  absl::StatusOr<std::unique_ptr<MoeClient>> client = MoeClient::Connect(target, *options);
  if (!client.ok()) *exit_code = Fail(client.status());
  return client;
}

// 0 or less: no deadline.
absl::Duration TimeoutFromMs(int64_t ms) {
  return ms > 0 ? absl::Milliseconds(ms) : absl::InfiniteDuration();
}

// "1..92", "0..447, 500": id lists as ascending runs.
std::string Ranges(std::vector<int32_t> ids) {
  std::sort(ids.begin(), ids.end());
  std::vector<std::string> parts;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    parts.push_back(j > i ? absl::StrCat(ids[i], "..", ids[j]) : absl::StrCat(ids[i]));
    i = j + 1;
  }
  return parts.empty() ? "none" : absl::StrJoin(parts, ", ");
}

std::string Bytes(int64_t bytes) {
  if (bytes >= (int64_t{1} << 30)) return absl::StrFormat("%.2f GiB", bytes / 1073741824.0);
  if (bytes >= (int64_t{1} << 20)) return absl::StrFormat("%.1f MiB", bytes / 1048576.0);
  return absl::StrCat(bytes, " B");
}

// Reads an input batch: float16/float32/float64 .npy (float64, numpy's default, is rounded to
// float32 as read, then to the wire dtype), or with `bf16` the bf16 bit patterns of a uint16 or
// 2-byte void array (ml_dtypes.bfloat16 saves as 'V2', which the file cannot tell from any
// other 2-byte type: the caller says so); [T, H] or [B, T, H].
absl::StatusOr<NpyArray> ReadInput(const std::string& path, bool bf16) {
  ASSIGN_OR_RETURN(NpyArray x, ReadNpy(path));
  const bool bits = x.descr == "<u2" || x.descr == "<V2" || x.descr == "|V2";
  const bool floats = x.descr == "<f4" || x.descr == "<f2" || x.descr == "<f8";
  if (bf16 ? !bits : !floats)
    return absl::InvalidArgumentError(
        bf16 ? absl::StrCat(path, ": --input-bf16 needs a uint16 or bfloat16 (V2) array, got ",
                            x.descr)
             : absl::StrCat(path, ": input must be float16, float32 or float64, got ", x.descr,
                            bits ? " (bf16 bit patterns? give --input-bf16)" : ""));
  if (bits) {
    x.data.resize(x.ints.size());
    for (size_t i = 0; i < x.ints.size(); ++i)
      x.data[i] = Bf16BitsToFloat(static_cast<uint16_t>(x.ints[i]));
    x.ints.clear();
  }
  if (x.shape.size() != 2 && x.shape.size() != 3)
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": input must be [T, H] or [B, T, H], got ", x.shape.size(), " dimensions"));
  return x;
}

// `tokens` x H of N(0,1) values from `seed`, H from the server's GetModelInfo.
absl::StatusOr<NpyArray> RandomInput(MoeClient& client, int64_t tokens, int64_t seed) {
  absl::StatusOr<moe::v1::ModelInfo> info = client.GetModelInfo();
  if (!info.ok()) return Annotate(info.status(), "GetModelInfo");
  NpyArray x;
  x.descr = "<f4";
  x.shape = {tokens, info->hidden_size()};
  x.data.resize(tokens * info->hidden_size());
  std::mt19937_64 rng(static_cast<uint64_t>(seed));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : x.data) v = normal(rng);
  return x;
}

}  // namespace moe::cli

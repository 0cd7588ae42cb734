// The control port: the rank handshake's metadata (security/rank_handshake.h) and the messages a
// peer sends there (RegisterRequest, RankToGateway). The first byte picks what the rest is:
//   0  "nonce\nproof\nrank": a registration nobody who lacks the token can make pass
//   1  "session\nproof\nrank": an exchange, against sessions the gateway opened
//   2  "rank\nflip": an honest registration and exchange for that rank, each accepted once only
//      (a replay is refused), and refused again once byte `flip` of the proof is changed
//   3  a serialized RegisterRequest, 4 a serialized RankToGateway: what parses serializes to
//      bytes that parse to the same message
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "moe/v1/internal.pb.h"
#include "security/rank_handshake.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/quiet_protobuf.h"

namespace {

constexpr char kToken[] = "fuzz-cluster-token";

std::vector<std::string> Fields(const std::string& text) {
  std::vector<std::string> fields = absl::StrSplit(text, '\n');
  fields.resize(3);
  return fields;
}

// A rank id as the gateway admits them (-1 .. 2^20 - 1).
int Rank(const std::string& text) {
  int rank = 0;
  return absl::SimpleAtoi(text, &rank) && rank >= -1 && rank < (1 << 20) ? rank : 0;
}

void Registration(moe::RankHandshake& handshake, const std::string& text) {
  const std::vector<std::string> f = Fields(text);
  const absl::Status s = handshake.CheckRegistration(f[0], f[1], Rank(f[2]), absl::Now());
  FUZZ_CHECK(!s.ok());
  FUZZ_CHECK_CODE(s, absl::StatusCode::kUnauthenticated);
}

void Exchange(moe::RankHandshake& handshake, const std::string& text) {
  for (int rank = 0; rank < 4; ++rank) handshake.OpenSession(rank);
  const std::vector<std::string> f = Fields(text);
  const absl::Status s = handshake.ClaimSession(Rank(f[2]), f[0], f[1]);
  FUZZ_CHECK(!s.ok());
  FUZZ_CHECK_CODE(s, absl::StatusCode::kUnauthenticated, absl::StatusCode::kFailedPrecondition);
}

void Honest(moe::RankHandshake& handshake, const std::string& text) {
  const std::vector<std::string> f = Fields(text);
  const int rank = Rank(f[0]);
  size_t flip = 0;
  (void)absl::SimpleAtoi(f[1], &flip);
  const absl::Time now = absl::Now();
  const std::string nonce = handshake.NewNonce(now);
  std::string proof = moe::RegistrationProof(kToken, nonce, rank);
  std::string forged = proof;
  forged[flip % forged.size()] ^= 1;
  FUZZ_CHECK(!handshake.CheckRegistration(nonce, forged, rank, now).ok());
  FUZZ_CHECK(!handshake.CheckRegistration(nonce, proof, rank + 1, now).ok());
  FUZZ_CHECK(handshake.CheckRegistration(nonce, proof, rank, now).ok());
  FUZZ_CHECK(!handshake.CheckRegistration(nonce, proof, rank, now).ok());  // a replay
  FUZZ_CHECK(!handshake.CheckRegistration(handshake.NewNonce(now), proof, rank, now).ok());
  const std::string session = handshake.OpenSession(rank);
  proof = moe::ExchangeProof(kToken, session, rank);
  forged = proof;
  forged[flip % forged.size()] ^= 1;
  FUZZ_CHECK(!handshake.ClaimSession(rank, session, forged).ok());
  FUZZ_CHECK(!handshake.ClaimSession(rank + 1, session, proof).ok());
  FUZZ_CHECK(handshake.ClaimSession(rank, session, proof).ok());
  FUZZ_CHECK(!handshake.ClaimSession(rank, session, proof).ok());  // a replay
}

template <class Message>
void RoundTrip(const std::string& bytes) {
  Message first;
  if (!first.ParseFromString(bytes)) return;
  const std::string serialized = first.SerializeAsString();
  Message second;
  FUZZ_CHECK(second.ParseFromString(serialized));
  FUZZ_CHECK(second.SerializeAsString() == serialized);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const QuietProtobuf quiet;
  if (size == 0) return 0;
  // One per input: what an input leaves (used nonces, sessions) goes with it.
  moe::RankHandshake handshake(kToken);
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 5) {
    case 0:
      Registration(handshake, rest);
      break;
    case 1:
      Exchange(handshake, rest);
      break;
    case 2:
      Honest(handshake, rest);
      break;
    case 3:
      RoundTrip<moe::v1::internal::RegisterRequest>(rest);
      break;
    default:
      RoundTrip<moe::v1::internal::RankToGateway>(rest);
      break;
  }
  return 0;
}

// How a rank proves it holds the cluster token without ever sending it, so that nothing a
// recording proxy on the rank's path sees can be replayed (docs/SECURITY.md "Control plane").
//
//   rank                                            gateway
//   Challenge ------------------------------------> nonce: 16 random bytes | expiry | MAC of both
//                                                   under a key of this gateway start (no state
//                                                   kept for peers that never prove anything)
//   Register, metadata moe-rank-nonce,    --------> nonce's MAC and expiry, the proof, then the
//     moe-rank-proof = HMAC(token, "register" |     nonce's first use (a used nonce is refused
//     nonce | requested rank)                       until it expires anyway)
//                                         <-------- session: 16 random bytes, this registration's
//   Exchange, metadata moe-rank-session,  --------> the rank's current session, not yet used,
//     moe-rank-proof = HMAC(token, "exchange" |     and the proof; the session is used up
//     session | rank)
//
// Proofs, nonces and sessions travel as lowercase hex in gRPC metadata, which the gateway reads
// before any message, so an unauthenticated peer never gets a message read. Without a cluster
// token (mTLS alone, or --insecure-cluster) no proof is asked for; sessions are still single use.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace moe {

// Metadata keys of the handshake (lowercase, as gRPC requires).
inline constexpr char kRankNonceKey[] = "moe-rank-nonce";
inline constexpr char kRankProofKey[] = "moe-rank-proof";
inline constexpr char kRankSessionKey[] = "moe-rank-session";
inline constexpr char kRankIdKey[] = "moe-rank-id";

// The rank's side: the proofs it sends (hex HMAC-SHA256 under `token`).
std::string RegistrationProof(absl::string_view token, absl::string_view nonce_hex,
                              int requested_rank);
std::string ExchangeProof(absl::string_view token, absl::string_view session_hex, int rank);

// The gateway's side. Thread-safe.
class RankHandshake {
 public:
  // `token` "" = no proofs asked for.
  explicit RankHandshake(std::string token, absl::Duration nonce_lifetime = absl::Minutes(1));

  bool token_required() const { return !token_.empty(); }
  // A fresh challenge nonce (hex), valid for the nonce lifetime from `now`.
  std::string NewNonce(absl::Time now);
  // OK when `proof_hex` proves the token for `nonce_hex` (one this gateway start issued, not
  // expired, never used before) and `requested_rank`; the nonce is then used up.
  // UNAUTHENTICATED, saying which part failed, otherwise.
  absl::Status CheckRegistration(absl::string_view nonce_hex, absl::string_view proof_hex,
                                 int requested_rank, absl::Time now);
  // A new single-use session (hex) for `rank`; the rank's previous one, used or not, is void.
  std::string OpenSession(int rank);
  // OK once per session: `session_hex` is `rank`'s current, unused session and `proof_hex`
  // proves the token for it. UNAUTHENTICATED for a wrong proof or a used session (a replay),
  // FAILED_PRECONDITION for one that is not the rank's current session (register again).
  absl::Status ClaimSession(int rank, absl::string_view session_hex, absl::string_view proof_hex);

 private:
  std::string NonceTag(absl::string_view random_and_expiry) const;

  const std::string token_;
  const absl::Duration nonce_lifetime_;
  std::string nonce_key_;  // random, per gateway start: nonces of an earlier start are void
  std::mutex mu_;
  std::map<std::string, absl::Time> used_nonces_;  // guarded by mu_: nonce -> its expiry
  struct Session {
    std::string id;
    bool used = false;
  };
  std::map<int, Session> sessions_;  // guarded by mu_
};

// Random bytes from the OS (OpenSSL's RAND_bytes), lowercase hex.
std::string RandomHex(size_t bytes);

}  // namespace moe

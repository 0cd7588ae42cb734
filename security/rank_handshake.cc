#include "security/rank_handshake.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace moe {
namespace {

constexpr size_t kNonceRandomBytes = 16;
constexpr size_t kExpiryBytes = 8;
constexpr size_t kTagBytes = 16;
constexpr size_t kNonceBytes = kNonceRandomBytes + kExpiryBytes + kTagBytes;
constexpr size_t kProofHexChars = 64;  // HMAC-SHA256

std::string Hmac(absl::string_view key, absl::string_view message) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), out, &length);
  return std::string(reinterpret_cast<const char*>(out), length);
}

// Domain-separated: a registration proof can never pass as an exchange proof.
std::string Proof(absl::string_view token, absl::string_view purpose, absl::string_view value,
                  int rank) {
  return absl::BytesToHexString(
      Hmac(token, absl::StrCat("moe-serve ", purpose, " v1\n", value, "\n", rank)));
}

bool EqualConstantTime(absl::string_view a, absl::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

// Lowercase hex of exactly `chars` characters, decoded; false for anything else.
bool DecodeHex(absl::string_view hex, size_t chars, std::string* bytes) {
  if (hex.size() != chars) return false;
  for (char c : hex)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  *bytes = absl::HexStringToBytes(hex);
  return true;
}

}  // namespace

std::string RandomHex(size_t bytes) {
  std::string raw(bytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(raw.data()), static_cast<int>(bytes)) != 1)
    std::abort();  // no randomness: nothing secret could be made
  return absl::BytesToHexString(raw);
}

std::string RegistrationProof(absl::string_view token, absl::string_view nonce_hex,
                              int requested_rank) {
  return Proof(token, "register", nonce_hex, requested_rank);
}

std::string ExchangeProof(absl::string_view token, absl::string_view session_hex, int rank) {
  return Proof(token, "exchange", session_hex, rank);
}

RankHandshake::RankHandshake(std::string token, absl::Duration nonce_lifetime)
    : token_(std::move(token)),
      nonce_lifetime_(nonce_lifetime),
      nonce_key_(absl::HexStringToBytes(RandomHex(32))) {}

std::string RankHandshake::NonceTag(absl::string_view random_and_expiry) const {
  return Hmac(nonce_key_, random_and_expiry).substr(0, kTagBytes);
}

std::string RankHandshake::NewNonce(absl::Time now) {
  std::string nonce = absl::HexStringToBytes(RandomHex(kNonceRandomBytes));
  const uint64_t expiry = static_cast<uint64_t>(absl::ToUnixMillis(now + nonce_lifetime_));
  for (size_t i = 0; i < kExpiryBytes; ++i)
    nonce.push_back(static_cast<char>((expiry >> (8 * i)) & 0xff));
  nonce += NonceTag(nonce);
  return absl::BytesToHexString(nonce);
}

absl::Status RankHandshake::CheckRegistration(absl::string_view nonce_hex,
                                              absl::string_view proof_hex, int requested_rank,
                                              absl::Time now) {
  if (token_.empty()) return absl::OkStatus();
  std::string nonce, proof;
  if (!DecodeHex(nonce_hex, 2 * kNonceBytes, &nonce) ||
      !DecodeHex(proof_hex, kProofHexChars, &proof))
    return absl::UnauthenticatedError(absl::StrCat(
        "no registration proof: this gateway requires the cluster token (moe-rank "
        "--cluster-token-file; the ", kRankNonceKey, " and ", kRankProofKey, " metadata)"));
  const absl::string_view body =
      absl::string_view(nonce).substr(0, kNonceRandomBytes + kExpiryBytes);
  if (!EqualConstantTime(NonceTag(body), absl::string_view(nonce).substr(body.size())))
    return absl::UnauthenticatedError(
        "registration nonce not issued by this gateway (forged, or from before a restart): ask "
        "for a new challenge");
  uint64_t expiry_ms = 0;
  for (size_t i = 0; i < kExpiryBytes; ++i)
    expiry_ms |= uint64_t{static_cast<unsigned char>(nonce[kNonceRandomBytes + i])} << (8 * i);
  const absl::Time expiry = absl::FromUnixMillis(static_cast<int64_t>(expiry_ms));
  if (now > expiry)
    return absl::UnauthenticatedError("registration nonce expired: ask for a new challenge");
  if (!EqualConstantTime(RegistrationProof(token_, nonce_hex, requested_rank), proof_hex))
    return absl::UnauthenticatedError("wrong cluster token (registration proof does not match)");
  std::lock_guard<std::mutex> lock(mu_);
  // Only proven registrations get here, so the table grows only by what token holders do, and
  // never beyond the nonces of one lifetime.
  for (auto it = used_nonces_.begin(); it != used_nonces_.end();)
    it = it->second < now ? used_nonces_.erase(it) : std::next(it);
  if (!used_nonces_.emplace(std::string(nonce_hex), expiry).second)
    return absl::UnauthenticatedError(
        "registration nonce already used (a replayed registration): ask for a new challenge");
  return absl::OkStatus();
}

std::string RankHandshake::OpenSession(int rank) {
  std::string id = RandomHex(16);
  std::lock_guard<std::mutex> lock(mu_);
  sessions_[rank] = Session{id, false};
  return id;
}

absl::Status RankHandshake::ClaimSession(int rank, absl::string_view session_hex,
                                         absl::string_view proof_hex) {
  if (!token_.empty() && !EqualConstantTime(ExchangeProof(token_, session_hex, rank), proof_hex))
    return absl::UnauthenticatedError(
        absl::StrCat("wrong cluster token (exchange proof for rank ", rank, " does not match)"));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(rank);
  if (it == sessions_.end() || !EqualConstantTime(it->second.id, session_hex))
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank,
                     ": not its current session (the gateway restarted, or the rank registered "
                     "again since); register again"));
  if (it->second.used)
    return absl::UnauthenticatedError(
        absl::StrCat("rank ", rank,
                     ": session already used by an exchange (a replayed exchange: each "
                     "registration opens one)"));
  it->second.used = true;
  return absl::OkStatus();
}

}  // namespace moe

#!/usr/bin/env bash
# Makes a development CA, certificates for TLS/mTLS between gateway, ranks and clients, and a
# cluster token.
#
#   scripts/make-certs.sh [--owner UID:GID] DIR [NAME...]
#
# DIR/ca.pem            the CA (give it to every side as --tls-ca)
# DIR/gateway.{pem,key} server certificate for localhost, 127.0.0.1, ::1, `gateway` and each
#                       NAME (a DNS name or an IP address)
# DIR/rank.{pem,key}    client certificate for ranks (mTLS): the only one carrying the URI SAN
#                       spiffe://moe-serve/rank, which an mTLS control port requires
#                       (moe-gateway --rank-identity), so no other certificate of this CA can
#                       register as a rank
# DIR/client.{pem,key}  client certificate for callers (a gateway with --tls-ca requires one)
# DIR/cluster-token     random shared secret for --cluster-token-file (gateway and every rank)
# DIR/.gitignore        `*`: nothing of DIR gets committed by accident
#
# ECDSA P-256, valid 365 days; keys and the token mode 0600 (ca.key stays in DIR to issue more).
# --owner UID:GID (as root): chown what the services read (not ca.key) to the containers' user;
# compose bind-mounts secret files with their host owner and mode, and the images run as
# 10001:10001 (`sudo scripts/make-certs.sh --owner 10001:10001 deploy/secrets`).
# For production, use your own PKI (cert-manager, Vault); this is for development, tests and the
# compose/Kubernetes examples.
set -euo pipefail
owner=""
if [[ ${1:-} == --owner ]]; then
  owner=${2:?usage: make-certs.sh [--owner UID:GID] DIR [NAME...]}
  shift 2
  if [[ ! $owner =~ ^[0-9]+:[0-9]+$ ]]; then
    echo "make-certs: --owner wants numeric UID:GID, got '$owner'" >&2
    exit 2
  fi
  if [[ $(id -u) -ne 0 ]]; then
    echo "make-certs: --owner needs root (sudo) to chown" >&2
    exit 2
  fi
fi
dir=${1:?usage: make-certs.sh [--owner UID:GID] DIR [NAME...]}
shift
mkdir -p "$dir"
cd "$dir"
umask 077

san="DNS:localhost,DNS:gateway,IP:127.0.0.1,IP:::1"
for name in "$@"; do
  if [[ $name =~ ^[0-9.]+$ || $name == *:* ]]; then san+=",IP:$name"; else san+=",DNS:$name"; fi
done

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

key ca.key
openssl req -x509 -new -key ca.key -sha256 -days 365 -subj "/CN=moe development CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -out ca.pem

# issue NAME CN EXTENSIONS: NAME.key and NAME.pem signed by the CA.
issue() {
  local name=$1 cn=$2 ext=$3
  key "$name.key"
  openssl req -new -key "$name.key" -subj "/CN=$cn" -out "$name.csr"
  printf '%b' "$ext" > "$name.ext"
  openssl x509 -req -in "$name.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -sha256 -days 365 \
    -extfile "$name.ext" -out "$name.pem" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
}
common="basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
issue gateway moe-gateway "${common}extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=$san\n"
issue rank moe-rank "${common}extendedKeyUsage=clientAuth\nsubjectAltName=URI:spiffe://moe-serve/rank\n"
issue client moe-client "${common}extendedKeyUsage=clientAuth\n"
rm -f ca.srl
# A new token with every new CA: 32 random bytes, hex (rename: a reader never sees half a file).
openssl rand -hex 32 > cluster-token.tmp
mv -f cluster-token.tmp cluster-token
printf '*\n' > .gitignore
chmod 0644 ca.pem gateway.pem rank.pem client.pem .gitignore
chmod 0600 ca.key gateway.key rank.key client.key cluster-token
if [[ -n $owner ]]; then
  chown "$owner" . ca.pem gateway.pem gateway.key rank.pem rank.key client.pem client.key cluster-token
fi
echo "make-certs: wrote $(pwd)/{ca,gateway,rank,client}.pem, their keys and cluster-token (SAN $san)"

#!/usr/bin/env bash
# Makes a development CA and certificates for TLS/mTLS between gateway, ranks and clients.
#
#   scripts/make-certs.sh DIR [NAME...]
#
# DIR/ca.pem            the CA (give it to every side as --tls-ca)
# DIR/gateway.{pem,key} server certificate for localhost, 127.0.0.1, ::1, `gateway` and each
#                       NAME (a DNS name or an IP address); usable as a client certificate too,
#                       so moe-cluster can hand the same pair to its ranks
# DIR/rank.{pem,key}    client certificate for ranks (mTLS)
# DIR/client.{pem,key}  client certificate for callers (a gateway with --tls-ca requires one)
#
# ECDSA P-256, valid 365 days, keys mode 0600. For production, use your own PKI (cert-manager,
# Vault); this is for development, tests and the compose/Kubernetes examples.
set -euo pipefail
dir=${1:?usage: make-certs.sh DIR [NAME...]}
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
issue rank moe-rank "${common}extendedKeyUsage=clientAuth\n"
issue client moe-client "${common}extendedKeyUsage=clientAuth\n"
rm -f ca.srl
chmod 0644 ca.pem gateway.pem rank.pem client.pem
echo "make-certs: wrote $(pwd)/{ca,gateway,rank,client}.pem and keys (SAN $san)"

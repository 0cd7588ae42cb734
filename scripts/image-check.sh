#!/usr/bin/env bash
# Checks the CPU image end to end: builds docker/Dockerfile.cpu, starts the MoE services of
# deploy/compose.cpu.yaml (ckpt, gateway-0, gateway-1, rank-0 .. rank-3; not Prometheus/Grafana),
# waits until every gateway and rank is ready, sends real Forward calls and checks every answer
# bit-identical to the image's in-process layer (moe-forward), then prints PASS or FAIL. Whatever
# happens, everything it started is torn down on exit (containers, the compose network, the
# `models` volume, the scratch secrets); the image is kept.
#
#   scripts/image-check.sh                  # build the working tree, check it
#   scripts/image-check.sh --ref HEAD       # build the committed tree (git archive), check it
#   scripts/image-check.sh --no-build       # check an image built before ($MOE_IMAGE)
#
# Options: --engine docker|podman (or MOE_ENGINE; default: docker when its daemon answers, else podman),
# --image NAME (default $MOE_IMAGE or moe-serve:cpu), --ref REV, --no-build, --timeout S (readiness,
# default 600). Environment: MOE_BUILD_FLAGS, extra flags for the image build (e.g.
# "--network host" where the build's apt needs the host's network settings); BUILD_JOBS (default:
# all cores). Compose: `docker compose` or `docker-compose`; `podman-compose` or `podman compose`.
#
# What is checked:
#   - the build, its time, the image size, its OCI labels and `moe-gateway --version` (the commit);
#   - readiness: every gateway and rank answers /readyz 200 on its metrics port, inside its container
#     and through the port published on 127.0.0.1; every gateway's grpc.health.v1 says SERVING (TLS);
#   - answers: for several (layer, tokens) cases, `moe-client forward` through the gateways' shared
#     name `gateway` (inside the compose network), to each gateway alone, and from the host network
#     through both published ports (TLS) must be the same bytes as `moe-forward` on the same
#     checkpoint and input (the .npy files are compared whole, by SHA-256).
# Ports: the gateways' gRPC and metrics ports are published on 127.0.0.1 at free ports chosen here;
# the ranks' metrics ports are compose.cpu.yaml's fixed 127.0.0.1:9401-9404 and must be free.
set -euo pipefail

cd "$(dirname "$0")/.."
root=$(pwd)

engine=${MOE_ENGINE:-}
image=${MOE_IMAGE:-moe-serve:cpu}
ref=""
build=1
timeout_s=600
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case $1 in
    --engine) engine=${2:?--engine needs docker or podman}; shift 2 ;;
    --image) image=${2:?--image needs a name}; shift 2 ;;
    --ref) ref=${2:?--ref needs a git revision}; shift 2 ;;
    --no-build) build=0; shift ;;
    --timeout) timeout_s=${2:?--timeout needs seconds}; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "image-check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

say() { printf '[image-check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[image-check] ERROR: %s\n' "$*" >&2; exit 1; }

# ---- engine and compose -------------------------------------------------------------------------
if [[ -z $engine ]]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    engine=docker
  elif command -v podman >/dev/null; then
    engine=podman
  else
    die "neither a Docker daemon (docker info) nor podman is available"
  fi
fi
case $engine in
  docker)
    if docker compose version >/dev/null 2>&1; then
      compose_cmd=(docker compose)
    elif command -v docker-compose >/dev/null; then
      compose_cmd=(docker-compose)
    else
      die "docker has no compose: install the compose plugin (docker compose) or docker-compose"
    fi
    build_format=() ;;
  podman)
    if command -v podman-compose >/dev/null; then
      compose_cmd=(podman-compose)
    elif podman compose version >/dev/null 2>&1; then
      compose_cmd=(podman compose)
    else
      die "podman has no compose: install podman-compose"
    fi
    # The image's HEALTHCHECK exists only in the Docker image format.
    build_format=(--format docker) ;;
  *) die "--engine must be docker or podman, not '$engine'" ;;
esac
command -v "$engine" >/dev/null || die "$engine is not installed"
engine_version=$("$engine" --version | head -n 1)

project=moe-imgcheck-$$
compose_file=$root/deploy/compose.cpu.yaml
derived_file=""
services_gw=(gateway-0 gateway-1)
services_rank=(rank-0 rank-1 rank-2 rank-3)
work=$(mktemp -d "${TMPDIR:-/tmp}/moe-image-check.XXXXXX")
result=FAIL
started=0

compose() { "${compose_cmd[@]}" -p "$project" -f "$compose_file" "$@"; }

# Containers, volumes and networks of this project, by the label both compose tools set.
project_objects() {
  local kind=$1
  "$engine" "$kind" ls -q --filter "label=com.docker.compose.project=$project" 2>/dev/null || true
}

show_logs() {
  local svc cid
  for svc in ckpt "${services_gw[@]}" "${services_rank[@]}"; do
    cid=$(container_of "$svc") || continue
    echo "---- logs of $svc (last 25 lines)"
    "$engine" logs --tail 25 "$cid" 2>&1 || true
  done
}

teardown() {
  local rc=$?
  trap - EXIT
  trap "" INT TERM  # finish the teardown
  # A signal's trap can run while a command's redirection is in effect: back to the terminal.
  exec 1>&5 2>&6
  set +e
  if [[ $started -eq 1 ]]; then
    [[ $result == PASS ]] || show_logs
    say "tearing down project $project"
    compose down -v -t 5 >"$work/down.log" 2>&1 || tail -n 20 "$work/down.log" >&2
    # Whatever compose left (podman-compose 1.0 keeps networks): by the project's label.
    local ids
    mapfile -t ids < <("$engine" ps -aq --filter "label=com.docker.compose.project=$project" 2>/dev/null)
    [[ ${#ids[@]} -eq 0 ]] || "$engine" rm -f "${ids[@]}" >/dev/null 2>&1
    mapfile -t ids < <(project_objects volume)
    [[ ${#ids[@]} -eq 0 ]] || "$engine" volume rm -f "${ids[@]}" >/dev/null 2>&1
    mapfile -t ids < <(project_objects network)
    [[ ${#ids[@]} -eq 0 ]] || "$engine" network rm "${ids[@]}" >/dev/null 2>&1
    left=$("$engine" ps -aq --filter "label=com.docker.compose.project=$project" 2>/dev/null)
    left+=$(project_objects volume)$(project_objects network)
    [[ -z $left ]] || echo "image-check: WARNING: left behind: $left" >&2
  fi
  rm -rf "$work"
  [[ -z $derived_file ]] || rm -f "$derived_file"
  if [[ $result == PASS && $rc -eq 0 ]]; then
    say "PASS"
  else
    say "FAIL"
    [[ $rc -ne 0 ]] || rc=1
  fi
  exit "$rc"
}
exec 5>&1 6>&2
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

container_of() {
  local id
  id=$("$engine" ps -aq --filter "label=com.docker.compose.project=$project" \
    --filter "label=com.docker.compose.service=$1" 2>/dev/null | head -n 1)
  [[ -n $id ]] && echo "$id"
}

# GET http://127.0.0.1:PORT/PATH from this host (bash /dev/tcp: no curl needed); prints the status.
http_status() {
  local port=$1 path=$2 line code
  # shellcheck disable=SC2016  # $1 and $2 are the inner shell's
  line=$(timeout 5 bash -c 'exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 1
    printf "GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n" "$2" >&3
    head -n 1 <&3' http "$port" "$path" 2>/dev/null) || { echo 000; return; }
  read -r _ code _ <<<"$line"
  echo "${code:-000}"
}
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
free_port() {
  local p
  for _ in $(seq 1 200); do
    p=$((20000 + RANDOM % 20000))
    if port_free "$p" && [[ " ${used_ports[*]-} " != *" $p "* ]]; then
      used_ports+=("$p")
      echo "$p"
      return
    fi
  done
  die "no free port found"
}

# ---- build --------------------------------------------------------------------------------------
say "engine: $engine_version; compose: ${compose_cmd[*]}"
if [[ $build -eq 1 ]]; then
  context=$root
  if [[ -n $ref ]]; then
    commit=$(git rev-parse --short=12 "$ref^{commit}") || die "--ref $ref is not a commit"
    context=$work/src
    mkdir -p "$context"
    git archive "$commit" | tar -x -C "$context"
  elif commit=$(git rev-parse --short=12 HEAD 2>/dev/null); then
    # Tracked files changed: the binaries are not that commit's.
    git diff --quiet HEAD -- 2>/dev/null || commit=$commit-dirty
  else
    commit=unknown
  fi
  version=$(sed -n 's/^project([^)]*VERSION \([0-9.]*\)).*/\1/p' "$context/CMakeLists.txt" | head -n 1)
  jobs=${BUILD_JOBS:-$(nproc 2>/dev/null || echo 4)}
  say "building $image from ${ref:-the working tree} (commit $commit, version $version, $jobs jobs)"
  build_start=$(date +%s)
  # shellcheck disable=SC2086  # MOE_BUILD_FLAGS holds several flags
  "$engine" build "${build_format[@]}" ${MOE_BUILD_FLAGS:-} -f "$context/docker/Dockerfile.cpu" \
    --build-arg MOE_COMMIT="$commit" --build-arg MOE_VERSION="$version" --build-arg BUILD_JOBS="$jobs" \
    -t "$image" "$context" >"$work/build.log" 2>&1 ||
    { tail -n 40 "$work/build.log" >&2; die "image build failed (log above)"; }
  build_s=$(($(date +%s) - build_start))
  say "built $image in ${build_s} s"
else
  "$engine" image inspect "$image" >/dev/null 2>&1 || die "--no-build: no image $image"
  commit=""
fi
size_bytes=$("$engine" image inspect --format '{{.Size}}' "$image")
size_mb=$((size_bytes / 1000000))
label() { "$engine" image inspect --format "{{index .Config.Labels \"$1\"}}" "$image"; }
img_version=$(label org.opencontainers.image.version)
img_revision=$(label org.opencontainers.image.revision)
say "image $image: ${size_mb} MB, version $img_version, revision $img_revision"
[[ -z $commit || $img_revision == "$commit" ]] ||
  die "image label org.opencontainers.image.revision is '$img_revision', built from '$commit'"
gw_version=$("$engine" run --rm --no-healthcheck "$image" moe-gateway --version 2>"$work/version.err") ||
  die "the image cannot run 'moe-gateway --version' as its user: $(tail -n 3 "$work/version.err")"
gw_version=$(head -n 1 <<<"$gw_version")
say "moe-gateway --version: $gw_version"
[[ -z $commit || $gw_version == *"$commit"* ]] || die "moe-gateway --version does not name commit $commit"

# ---- start --------------------------------------------------------------------------------------
for p in 9401 9402 9403 9404; do
  port_free "$p" || die "port 127.0.0.1:$p (a rank's metrics port in compose.cpu.yaml) is in use"
done
used_ports=()
grpc0=$(free_port); grpc1=$(free_port); metrics0=$(free_port); metrics1=$(free_port)
# Published on 127.0.0.1 only: compose.cpu.yaml publishes "${MOE_PORT}:50051".
export MOE_IMAGE=$image MOE_SECRETS_DIR=$work/secrets
export MOE_PORT=127.0.0.1:$grpc0 MOE_PORT_1=127.0.0.1:$grpc1
export MOE_METRICS_PORT=$metrics0 MOE_METRICS_PORT_1=$metrics1
# Six processes: a share of the cores each.
threads=$(($(nproc 2>/dev/null || echo 6) / 6))
export MOE_RANK_THREADS=${MOE_RANK_THREADS:-$((threads > 0 ? threads : 1))}
export MOE_GATEWAY_THREADS=${MOE_GATEWAY_THREADS:-$((threads > 0 ? threads : 1))}

# Scratch CA, gateway certificate and cluster token. Compose mounts them with their host owner
# and mode: owned by the image's uid as root, else readable by everyone (throwaway files in a
# private directory).
owner=()
[[ $(id -u) -ne 0 ]] || owner=(--owner 10001:10001)
bash scripts/make-certs.sh "${owner[@]}" "$MOE_SECRETS_DIR" >"$work/certs.log" 2>&1 ||
  { cat "$work/certs.log" >&2; die "scripts/make-certs.sh failed"; }
if [[ $(id -u) -ne 0 ]]; then
  chmod a+r "$MOE_SECRETS_DIR"/*.pem "$MOE_SECRETS_DIR"/*.key "$MOE_SECRETS_DIR"/cluster-token
fi
ca_pem=$(cat "$MOE_SECRETS_DIR/ca.pem")

# --no-deps: the stages below keep the order (tools that wait for `condition: service_healthy`
# would wait forever where podman runs no health checks, without systemd).
up() { compose up -d --no-build --no-deps "$@" >>"$work/up.log" 2>&1 || { tail -n 30 "$work/up.log" >&2; die "compose up $* failed"; }; }
deadline=$(($(date +%s) + timeout_s))
wait_for() {  # wait_for WHAT COMMAND...: until COMMAND succeeds or the deadline passes
  local what=$1
  shift
  until "$@" >/dev/null; do
    [[ $(date +%s) -lt $deadline ]] || die "timed out after ${timeout_s} s waiting for $what"
    sleep 2
  done
}

# podman-compose 1.0 fails on a service's `networks: {default: {aliases: [...]}}` (KeyError): give
# it the file with plain network lists (next to the original, for its relative paths); the alias
# `gateway` is added below. Its Python has PyYAML (podman-compose needs it).
if [[ ${compose_cmd[0]} == podman-compose ]]; then
  derived_file=$root/deploy/.compose.cpu.image-check-$$.yaml
  py=$(head -n 1 "$(command -v podman-compose)" | sed -n 's/^#! *//p')
  [[ -n $py ]] || py=python3
  $py - "$compose_file" "$derived_file" <<'EOF' || die "could not write $derived_file"
import sys, yaml
spec = yaml.safe_load(open(sys.argv[1]))
for svc in spec.get("services", {}).values():
    if isinstance(svc.get("networks"), dict):
        svc["networks"] = list(svc["networks"])
yaml.safe_dump(spec, open(sys.argv[2], "w"), sort_keys=False)
EOF
  compose_file=$derived_file
fi

say "starting project $project (gateways on 127.0.0.1:$grpc0 and :$grpc1, metrics :$metrics0 and :$metrics1)"
started=1
start_s=$(date +%s)
# In stages: the checkpoint, then the gateways, then the ranks.
up ckpt
ckpt_done() {
  local cid state
  cid=$(container_of ckpt) || return 1
  state=$("$engine" inspect --format '{{.State.Status}} {{.State.ExitCode}}' "$cid")
  [[ $state == "exited 0" ]] && return 0
  [[ $state == exited* ]] && die "ckpt exited with code ${state#exited }"
  return 1
}
wait_for "the checkpoint (service ckpt)" ckpt_done
up "${services_gw[@]}"
# /healthz (live) or /readyz (ready) of a service's metrics port, asked inside its container.
probe_in() {
  local cid
  cid=$(container_of "$1") || return 1
  if [[ $2 == live ]]; then
    "$engine" exec "$cid" moe-rank-probe --live 9400 2>/dev/null
  else
    "$engine" exec "$cid" moe-rank-probe 9400 2>/dev/null
  fi
}
for svc in "${services_gw[@]}"; do wait_for "$svc /healthz" probe_in "$svc" live; done
# The shared name `gateway` (networks.aliases), added by hand where compose did not.
gw0=$(container_of gateway-0)
if [[ $("$engine" exec "$gw0" getent ahostsv4 gateway 2>/dev/null | awk '{print $1}' | sort -u | wc -l) -lt 2 ]]; then
  [[ $engine == podman ]] || die "the name 'gateway' does not resolve to both gateways"
  net=$(project_objects network | head -n 1)
  net=$("$engine" network inspect --format '{{.Name}}' "$net")
  say "adding the network alias 'gateway' to both gateways (${compose_cmd[*]} did not)"
  for svc in "${services_gw[@]}"; do
    cid=$(container_of "$svc")
    "$engine" network disconnect "$net" "$cid"
    "$engine" network connect --alias gateway --alias "$svc" "$net" "$cid"
  done
  wait_for "the name 'gateway' to resolve to both gateways" bash -c \
    "[[ \$('$engine' exec '$gw0' getent ahostsv4 gateway 2>/dev/null | awk '{print \$1}' | sort -u | wc -l) -ge 2 ]]"
fi
up "${services_rank[@]}"

# ---- readiness ----------------------------------------------------------------------------------
for svc in "${services_gw[@]}" "${services_rank[@]}"; do
  wait_for "$svc /readyz (inside its container)" probe_in "$svc" ready
done
ready_s=$(($(date +%s) - start_s))
say "every gateway and rank ready (/readyz 200) ${ready_s} s after start"
declare -A published=([gateway-0]=$metrics0 [gateway-1]=$metrics1 [rank-0]=9401 [rank-1]=9402
  [rank-2]=9403 [rank-3]=9404)
for svc in "${services_gw[@]}" "${services_rank[@]}"; do
  status=$(http_status "${published[$svc]}" /readyz)
  [[ $status == 200 ]] || die "$svc: /readyz on the published 127.0.0.1:${published[$svc]} answered $status"
done
say "published metrics ports answer /readyz 200: ${published[*]}"
for svc in "${services_gw[@]}"; do
  out=$("$engine" exec "$(container_of "$svc")" moe-client health --target 127.0.0.1:50051 \
    --tls-ca /run/secrets/ca 2>&1) || die "$svc: grpc.health.v1 says: $out"
  [[ $out == SERVING ]] || die "$svc: grpc.health.v1 says '$out'"
done
say "grpc.health.v1 (TLS): both gateways SERVING"
info=$("$engine" exec "$gw0" moe-client info --target gateway:50051 --tls-ca /run/secrets/ca 2>&1) ||
  die "moe-client info failed: $info"
echo "$info" | head -n 8 | sed 's/^/    /'

# ---- answers ------------------------------------------------------------------------------------
ready_ranks=$(grep -c '^  rank .* ready ' <<<"$info" || true)
[[ $ready_ranks -eq ${#services_rank[@]} ]] ||
  die "moe-client info lists $ready_ranks ready ranks, not ${#services_rank[@]}"
# The served layers: the line "layers  1..4 (4)" or "layers  1, 3..5 (4)".
layers=()
for part in $(sed -n 's/^layers *\([0-9., ]*\) (.*/\1/p' <<<"$info" | tr -d ' ' | tr ',' ' '); do
  if [[ $part == *..* ]]; then
    mapfile -t -O "${#layers[@]}" layers < <(seq "${part%..*}" "${part#*..}")
  else
    layers+=("$part")
  fi
done
[[ ${#layers[@]} -gt 0 ]] || die "no served layers in moe-client info"
cases=("${layers[0]} 1" "${layers[-1]} 33" "${layers[$((${#layers[@]} / 2))]} 64")
gw1=$(container_of gateway-1)
tls=(--tls-ca /run/secrets/ca)
in_ctr() { "$engine" exec "$1" bash -c "$2"; }
mismatches=0
n=0
printf '    %-6s %-7s %-18s %s\n' layer tokens "moe-forward sha256" "service answers (same bytes?)"
for c in "${cases[@]}"; do
  read -r layer tokens <<<"$c"
  n=$((n + 1))
  seed=$((20261207 + n))
  d=/tmp/image-check-$n
  fwd="moe-client forward --layer $layer --random $tokens --seed $seed"
  # Through the shared name (both gateways), to gateway-0 alone, and the reference, in gateway-0.
  out0=$(in_ctr "$gw0" "set -e; mkdir -p $d; cd $d
    $fwd --target gateway:50051 ${tls[*]} --save-input x.npy --output y-name.npy 2>/dev/null
    $fwd --target 127.0.0.1:50051 ${tls[*]} --output y-gw0.npy 2>/dev/null
    moe-forward --checkpoint /models/k3-mini --layer $layer --input x.npy --output ref.npy >/dev/null 2>&1
    sha256sum x.npy ref.npy y-name.npy y-gw0.npy") || die "layer $layer: calls in gateway-0 failed: $out0"
  # gateway-1 alone, in gateway-1.
  out1=$(in_ctr "$gw1" "set -e; mkdir -p $d; cd $d
    $fwd --target 127.0.0.1:50051 ${tls[*]} --save-input x.npy --output y-gw1.npy 2>/dev/null
    sha256sum x.npy y-gw1.npy") || die "layer $layer: calls in gateway-1 failed: $out1"
  # From the host's network through both published ports, with the image's client.
  outh=$("$engine" run --rm --no-healthcheck --network host -e MOE_CA="$ca_pem" "$image" bash -c "set -e; cd /tmp
    printf '%s\n' \"\$MOE_CA\" > ca.pem
    $fwd --target 127.0.0.1:$grpc0,127.0.0.1:$grpc1 --tls-ca ca.pem --save-input x.npy --output y-host.npy 2>/dev/null
    sha256sum x.npy y-host.npy") || die "layer $layer: the call through the published ports failed: $outh"
  sha() { awk -v f="$2" '$2 == f {print $1}' <<<"$1"; }
  x=$(sha "$out0" x.npy); ref=$(sha "$out0" ref.npy)
  [[ $(sha "$out1" x.npy) == "$x" && $(sha "$outh" x.npy) == "$x" ]] ||
    die "layer $layer: the --random inputs differ between calls (seed $seed)"
  verdict=""
  for pair in "name:$(sha "$out0" y-name.npy)" "gateway-0:$(sha "$out0" y-gw0.npy)" \
    "gateway-1:$(sha "$out1" y-gw1.npy)" "published:$(sha "$outh" y-host.npy)"; do
    if [[ ${pair#*:} == "$ref" ]]; then
      verdict+="${pair%%:*} yes, "
    else
      verdict+="${pair%%:*} NO, "
      mismatches=$((mismatches + 1))
    fi
  done
  printf '    %-6s %-7s %-18s %s\n' "$layer" "$tokens" "${ref:0:16}" "${verdict%, }"
done
checked=$((n * 4))
[[ $mismatches -eq 0 ]] || die "$mismatches of $checked answers differ from moe-forward"

result=PASS
echo
echo "image-check summary"
echo "  engine      $engine_version (${compose_cmd[*]})"
echo "  image       $image, ${size_mb} MB, version $img_version, revision $img_revision"
[[ $build -eq 0 ]] || echo "  build       ${build_s} s ($jobs jobs)"
echo "  ready       ${ready_s} s after start: 2 gateways and 4 ranks /readyz 200, both gateways SERVING"
echo "  answers     $checked of $checked bit-identical to moe-forward ($n cases x name, gateway-0, gateway-1, published ports)"

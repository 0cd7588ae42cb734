#!/usr/bin/env bash
# The main job of the README: on a fresh machine, installs what is missing, builds, generates
# the embedded k3-mini checkpoint, starts a local gateway + 4 expert ranks (moe-cluster), sends
# batches from the client, checks every output against the in-process layer (moe-forward),
# prints latency and per-rank load, and stops everything.
#
# Environment: MOE_DEMO_PORT (default 50051), MOE_DEMO_METRICS_PORT (default 9400),
# MOE_DEMO_RANKS (default 4), MOE_DEMO_REQUESTS (default 200).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
port=${MOE_DEMO_PORT:-50051}
metrics_port=${MOE_DEMO_METRICS_PORT:-9400}
ranks=${MOE_DEMO_RANKS:-4}
requests=${MOE_DEMO_REQUESTS:-200}
out=$root/out/demo
bin=$root/build/bin
py=/usr/bin/python3

step() { printf '\n== %s\n' "$*"; }

step "dependencies"
bash scripts/install-deps.sh

step "build"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target moe-ckpt moe-forward moe-gateway moe-rank moe-cluster moe-client

mkdir -p "$out"
ckpt=$root/out/k3-mini
if [ ! -f "$ckpt/model.safetensors.index.json" ]; then
  step "checkpoint: k3-mini (hidden 640, latent 320, 64 experts, top-2)"
  "$bin/moe-ckpt" --preset k3-mini --out "$ckpt" --quiet
fi

step "cluster: gateway + $ranks ranks on 127.0.0.1:$port"
"$bin/moe-cluster" --checkpoint "$ckpt" --ranks "$ranks" --port "$port" --metrics-port "$metrics_port" \
  --threads-per-rank 1 -- --threads 1 >"$out/cluster.out" 2>"$out/cluster.log" &
cluster=$!
stop_cluster() {
  if kill -0 "$cluster" 2>/dev/null; then
    kill -TERM "$cluster" 2>/dev/null || true
    wait "$cluster" 2>/dev/null || true
  fi
}
trap stop_cluster EXIT
for _ in $(seq 1 600); do
  grep -q "moe-cluster: ready" "$out/cluster.out" 2>/dev/null && break
  if ! kill -0 "$cluster" 2>/dev/null; then
    echo "moe-cluster exited early:"; tail -n 30 "$out/cluster.log"; exit 1
  fi
  sleep 0.1
done
grep "moe-cluster: ready" "$out/cluster.out" || { echo "cluster not ready"; tail -n 30 "$out/cluster.log"; exit 1; }
"$bin/moe-client" info --target "127.0.0.1:$port" | head -n 20

step "correctness: service vs in-process layer (moe-forward) on the same inputs"
$py - "$out" <<'EOF'
import sys, numpy as np
out = sys.argv[1]
rng = np.random.default_rng(2026)
for name, shape in [("x1", (1, 640)), ("x64", (64, 640)), ("x257", (1, 257, 640))]:
    np.save(f"{out}/{name}.npy", rng.standard_normal(shape).astype(np.float32))
EOF
for layer in 1 2; do
  for x in x1 x64 x257; do
    "$bin/moe-client" forward --target "127.0.0.1:$port" --layer "$layer" --input "$out/$x.npy" \
      --output "$out/${x}_l${layer}_service.npy"
    "$bin/moe-forward" --checkpoint "$ckpt" --layer "$layer" --input "$out/$x.npy" \
      --output "$out/${x}_l${layer}_local.npy" --threads 1 2>/dev/null
  done
done
$py - "$out" <<'EOF'
import sys, numpy as np
out, bad = sys.argv[1], 0
print(f"{'layer':>5} {'input':>14} {'rel L2':>10} {'max |diff|':>11} {'bit-identical':>14}")
for layer in (1, 2):
    for x in ("x1", "x64", "x257"):
        s = np.load(f"{out}/{x}_l{layer}_service.npy").astype(np.float64)
        l = np.load(f"{out}/{x}_l{layer}_local.npy").astype(np.float64)
        rel = np.linalg.norm(s - l) / np.linalg.norm(l)
        ok = rel <= 1e-5 and s.shape == l.shape
        bad += not ok
        print(f"{layer:>5} {str(s.shape):>14} {rel:>10.2e} {np.abs(s - l).max():>11.2e} {str(bool((s == l).all())):>14}")
print("correctness:", "PASS" if bad == 0 else f"FAIL ({bad} mismatches)")
sys.exit(1 if bad else 0)
EOF

step "latency: $requests requests per size, 4 concurrent callers, layer 1"
for tokens in 1 64; do
  "$bin/moe-forward" --checkpoint "$ckpt" --layer 1 --input "$out/x$tokens.npy" --output /dev/null \
    --repeat 20 --threads 1 2>&1 | sed 's/^/in-process: /'
  "$bin/moe-client" load --target "127.0.0.1:$port" --layer 1 --tokens "$tokens" --concurrency 4 \
    --requests "$requests"
done

step "load balance (gateway /metrics on :$metrics_port)"
curl -s "http://127.0.0.1:$metrics_port/metrics" | $py -c '
import sys, re, collections
tokens = collections.defaultdict(dict); balance = {}
for line in sys.stdin:
    m = re.match(r"moe_rank_tokens_total\{layer=\"(\d+)\",rank=\"(\d+)\"\} (\S+)", line)
    if m: tokens[int(m[1])][int(m[2])] = float(m[3])
    m = re.match(r"moe_load_balancedness\{layer=\"(\d+)\"\} (\S+)", line)
    if m: balance[int(m[1])] = float(m[2])
for layer in sorted(tokens):
    per_rank = "  ".join(f"rank {r}: {int(v):>6}" for r, v in sorted(tokens[layer].items()))
    print(f"layer {layer}: tokens dispatched  {per_rank}   balancedness (mean/max, window) {balance.get(layer, 1):.3f}")
'

step "stop"
stop_cluster
trap - EXIT
echo "demo finished: outputs and logs in $out"

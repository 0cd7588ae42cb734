#!/usr/bin/env bash
# The CPU tier measurements of docs/PERFORMANCE.md, on this host, in one command:
# the full Kimi K3 layer (896 MXFP4 experts) and Kimi K2 layer (384 FP8 experts) through
# `moe-bench layer` (JSON, gnuplot chart, stage and x-roofline charts), then the table of each
# run against the CPU targets (K3 within 2x of the roofline at 1-256 tokens, K2 within 2.5x at
# 1, 16 and 256 tokens).
#
#   scripts/bench-cpu-host.sh [--kernels TIER] [--tokens LIST] [--models k3,k2] [--repeat N]
#                             [--ckpt-dir DIR] [--out DIR] [--host-label NAME]
#
# --tokens: the token counts of both models (default K3 1,4,16,64,256; K2 1,16,256).
# --kernels: the tier to run (default: the best this host runs). A tier below the host's best is
#   a proxy run (e.g. avx2 on an AVX-512 host): the run's label and its files say so.
# --ckpt-dir: where the synthetic full-size checkpoints live (~15 GB each), generated with
#   moe-ckpt on first use (default $MOE_CKPT_DIR, else out/ckpt).
# --out: where the JSON and charts go (default out/bench; docs/bench is what docs/PERFORMANCE.md cites).
# --host-label: the host's name in file names (default: the CPU family from /proc/cpuinfo, e.g.
#   zen3 or intel-6-85).
# Needs a Release build in build/ (cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release), or
# its bin directory in MOE_BIN_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
bin=${MOE_BIN_DIR:-$root/build/bin}
kernels="" tokens_k3="1,4,16,64,256" tokens_k2="1,16,256" models="k3,k2" repeat=5
ckpt_dir=${MOE_CKPT_DIR:-$root/out/ckpt} out=$root/out/bench label=""
while [ $# -gt 0 ]; do
  case $1 in
    --kernels) kernels=$2; shift 2 ;;
    --tokens) tokens_k3=$2; tokens_k2=$2; shift 2 ;;
    --models) models=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --ckpt-dir) ckpt_dir=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --host-label) label=$2; shift 2 ;;
    -h | --help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-cpu-host: unknown argument $1 (--help)" >&2; exit 2 ;;
  esac
done
for tool in moe-bench moe-ckpt; do
  [ -x "$bin/$tool" ] || { echo "bench-cpu-host: $bin/$tool missing: build first (Release)" >&2; exit 1; }
done

# The host: vendor, family/model, the vector extensions the tiers use.
field() { grep -m1 "^$1[[:space:]]*:" /proc/cpuinfo | sed 's/^[^:]*: *//'; }
vendor=$(field vendor_id) family=$(field 'cpu family') model=$(field model)
flags=$(grep -o 'avx512_bf16\|avx512f\|avx512bw\|avx512vl\|avx2\|fma\|f16c' /proc/cpuinfo | sort -u | tr '\n' ' ')
if [ -z "$label" ]; then
  if [ "$vendor" = AuthenticAMD ]; then
    case $family in
      23) if [ "$model" -ge 48 ]; then label=zen2; else label=zen1; fi ;;
      25) if [ "$model" -lt 16 ] || { [ "$model" -ge 32 ] && [ "$model" -lt 96 ]; }; then label=zen3
          else label=zen4; fi ;;
      26) label=zen5 ;;
      *) label=amd-$family-$model ;;
    esac
  else
    label=intel-$family-$model
  fi
fi
best=$(env -u MOE_CPU_KERNELS "$bin/moe-bench" kernels --rows 16 --cols 128 --m 1 \
  | sed -n 's/^kernel throughput, cpu(\([a-z0-9-]*\),.*/\1/p')
tier=${kernels:-$best}
suffix=$tier-$label
proxy=""
if [ "$tier" != "$best" ]; then
  suffix=$tier-on-$label
  proxy=" (forced on a host that runs $best: a proxy run)"
fi
echo "host: $(field 'model name'), $vendor family $family model $model ($label), $(nproc) CPUs"
echo "      $flags"
echo "tier: $tier$proxy"
mkdir -p "$out" "$ckpt_dir"

run_model() {  # key preset tokens name
  local key=$1 preset=$2 tokens=$3 name=$4
  local ckpt=$ckpt_dir/$key
  if [ ! -f "$ckpt/model.safetensors.index.json" ]; then
    echo "== checkpoint $preset -> $ckpt (~15 GB, several minutes)"
    "$bin/moe-ckpt" --preset "$preset" --out "$ckpt" --quiet
  fi
  local base=$out/$key-full-cpu-$suffix
  echo "== $name, tier $tier, tokens $tokens"
  "$bin/moe-bench" layer --checkpoint "$ckpt" --kernels "$tier" --tokens "$tokens" \
    --repeat "$repeat" --gemm=false --label "$name, $tier tier, $label host$proxy" \
    --json "$base.json" --plot "$base.png"
  if /usr/bin/python3 -c 'import matplotlib' 2>/dev/null; then
    /usr/bin/python3 scripts/plot-bench.py "$base.json" >/dev/null
  fi
}
IFS=, read -r -a wanted <<<"$models"
for m in "${wanted[@]}"; do
  case $m in
    k3) run_model k3 kimi-k3 "$tokens_k3" "Kimi K3 full layer" ;;
    k2) run_model k2 kimi-k2 "$tokens_k2" "Kimi K2 full layer" ;;
    *) echo "bench-cpu-host: unknown model $m (k3, k2)" >&2; exit 2 ;;
  esac
done

# Each run against its target: the median over the roofline measured in the same run.
/usr/bin/python3 - "$out" "$suffix" "${wanted[@]}" <<'EOF'
import json, os, sys
out, suffix, models = sys.argv[1], sys.argv[2], sys.argv[3:]
targets = {"k3": (2.0, {1, 4, 16, 64, 256}), "k2": (2.5, {1, 16, 256})}
print(f"\n{'model':5} {'tokens':>6} {'median ms':>10} {'roofline ms':>11} {'x roof':>7} "
      f"{'target':>13}  route / experts / shared / finish ms")
for m in models:
    path = os.path.join(out, f"{m}-full-cpu-{suffix}.json")
    run = json.load(open(path))
    limit, at = targets[m]
    for r in run["rows"]:
        x = r["median_ms"] / r["roofline_ms"]
        target = (f"{limit}x " + ("meets" if x <= limit else "misses")) if r["tokens"] in at else "-"
        stages = " / ".join(f"{r[k]:.1f}" for k in ("route_ms", "experts_ms", "shared_ms", "finish_ms"))
        print(f"{m:5} {r['tokens']:>6} {r['median_ms']:>10.1f} {r['roofline_ms']:>11.1f} {x:>7.2f} "
              f"{target:>13}  {stages}")
    print(f"  ({path})")
EOF

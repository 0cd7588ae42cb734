#!/usr/bin/env bash
# Triton's perf_analyzer against a running gateway, over the Open Inference Protocol.
#
#   scripts/perf-analyzer.sh [--target HOST:PORT] [--layer L] [--tokens T] [--concurrency C1:C2:STEP]
#                            [-- more perf_analyzer flags]
#
# Makes (once) a venv with tritonclient from PyPI (scripts/kserve-requirements.txt) under
# build/kserve-venv, writes bf16 inputs of random normal values (perf_analyzer's own random
# bytes would hold NaNs, which the gateway refuses), and reports latency and throughput per
# concurrency. Needs Debian's libb64-0d (scripts/install-deps.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."

target=127.0.0.1:50051 layer="" tokens=64 concurrency=1:4:3
while [ $# -gt 0 ]; do
  case "$1" in
    --target) target=$2; shift 2 ;;
    --layer) layer=$2; shift 2 ;;
    --tokens) tokens=$2; shift 2 ;;
    --concurrency) concurrency=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "perf-analyzer.sh: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
done

venv=build/kserve-venv
if ! cmp -s scripts/kserve-requirements.txt "$venv/moe-requirements.txt"; then
  /usr/bin/python3 -m venv --clear "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r scripts/kserve-requirements.txt
  cp scripts/kserve-requirements.txt "$venv/moe-requirements.txt"
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The model (first served layer unless --layer), its hidden size, and the input file.
read -r model hidden < <("$venv/bin/python" - "$target" "$layer" "$tokens" "$work/input.json" <<'PY'
import base64, json, sys
import numpy as np
import tritonclient.grpc as triton
target, layer, tokens, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
client = triton.InferenceServerClient(target)
model = f"moe-layer-{layer}" if layer else None
if model is None:
    for l in range(1, 1000):
        if client.is_model_ready(f"moe-layer-{l}"):
            model = f"moe-layer-{l}"
            break
if model is None or not client.is_model_ready(model):
    sys.exit(f"perf-analyzer.sh: no ready model {model or 'moe-layer-<L>'} at {target}")
hidden = int(client.get_model_metadata(model, as_json=True)["inputs"][0]["shape"][1])
rng = np.random.default_rng(0)
data = []
for _ in range(8):
    bits = rng.standard_normal((tokens, hidden)).astype(np.float32).view(np.uint32).astype(np.uint64)
    bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
    data.append({"hidden_states": {"b64": base64.b64encode(bf16.tobytes()).decode(), "shape": [tokens, hidden]}})
json.dump({"data": data}, open(out, "w"))
print(model, hidden)
PY
)
lib=$("$venv/bin/python" -c "import nvidia.cuda_runtime, os; print(os.path.join(nvidia.cuda_runtime.__path__[0], 'lib'))")
echo "perf-analyzer.sh: $model at $target, $tokens tokens x $hidden bf16 per request"
LD_LIBRARY_PATH=$lib "$venv/bin/perf_analyzer" -m "$model" -i grpc -u "$target" \
  --input-data "$work/input.json" --shape "hidden_states:$tokens,$hidden" \
  --concurrency-range "$concurrency" "$@"

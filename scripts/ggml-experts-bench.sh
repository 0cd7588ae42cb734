#!/usr/bin/env bash
# llama.cpp's CPU MoE path (ggml's mul_mat_id on MXFP4) for the routed experts of Kimi K3, timed
# on this host: the reference point docs/PERFORMANCE.md pairs with `moe-bench layer`'s experts stage.
#
#   scripts/ggml-experts-bench.sh GGML_SRC [--isa avx2|native] [-- ggml-experts-bench flags]
#
# GGML_SRC: a ggml source tree (github.com/ggml-org/ggml; docs/PERFORMANCE.md's pairing used d99724f2).
# --isa avx2: ggml built for AVX2 + FMA + F16C only, the counterpart of the avx2 tier (forced or
#   not); native (default): for this host's CPU. Flags after -- go to the benchmark (defaults:
#   --experts 896 --top-k 16 --hidden 3584 --expert-hidden 3072 --tokens 1,4,16,64,256
#   --repeat 5 --threads 2). Needs ~16 GB of memory for the K3 experts' weights.
# Run it right before and after `moe-bench layer` (or scripts/bench-cpu-host.sh) on the same
# host: these VMs change speed from minute to minute.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
[ $# -ge 1 ] || { sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2; }
src=$(cd "$1" && pwd)
shift
isa=native
while [ $# -gt 0 ]; do
  case $1 in
    --isa) isa=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "ggml-experts-bench: unknown argument $1" >&2; exit 2 ;;
  esac
done
case $isa in
  native) flags=(-DGGML_NATIVE=ON) ;;
  avx2) flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
               -DGGML_BMI2=ON -DGGML_AVX512=OFF) ;;
  *) echo "ggml-experts-bench: --isa avx2 or native" >&2; exit 2 ;;
esac
build=$root/out/ggml-experts-$isa
cmake -S tools/ggml_experts -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_SRC="$src" "${flags[@]}" >/dev/null
cmake --build "$build" -j"$(nproc)" --target ggml-experts-bench >/dev/null
echo "ggml $(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo "(no git: $src)"), built for $isa"
"$build/ggml-experts-bench" "$@"

#!/usr/bin/python3
"""A/B comparison of two moe-bench builds' dot kernels on a noisy host.

    scripts/ab-kernels.py BASE NEW [--rounds 15] [--rows 48] [--cols 3584] [--m 1,2,4,8]
                          [--threads 1] [--formats bf16,mxfp4,fp8] [--stream] [--kernels T]
                          [--dtype bf16|fp32]

BASE and NEW are two moe-bench binaries (e.g. a copy of build/bin/moe-bench made before a change,
and the rebuilt one). Their `moe-bench kernels` runs alternate, round after round, so that both
see the same host states; per format and operand-row count M it prints the min, lower quartile
and median time of each, the ratio of the medians, and a paired sign test over the rounds (how
often NEW beat BASE in the same round, and the two-sided binomial p-value of that count).

Why: on a shared 2-vCPU guest the same kernel's time was seen to vary by 1.5x from minute to
minute, and a min of 5 runs still moved by +-20% between sweeps. A change is only called faster
here when the medians and the paired rounds agree (p < 0.05); anything else is "unclear".
"""
import argparse
import math
import os
import subprocess
import sys
from collections import defaultdict

FORMATS = ("bf16", "mxfp4", "fp8")


def run_once(binary, args):
    cmd = [binary, "kernels", "--threads", str(args.threads), "--rows", str(args.rows),
           "--cols", str(args.cols), "--m", args.m]
    if args.stream:
        cmd.append("--stream")
    if args.kernels:
        cmd += ["--kernels", args.kernels]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"ab-kernels: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr.strip()}")
    times = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[0] in FORMATS:
            times[(parts[0], int(parts[1]))] = float(parts[2])
    if not times:
        sys.exit(f"ab-kernels: no kernel rows in the output of {' '.join(cmd)}:\n{proc.stdout}")
    return times


def quantile(sorted_values, q):
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def sign_test_p(wins, n):
    """Two-sided exact binomial p-value of `wins` successes in n fair trials."""
    if n == 0:
        return 1.0
    k = min(wins, n - wins)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--cols", type=int, default=3584)
    parser.add_argument("--m", default="1,2,4,8")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--kernels", default="")
    parser.add_argument("--dtype", default="", help="the dot products' precision (default bf16)")
    args = parser.parse_args()
    for binary in (args.base, args.new):
        if not os.access(binary, os.X_OK):
            sys.exit(f"ab-kernels: {binary} is not an executable moe-bench")
    if args.rounds < 1:
        sys.exit("ab-kernels: --rounds must be at least 1")
    formats = [f for f in args.formats.split(",") if f]
    for f in formats:
        if f not in FORMATS:
            sys.exit(f"ab-kernels: unknown format '{f}' (one of {', '.join(FORMATS)})")

    base, new = defaultdict(list), defaultdict(list)
    wins = defaultdict(int)
    for r in range(args.rounds):
        # Alternate which binary goes first, so neither always runs right after the other.
        order = [("base", args.base), ("new", args.new)]
        if r % 2:
            order.reverse()
        got = {name: run_once(binary, args) for name, binary in order}
        for key, t in got["base"].items():
            if key[0] not in formats or key not in got["new"]:
                continue
            base[key].append(t)
            new[key].append(got["new"][key])
            wins[key] += got["new"][key] < t
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    print(f"ab-kernels: {args.rounds} alternating rounds, W [{args.rows}, {args.cols}], "
          f"{args.threads} thread(s), weights {'streamed' if args.stream else 'in cache'}")
    print(f"  base: {args.base}\n  new:  {args.new}")
    print(f"{'format':>6} {'M':>3} | {'base min':>9} {'q1':>9} {'median':>9} | "
          f"{'new min':>9} {'q1':>9} {'median':>9} | {'new/base':>8} {'wins':>6} {'p':>6}  verdict")
    for key in sorted(base, key=lambda k: (FORMATS.index(k[0]), k[1])):
        b, n = sorted(base[key]), sorted(new[key])
        rounds = len(b)
        ratio = quantile(n, 0.5) / quantile(b, 0.5)
        p = sign_test_p(wins[key], rounds)
        verdict = "unclear"
        if p < 0.05 and ratio < 1 and wins[key] * 2 > rounds:
            verdict = "faster"
        elif p < 0.05 and ratio > 1 and wins[key] * 2 < rounds:
            verdict = "slower"
        print(f"{key[0]:>6} {key[1]:>3} | {b[0]:9.1f} {quantile(b, 0.25):9.1f} "
              f"{quantile(b, 0.5):9.1f} | {n[0]:9.1f} {quantile(n, 0.25):9.1f} "
              f"{quantile(n, 0.5):9.1f} | {ratio:8.3f} {wins[key]:>3}/{rounds:<2} {p:6.3f}  "
              f"{verdict}")
    print("times in us per matrix; wins: rounds in which new was faster than base; p: two-sided "
          "sign test")


if __name__ == "__main__":
    main()

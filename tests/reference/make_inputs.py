#!/usr/bin/python3
"""Writes a seeded random MoE-layer input .npy (N(0, 1) entries) for tests.

  /usr/bin/python3 tests/reference/make_inputs.py --shape 257,7168 --seed 1 \
      [--dtype float32|float16] [--scale 1.0] --output x.npy

Entries are never all zero (a zero input hides routing and rounding bugs).
"""

import argparse
import sys

import numpy as np


def make_input(shape, seed=0, dtype="float32", scale=1.0):
    """A [T, H] or [B, T, H] array of seeded N(0, scale^2) values in float32 or float16."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(tuple(shape), dtype=np.float32) * np.float32(scale)
    return x.astype(np.dtype(dtype))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, help="comma-separated, e.g. 3,640 or 2,5,640")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    p.add_argument("--scale", type=float, default=1.0, help="standard deviation")
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    shape = [int(d) for d in args.shape.replace("x", ",").split(",") if d]
    if len(shape) not in (2, 3) or min(shape) < 1:
        p.error("shape must be [T, H] or [B, T, H] with positive sizes")
    if args.scale <= 0:
        p.error("scale must be positive")
    np.save(args.output, make_input(shape, args.seed, args.dtype, args.scale))
    return 0


if __name__ == "__main__":
    sys.exit(main())

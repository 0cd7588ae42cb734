#!/usr/bin/python3
"""The README's quick commands (the block under "## Binaries" that starts with moe-ckpt) run as
written: the block is taken from README.md, given a free port and a scratch checkpoint path, and
run by bash -e in a scratch directory whose build/ is the build tree. It must exit 0, the cluster
it starts must exit 0 after the block's `kill %1`, and the two forwards of the same input must
give the same bytes.

usage: readme_quickstart_test.py --build-dir DIR [--source-dir DIR]
"""

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile

import numpy as np

MARKER = "build/bin/moe-ckpt --preset k3-mini --out /tmp/k3-mini"


def quick_block(readme):
    for block in re.findall(r"```bash\n(.*?)```", readme, re.S):
        if block.startswith(MARKER):
            return block
    sys.exit(f"readme_quickstart_test: no ```bash block starting with '{MARKER}' in README.md")


def free_port_pair():
    """A port p with p and p + 1 (moe-cluster's control port) free."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    sys.exit("readme_quickstart_test: no free port pair")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build-dir", required=True)
    parser.add_argument("--source-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    args = parser.parse_args()
    with open(os.path.join(args.source_dir, "README.md"), encoding="utf-8") as f:
        block = quick_block(f.read())
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port_pair()
        script = block.replace("/tmp/k3-mini", os.path.join(tmp, "k3-mini")).replace("50051", str(port))
        # Wait for the cluster the block stopped; its exit code is the script's.
        script = "set -euo pipefail\n" + script + "wait %1\n"
        os.symlink(os.path.abspath(args.build_dir), os.path.join(tmp, "build"))
        run = subprocess.run(["bash", "-c", script], cwd=tmp, capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            print(run.stdout[-4000:], run.stderr[-6000:], sep="\n")
            sys.exit(f"readme_quickstart_test: the block exited {run.returncode}")
        y, y2 = np.load(os.path.join(tmp, "y.npy")), np.load(os.path.join(tmp, "y2.npy"))
        if y.shape != (8, 640) or y.tobytes() != y2.tobytes():
            sys.exit(f"readme_quickstart_test: forward --random and forward --input of its saved input differ "
                     f"({y.shape} vs {y2.shape})")
        with open(os.path.join(tmp, "placement.txt"), encoding="utf-8") as f:
            if not f.read().strip():
                sys.exit("readme_quickstart_test: placement.txt is empty")
        for expected in ("rank balancedness", "requests       200 (ok 200, errors 0)"):
            if expected not in run.stdout:
                print(run.stdout[-4000:])
                sys.exit(f"readme_quickstart_test: '{expected}' not in the output")
    print("readme_quickstart_test: the quick commands ran as written")


if __name__ == "__main__":
    main()

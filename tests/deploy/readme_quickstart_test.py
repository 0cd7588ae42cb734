#!/usr/bin/python3
"""The README's quick commands (the block under "## Quick start" that starts with moe-ckpt) run as
written: the block is taken from README.md, given a free port and a scratch checkpoint path, and
run by bash -e in a scratch directory whose build/ is the build tree. It must exit 0, the cluster
it starts must exit 0 after the block's `kill %1`, and the two forwards of the same input must
give the same bytes.

The Python client's example (the block under "## Clients" that starts with the venv) runs as
written too, against that cluster just before the `kill %1`: given the same port, a scratch venv
path, and a copy of client/python as its ./client/python (pip builds in the source directory). It
must print a bf16 [4, 640] output with its routing and the NOT_FOUND of layer 99.

usage: readme_quickstart_test.py --build-dir DIR [--source-dir DIR]
"""

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

import numpy as np

MARKER = "build/bin/moe-ckpt --preset k3-mini --out /tmp/k3-mini"
PYTHON_MARKER = "/usr/bin/python3 -m venv --system-site-packages /tmp/moe-venv"
STOP = "kill %1"


def quick_block(readme, marker=MARKER):
    for block in re.findall(r"```bash\n(.*?)```", readme, re.S):
        if block.startswith(marker):
            return block
    sys.exit(f"readme_quickstart_test: no ```bash block starting with '{marker}' in README.md")


def before_stop(block, inserted):
    """`block` with `inserted` run just before its line that stops the cluster."""
    lines = block.splitlines(keepends=True)
    at = next((i for i, line in enumerate(lines) if line.startswith(STOP)), None)
    if at is None:
        sys.exit(f"readme_quickstart_test: the quick block has no line starting with '{STOP}'")
    return "".join(lines[:at]) + inserted + "".join(lines[at:])


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
        readme = f.read()
    block, python_block = quick_block(readme), quick_block(readme, PYTHON_MARKER)
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port_pair()
        python_block = python_block.replace("/tmp/moe-venv", os.path.join(tmp, "moe-venv"))
        shutil.copytree(os.path.join(args.source_dir, "client", "python"), os.path.join(tmp, "client", "python"),
                        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        script = before_stop(block, python_block)
        script = script.replace("/tmp/k3-mini", os.path.join(tmp, "k3-mini")).replace("50051", str(port))
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
        # The Python example: a bf16 [4, 640] output with top-2 routing of 64 experts, then the error.
        routed = re.search(r"^torch\.bfloat16 \(4, 640\) (\[\[.*\]\])$", run.stdout, re.M)
        ids = json.loads(routed.group(1)) if routed else []
        if len(ids) != 4 or any(len(row) != 2 or not all(0 <= e < 64 for e in row) for row in ids):
            print(run.stdout[-4000:])
            sys.exit("readme_quickstart_test: the Python example printed no bf16 [4, 640] output with its routing")
        if not re.search(r"^NOT_FOUND \S.*\b99\b", run.stdout, re.M):
            print(run.stdout[-4000:])
            sys.exit("readme_quickstart_test: the Python example printed no NOT_FOUND for layer 99")
    print("readme_quickstart_test: the quick commands and the Python client example ran as written")


if __name__ == "__main__":
    main()
